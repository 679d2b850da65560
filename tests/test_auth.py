"""Auth decisions without a server: upgrade keys, the Origin allowlist, tenant ids, and the
places a socket holds (Guard, SocketAuth) on a real keys file."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from pydantic import SecretStr

from services.edge import keys as keyfile
from services.edge.auth import (
    POLICY_VIOLATION,
    TRY_AGAIN_LATER,
    AmbiguousCredentials,
    Guard,
    SocketAuth,
    allowed_origins,
    key_from_headers,
    origin_allowed,
    own_origins,
    tenant_id,
)
from services.edge.protocol import AuthFrame, ProtocolError
from services.edge.settings import EdgeSettings
from shared.messages import ErrorCode

SECRET = "a-resume-secret-of-at-least-32-bytes-0123456789"


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_bearer_key() -> None:
    assert key_from_headers(["Bearer tb-abc"], browser=False) == "tb-abc"
    assert key_from_headers(["bearer   tb-abc "], browser=True) == "tb-abc"
    assert key_from_headers([], browser=False) is None


def test_basic_key_is_the_password_and_never_from_a_browser() -> None:
    assert key_from_headers([basic("acme", "tb-abc")], browser=False) == "tb-abc"
    with pytest.raises(AmbiguousCredentials):
        key_from_headers([basic("acme", "tb-abc")], browser=True)


@pytest.mark.parametrize(
    "headers",
    [["Bearer a", "Bearer b"], ["Digest x"], ["Basic !!!notbase64"], ["Bearer"]],
)
def test_unusable_credentials_are_refused_not_ignored(headers: list[str]) -> None:
    with pytest.raises(AmbiguousCredentials):
        key_from_headers(headers, browser=False)


def test_own_origins_of_a_loopback_bind_are_every_loopback_spelling() -> None:
    origins = own_origins("127.0.0.1", 8000)
    for origin in ("http://127.0.0.1:8000", "http://localhost:8000", "http://[::1]:8000"):
        assert origin_allowed(origin, origins)
    assert not origin_allowed("http://localhost:8001", origins)  # another local server
    assert not origin_allowed("https://evil.example", origins)
    # DNS rebinding: a name that resolves to 127.0.0.1 is still another origin.
    assert not origin_allowed("http://rebind.evil.example:8000", origins)
    assert not origin_allowed("null", origins)  # sandboxed iframes, file:// pages


def test_a_named_bind_allows_only_itself() -> None:
    origins = own_origins("10.1.2.3", 443)
    assert origin_allowed("https://10.1.2.3", origins)  # default port spelled out or not
    assert not origin_allowed("http://localhost:443", origins)


def test_no_origin_is_a_non_browser_client() -> None:
    assert origin_allowed(None, own_origins("127.0.0.1", 8000))


def test_configured_origins_replace_the_default() -> None:
    origins = allowed_origins(["https://Chat.Example.com"], "127.0.0.1", 8000)
    assert origin_allowed("https://chat.example.com", origins)
    assert origin_allowed("https://chat.example.com:443", origins)
    assert not origin_allowed("http://127.0.0.1:8000", origins)
    assert origin_allowed("https://anything", allowed_origins(["*"], "127.0.0.1", 8000))


def test_tenant_id_is_keyed_stable_and_not_the_name() -> None:
    a = tenant_id(b"secret-1", "acme")
    assert a == tenant_id(b"secret-1", "acme")
    assert a != tenant_id(b"secret-2", "acme")
    assert a != tenant_id(b"secret-1", "acme2")
    assert "acme" not in a
    assert len(a) <= 128  # fits RequestRecord.tenant


# -- Guard and SocketAuth: the places a socket holds are always given back --------------------


@pytest.fixture
def guard(tmp_path: Path) -> tuple[Guard, dict[str, str]]:
    keys, issued = keyfile.KeysFile(), {}
    for tenant, limits in (("acme", {"sockets": 1}), ("other", {})):
        keys, issued[tenant], _ = keyfile.add_key(keys, tenant, limits, 0.0)
    keyfile.save(tmp_path / "keys.json", keys)
    settings = EdgeSettings(
        edge_keys_file=tmp_path / "keys.json",
        edge_max_unauthenticated_sockets=2,
        edge_max_unauthenticated_frames=3,
        resume_secret=SecretStr(SECRET),
    )
    return Guard(settings, settings.resume_keys()), issued


def auth_frame(key: str) -> AuthFrame:
    return AuthFrame(type="auth", api_key=key)


def test_sockets_without_a_key_hold_a_place_until_they_have_one(
    guard: tuple[Guard, dict[str, str]],
) -> None:
    g, keys = guard
    first, second = g.upgrade(None, []), g.upgrade(None, [])
    busy = g.upgrade(None, []).refused
    assert busy is not None
    assert (busy.status, busy.reason) == (503, "pending_sockets")
    a, b = SocketAuth(g, first, 0.0), SocketAuth(g, second, 0.0)
    assert a.before_key(auth_frame(keys["acme"])) == (None, None)
    assert a.authenticated
    assert a.tenant == tenant_id(SECRET.encode(), "acme")
    assert g.pending == 1
    b.end()
    assert g.pending == 0
    a.end()
    a.end()  # twice: nothing more to give back
    assert g.pending == 0


def test_frames_before_a_key_are_refused_then_the_socket_closes(
    guard: tuple[Guard, dict[str, str]],
) -> None:
    g, _ = guard
    s = SocketAuth(g, g.upgrade(None, []), 0.0)
    wrong = s.before_key(auth_frame("tb-wrong"))
    assert wrong[0] is not None
    assert wrong[0].code == ErrorCode.unauthorized
    assert wrong[1] is None
    assert s.before_key(ProtocolError("frame: not valid JSON"))[1] is None
    reply, close = s.before_key(ProtocolError("x", client_id="c1"))
    assert reply is not None
    assert reply.client_id == "c1"
    assert close is not None
    assert close.code == POLICY_VIOLATION


def test_the_socket_limit_holds_for_header_and_frame_keys_alike(
    guard: tuple[Guard, dict[str, str]],
) -> None:
    g, keys = guard
    by_header = g.upgrade(None, [f"Bearer {keys['acme']}"])
    assert by_header.principal is not None
    first = SocketAuth(g, by_header, 0.0)
    assert first.start() is None
    second = SocketAuth(g, g.upgrade(None, []), 0.0)
    _, close = second.before_key(auth_frame(keys["acme"]))
    assert close is not None
    assert close.code == TRY_AGAIN_LATER
    assert close.reason.startswith("rate_limited")
    second.end()
    assert g.pending == 0
    first.end()
    third = SocketAuth(g, g.upgrade(None, []), 0.0)
    assert third.before_key(auth_frame(keys["acme"])) == (None, None)


def test_a_second_auth_cannot_switch_tenant(guard: tuple[Guard, dict[str, str]]) -> None:
    g, keys = guard
    s = SocketAuth(g, g.upgrade(None, [f"Bearer {keys['other']}"]), 0.0)
    assert s.start() is None
    assert s.again(auth_frame(keys["other"])) is None
    switched = s.again(auth_frame(keys["acme"]))
    assert switched is not None
    assert switched.code == ErrorCode.unauthorized
    assert s.tenant == tenant_id(SECRET.encode(), "other")


def test_upgrade_refusals(guard: tuple[Guard, dict[str, str]]) -> None:
    g, keys = guard
    assert g.upgrade("https://evil.example", [f"Bearer {keys['acme']}"]).refused is not None
    refused = g.upgrade(None, ["Bearer tb-unknown"]).refused
    assert refused is not None
    assert refused.status == 403
    assert g.pending == 0  # refusals hold no place


def test_a_resume_token_is_checked_under_the_tenant_id_of_the_key_that_signed_it(
    tmp_path: Path,
) -> None:
    """Rotation: new requests carry ids under the new signing key, and a token signed with
    the old key still matches its tenant while the old key is configured."""
    keys, key, _ = keyfile.add_key(keyfile.KeysFile(), "acme", {}, 0.0)
    keyfile.save(tmp_path / "keys.json", keys)
    old, new = SECRET, SECRET[::-1] + "x"
    settings = EdgeSettings(
        edge_keys_file=tmp_path / "keys.json",
        resume_secrets=SecretStr(f"new:{new},old:{old}"),
    )
    g = Guard(settings, settings.resume_keys())
    principal = g.keys.lookup(key)
    assert principal is not None
    assert g.tenant_id(principal.tenant) == tenant_id(new.encode(), "acme")
    assert g.tenant_id(principal.tenant, "old") == tenant_id(old.encode(), "acme")
    assert g.tenant_id(principal.tenant, "unknown") == g.tenant_id(principal.tenant)


def test_a_limit_left_unset_is_not_written_so_an_older_edge_reads_the_keys_file(
    tmp_path: Path,
) -> None:
    """A keys file is read strictly (a misspelt limit is an error), so a limit added in a
    release (`batch_tokens_per_day`, issue 39) is written only where it is set: the file
    `tokenbus keys` writes today stays one the previous release's edges take (make
    upgrade-check found its edge refusing every key when the new limit was written null)."""
    path = tmp_path / "keys.json"
    keys, _, _ = keyfile.add_key(keyfile.KeysFile(), "acme", {}, 0.0)
    keyfile.save(path, keys)
    assert "batch_tokens_per_day" not in path.read_text()
    keys, _, _ = keyfile.add_key(keys, "big", {"batch_tokens_per_day": 10}, 0.0)
    keyfile.save(path, keys)
    assert keyfile.load(path).tenants["big"].batch_tokens_per_day == 10
