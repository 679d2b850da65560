"""API keys: the keys file (key hashes, tenants, their limits) and the edge's live view of it.

The file holds SHA-256 hashes, never keys. A key is 256 random bits, so a plain (unkeyed,
fast) hash cannot be reversed by guessing; a slow hash is for low-entropy passwords.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import structlog
from pydantic import Field, ValidationError

from services.edge.quotas import TenantLimits
from shared.cascades import PLAN_NAME
from shared.messages import Model, error_message

log = structlog.get_logger()

KEY_PREFIX = "tb-"  # lets secret scanners and people recognise a tokenbus key
TENANT_NAME = r"^[A-Za-z0-9._-]{1,64}$"
# What a key may do beyond asking: `pin_variant`, name the variant of a model its requests
# run on (`ChatRequest.variant`: offline evaluations, services/scheduler/pinned.py).
Scope = Literal["pin_variant"]
PIN_VARIANT: Scope = "pin_variant"


class KeyEntry(Model):
    id: str = Field(pattern=r"^k-[0-9a-f]{8,32}$", description="Names the key in lists and logs.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the key, hex.")
    tenant: str = Field(pattern=TENANT_NAME)
    created_at: float = Field(description="Unix time, seconds.")
    scopes: list[Scope] = Field(
        default_factory=list,
        description="What the key may do beyond asking: pin_variant (name a request's variant).",
    )
    plan: str | None = Field(
        default=None,
        pattern=PLAN_NAME,
        description="The key's plan, stamped on its requests: a route's rules may match it"
        " (TOKENBUS_ROUTES); unset: none.",
    )


class KeysFile(Model):
    """The whole file: tenants with their limits, and the keys that act for them."""

    version: Literal[1] = 1
    tenants: dict[str, TenantLimits] = Field(default_factory=dict)
    keys: list[KeyEntry] = Field(default_factory=list)


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def load(path: Path) -> KeysFile:
    """The keys file at `path`; a missing file is an empty one (no key is valid)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return KeysFile()
    return KeysFile.model_validate_json(text)


def save(path: Path, keys: KeysFile) -> None:
    """Replace the file atomically (an edge never reads half of it), readable by its owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(keys.model_dump_json(indent=2) + "\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def add_key(
    keys: KeysFile,
    tenant: str,
    limits: dict[str, object],
    now: float,
    scopes: Sequence[Scope] = (),
    plan: str | None = None,
) -> tuple[KeysFile, str, KeyEntry]:
    """A new key for `tenant`, with `scopes`; `limits` (fields of TenantLimits) update the
    tenant's limits."""
    current = keys.tenants.get(tenant, TenantLimits())
    updated = TenantLimits.model_validate({**current.model_dump(), **limits})
    key = new_key()
    entry = KeyEntry(
        id="k-" + secrets.token_hex(6),
        sha256=hash_key(key),
        tenant=tenant,
        created_at=now,
        scopes=sorted(set(scopes)),
        plan=plan,
    )
    result = KeysFile(tenants={**keys.tenants, tenant: updated}, keys=[*keys.keys, entry])
    return result, key, entry


def revoke(keys: KeysFile, id_or_key: str) -> tuple[KeysFile, list[KeyEntry]]:
    """Remove the key with this id (or this key itself); the tenant and its limits stay."""
    digest = hash_key(id_or_key)
    gone = [e for e in keys.keys if e.id == id_or_key or e.sha256 == digest]
    kept = [e for e in keys.keys if e not in gone]
    return keys.model_copy(update={"keys": kept}), gone


@dataclass(frozen=True)
class Principal:
    """Who a valid key speaks for: the tenant's name, the key's id, the tenant's limits now,
    and what the key may do beyond asking."""

    tenant: str
    key_id: str
    key_sha256: str
    limits: TenantLimits
    scopes: frozenset[str] = frozenset()
    plan: str | None = None  # stamped on its requests (RequestRecord.plan)


class KeyStore:
    """The keys file as the edge sees it, read again whenever it changes on disk.

    A change is a new (mtime, size, inode), found by one `stat` per lookup: a revoked key
    stops working at its next use, without a restart. A file that does not parse keeps the
    last good one (logged), so a bad edit does not lock every tenant out.

    Caller: the edge's sockets, on one event loop.
    Affects: only its own cache of the file.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = None
        self._by_hash: dict[str, Principal] = {}
        self.refresh()

    def lookup(self, key: str) -> Principal | None:
        """The principal of `key`, or None for an unknown or revoked key."""
        self.refresh()
        return self._by_hash.get(hash_key(key))

    def current(self, principal: Principal) -> Principal | None:
        """`principal` as the file says now (new limits), or None once its key is revoked."""
        self.refresh()
        return self._by_hash.get(principal.key_sha256)

    def __len__(self) -> int:
        return len(self._by_hash)

    def refresh(self) -> None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            if self._seen is not None or self._by_hash:
                log.warning("keys.file_missing", path=str(self.path), keys=0)
            self._seen, self._by_hash = None, {}
            return
        seen = (st.st_mtime_ns, st.st_size, st.st_ino)
        if seen == self._seen:
            return
        self._seen = seen
        try:
            keys = load(self.path)
        except (OSError, ValueError, ValidationError) as exc:
            log.error(
                "keys.file_invalid",
                path=str(self.path),
                error=error_message(exc)[:300],
                kept="last",
            )
            return
        limits = {e.tenant: keys.tenants.get(e.tenant, TenantLimits()) for e in keys.keys}
        self._by_hash = {
            e.sha256: Principal(
                e.tenant, e.id, e.sha256, limits[e.tenant], frozenset(e.scopes), e.plan
            )
            for e in keys.keys
        }
        log.info("keys.loaded", path=str(self.path), keys=len(self._by_hash))
