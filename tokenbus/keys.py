"""`tokenbus keys`: create, list and revoke the edge's API keys; the development key of `up`."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, get_args

from pydantic import SecretStr, ValidationError

from services.edge import keys as keyfile
from services.edge.auth import tenant_id
from services.edge.resume import ResumeKeys
from services.edge.settings import KeysSettings

if TYPE_CHECKING:
    from tokenbus.commands import Subcommands

STATE_DIR = Path(".tokenbus")  # local state of `tokenbus up`, beside its traces
DEV_TENANT = "dev"
# A local development key: generous, so `tokenbus bench run` against `up` is not throttled.
DEV_LIMITS: dict[str, object] = {
    "rps": 200.0,
    "burst": 400,
    "concurrency": 1024,
    "tokens_per_min": 20_000_000,
    "sockets": 256,
}
LIMIT_FLAGS = ("rps", "burst", "concurrency", "tokens_per_min", "sockets", "replays", "guided")


def local_keys() -> tuple[Path, str | None]:
    """For `tokenbus up`: the keys file (absolute) and its development key, if it uses one."""
    keys_file = KeysSettings().edge_keys_file.absolute()
    return keys_file, ensure_dev_key(keys_file, STATE_DIR.absolute())


def ensure_dev_key(keys_path: Path, state_dir: Path) -> str | None:
    """The development key `up` prints: kept in `state_dir/dev-key`, made if no key exists.

    None when the keys file already holds keys other than the development key: the
    operator configured keys, and `up` does not add one of its own.
    """
    keys = keyfile.load(keys_path)
    saved = state_dir / "dev-key"
    if saved.exists():
        key = saved.read_text().strip()
        if any(e.sha256 == keyfile.hash_key(key) for e in keys.keys):
            return key
    if keys.keys:
        return None
    keys, key, _entry = keyfile.add_key(keys, DEV_TENANT, DEV_LIMITS, time.time())
    keyfile.save(keys_path, keys)
    state_dir.mkdir(parents=True, exist_ok=True)
    saved.touch(mode=0o600)
    saved.write_text(key + "\n")
    return key


def register(commands: Subcommands) -> None:
    parser = commands.add_parser("keys", help="manage the edge's API keys (the keys file)")
    parser.add_argument(
        "--file",
        type=Path,
        default=None,
        help="keys file (default: $TOKENBUS_EDGE_KEYS_FILE or .tokenbus/keys.json)",
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = actions.add_parser("create", help="add a key for a tenant; prints the key once")
    create.add_argument("--tenant", required=True, help="tenant name (letters, digits, . _ -)")
    for flag in LIMIT_FLAGS:
        create.add_argument(
            "--" + flag.replace("_", "-"),
            type=float if flag == "rps" else int,
            default=None,
            help=f"the tenant's {flag} limit (default: kept, or the built-in default)",
        )
    create.add_argument(
        "--scope",
        action="append",
        choices=get_args(keyfile.Scope),
        default=[],
        help="what the key may do beyond asking (repeatable): pin_variant, name the variant"
        " its requests run on (for `tokenbus eval` through the edge)",
    )
    create.add_argument(
        "--plan",
        default=None,
        help="the key's plan, stamped on its requests: a route's rules may start them on"
        " another model of its cascade (TOKENBUS_ROUTES; docs/lifecycle.md)",
    )
    create.set_defaults(handler=_create)
    listing = actions.add_parser("list", help="keys (ids, tenants) and limits; no secrets")
    listing.set_defaults(handler=_list)
    revoke = actions.add_parser("revoke", help="remove a key; edges stop accepting it at once")
    revoke.add_argument("key", help="the key's id (k-...) or the key itself")
    revoke.set_defaults(handler=_revoke)


def _path(args: argparse.Namespace) -> Path:
    given: Path | None = args.file
    return given if given is not None else KeysSettings().edge_keys_file


def _create(args: argparse.Namespace) -> int:
    path = _path(args)
    limits = {f: getattr(args, f) for f in LIMIT_FLAGS if getattr(args, f) is not None}
    try:
        keys, key, entry = keyfile.add_key(
            keyfile.load(path), args.tenant, limits, time.time(), args.scope, args.plan
        )
    except ValidationError as exc:
        print(f"tokenbus keys create: {exc.errors()[0]['msg']}", file=sys.stderr)
        return 2
    keyfile.save(path, keys)
    print(f"created {entry.id} for tenant {entry.tenant} in {path}", file=sys.stderr)
    print("the key is shown once; keep it secret:", file=sys.stderr)
    print(key, flush=True)
    return 0


def _list(args: argparse.Namespace) -> int:
    path = _path(args)
    keys = keyfile.load(path)
    print(f"{len(keys.keys)} key(s) in {path}")
    for entry in keys.keys:
        created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(entry.created_at))
        scopes = f"  scopes={','.join(entry.scopes)}" if entry.scopes else ""
        plan = f"  plan={entry.plan}" if entry.plan else ""
        print(f"{entry.id}  tenant={entry.tenant}  created={created}{scopes}{plan}")
    ids = _tenant_ids()
    for tenant, limits in sorted(keys.tenants.items()):
        shown = " ".join(f"{k}={v}" for k, v in limits.model_dump(exclude={"burst"}).items())
        known = f" id={ids(tenant)}" if ids is not None else ""
        print(f"tenant {tenant}:{known} {shown} (burst={limits.request_burst})")
    if ids is None:
        print(
            "(set TOKENBUS_RESUME_SECRET or _SECRETS as the edges have it to see each tenant's"
            " id, the name its requests carry: TOKENBUS_SCHEDULER_TENANT_WEIGHTS keys)"
        )
    return 0


def _tenant_ids() -> Callable[[str], str] | None:
    """Tenant name -> the id the edges stamp on its requests (a keyed hash under the resume
    signing key: what the scheduler's fair-share weights name); None without the secret."""
    single, listed = (
        os.environ.get("TOKENBUS_RESUME_SECRET"),
        os.environ.get("TOKENBUS_RESUME_SECRETS"),
    )
    try:
        resume = ResumeKeys.from_settings(
            SecretStr(single) if single else None, SecretStr(listed) if listed else None
        )
    except ValueError:
        return None
    secret = resume.keys[resume.signing_kid].get_secret_value().encode()
    return lambda tenant: tenant_id(secret, tenant)


def _revoke(args: argparse.Namespace) -> int:
    path = _path(args)
    keys, gone = keyfile.revoke(keyfile.load(path), args.key)
    if not gone:
        print(f"tokenbus keys revoke: no such key in {path}", file=sys.stderr)
        return 1
    keyfile.save(path, keys)
    for entry in gone:
        print(f"revoked {entry.id} (tenant {entry.tenant})")
    return 0
