"""The keys file and `tokenbus keys`: hashes only, live reload, revocation, the dev key."""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

import pytest

from services.edge import keys as keyfile
from services.edge.auth import tenant_id
from services.edge.keys import KeyStore
from services.edge.quotas import TenantLimits
from tokenbus.cli import main
from tokenbus.keys import ensure_dev_key


def create(path: Path, tenant: str, *flags: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["keys", "--file", str(path), "create", "--tenant", tenant, *flags]) == 0
    key = capsys.readouterr().out.strip().splitlines()[-1]  # after any log line of the store
    assert key.startswith(keyfile.KEY_PREFIX)
    return key


def test_create_stores_a_hash_not_the_key_and_the_tenants_limits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "keys.json"
    key = create(path, "acme", "--rps", "2.5", "--sockets", "3", capsys=capsys)
    text = path.read_text()
    assert key not in text
    assert keyfile.hash_key(key) in text
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    keys = keyfile.load(path)
    assert keys.tenants["acme"] == TenantLimits(rps=2.5, sockets=3)
    # A second key keeps the limits it does not name.
    create(path, "acme", "--concurrency", "4", capsys=capsys)
    assert keyfile.load(path).tenants["acme"] == TenantLimits(rps=2.5, sockets=3, concurrency=4)


def test_list_shows_no_secrets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "keys.json"
    key = create(path, "acme", capsys=capsys)
    assert main(["keys", "--file", str(path), "list"]) == 0
    out = capsys.readouterr().out
    assert "tenant=acme" in out
    assert key not in out
    assert keyfile.hash_key(key) not in out


def test_list_names_each_tenants_id_as_the_edges_stamp_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fair-share weights name tenant ids (the keyed hash the edges stamp), which only
    the resume secret can compute: `keys list` shows them where the secret is set."""
    path = tmp_path / "keys.json"
    create(path, "acme", capsys=capsys)
    monkeypatch.delenv("TOKENBUS_RESUME_SECRETS", raising=False)
    monkeypatch.delenv("TOKENBUS_RESUME_SECRET", raising=False)
    assert main(["keys", "--file", str(path), "list"]) == 0
    assert "id=t-" not in (out := capsys.readouterr().out)
    assert "TOKENBUS_SCHEDULER_TENANT_WEIGHTS" in out
    secret = secrets.token_urlsafe(32)
    monkeypatch.setenv("TOKENBUS_RESUME_SECRET", secret)
    assert main(["keys", "--file", str(path), "list"]) == 0
    out = capsys.readouterr().out
    assert f"tenant acme: id={tenant_id(secret.encode(), 'acme')} " in out
    assert secret not in out


def test_bad_tenant_name_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "keys.json"
    assert main(["keys", "--file", str(path), "create", "--tenant", "no spaces"]) == 2
    assert not path.exists()


def test_the_store_sees_a_revocation_without_a_restart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "keys.json"
    store = KeyStore(path)
    assert store.lookup("tb-anything") is None  # no file: no key is valid
    key = create(path, "acme", "--rps", "7", capsys=capsys)
    principal = store.lookup(key)
    assert principal is not None
    assert principal.tenant == "acme"
    assert principal.limits.rps == 7
    entry_id = keyfile.load(path).keys[0].id
    assert main(["keys", "--file", str(path), "revoke", entry_id]) == 0
    assert store.lookup(key) is None
    assert store.current(principal) is None
    assert main(["keys", "--file", str(path), "revoke", entry_id]) == 1  # gone already


def test_revoke_by_the_key_itself(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "keys.json"
    key = create(path, "acme", capsys=capsys)
    other = create(path, "acme", capsys=capsys)
    assert main(["keys", "--file", str(path), "revoke", key]) == 0
    store = KeyStore(path)
    assert store.lookup(key) is None
    assert store.lookup(other) is not None


def test_new_limits_reach_a_principal_in_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "keys.json"
    key = create(path, "acme", "--rps", "1", capsys=capsys)
    store = KeyStore(path)
    principal = store.lookup(key)
    assert principal is not None
    create(path, "acme", "--rps", "9", capsys=capsys)
    now = store.current(principal)
    assert now is not None
    assert now.limits.rps == 9


def test_a_broken_file_keeps_the_last_good_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "keys.json"
    key = create(path, "acme", capsys=capsys)
    store = KeyStore(path)
    path.write_text("{ not json")
    assert store.lookup(key) is not None


def test_dev_key_is_made_once_and_reused(tmp_path: Path) -> None:
    path, state = tmp_path / "keys.json", tmp_path / "state"
    key = ensure_dev_key(path, state)
    assert key is not None
    assert ensure_dev_key(path, state) == key
    assert stat.S_IMODE(os.stat(state / "dev-key").st_mode) == 0o600
    principal = KeyStore(path).lookup(key)
    assert principal is not None
    assert principal.tenant == "dev"


def test_no_dev_key_when_the_operator_configured_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "keys.json"
    create(path, "acme", capsys=capsys)
    assert ensure_dev_key(path, tmp_path / "state") is None
    assert len(keyfile.load(path).keys) == 1
