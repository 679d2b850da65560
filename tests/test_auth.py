"""Pure auth checks: the key of an upgrade request, the Origin allowlist, tenant ids."""

from __future__ import annotations

import base64

import pytest

from services.edge.auth import (
    AmbiguousCredentials,
    allowed_origins,
    key_from_headers,
    origin_allowed,
    own_origins,
    tenant_id,
)


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
