"""Resume tokens (pure, property-based): tampered, expired, other tenant, future seq, and
the keys: required and strong, rotated by key id, never shown."""

from __future__ import annotations

import secrets

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from pydantic import SecretStr, ValidationError

from services.edge.resume import ResumeClaims, ResumeKeys, ResumeRefused, check_resume, sign
from services.edge.settings import EdgeSettings
from services.edge.streams import ResumePoint
from shared.messages import ErrorCode

OLD_SECRET = secrets.token_urlsafe(32)
NEW_SECRET = secrets.token_urlsafe(32)
SECRET = ResumeKeys(signing_kid="0", keys={"0": SecretStr(OLD_SECRET)})
RESULTS = "tokenbus.results"
NOW = 1_000_000.0

tenants = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=24)
claims_st = st.builds(
    ResumeClaims,
    tenant=tenants,
    request_id=st.from_regex(r"[0-9a-f]{32}", fullmatch=True),
    topic=st.sampled_from([RESULTS, f"{RESULTS}.0123456789abcdef0123456789abcdef"]),
    partition=st.one_of(st.none(), st.integers(0, 63)),
    offset=st.integers(0, 2**40),
    expires_at=st.floats(NOW + 0.001, NOW + 10_000, allow_nan=False),
)


def check(token: str, tenant: str, now: float = NOW) -> ResumeClaims:
    return check_resume(token, SECRET, tenant=tenant, results_topic=RESULTS, now=now)


@given(claims_st)
def test_an_intact_token_of_the_same_tenant_passes(claims: ResumeClaims) -> None:
    assert check(sign(claims, SECRET), claims.tenant) == claims


def test_a_token_a_newer_edge_signed_with_a_claim_this_one_does_not_know_passes() -> None:
    class NewerClaims(ResumeClaims):
        region: str

    claims = ResumeClaims(tenant="t", request_id="r1", topic=RESULTS, offset=7, expires_at=NOW + 1)
    newer = NewerClaims(**claims.model_dump(), region="eu-west")
    assert check(sign(newer, SECRET), "t") == claims  # ADR 0072


@given(claims_st, st.data())
def test_any_change_to_a_token_is_refused_as_unauthorized(
    claims: ResumeClaims, data: st.DataObject
) -> None:
    token = sign(claims, SECRET)
    i = data.draw(st.integers(0, len(token) - 1), label="position")
    replacement = data.draw(
        st.sampled_from("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.="),
        label="char",
    )
    tampered = token[:i] + replacement + token[i + 1 :]
    # Base64 padding bits: a change there may decode to the same bytes, i.e. the same token.
    assume(tampered != token)
    outcome: ResumeClaims | ErrorCode
    try:
        outcome = check(tampered, claims.tenant)
    except ResumeRefused as exc:
        outcome = exc.code
    # Only a change in base64 padding bits decodes to the very same, still valid, token.
    assert outcome in (ErrorCode.unauthorized, claims)


@given(claims_st, st.text(min_size=1, max_size=64))
def test_a_token_signed_with_another_secret_is_unauthorized(
    claims: ResumeClaims, other: str
) -> None:
    assume(other != OLD_SECRET)
    forged = ResumeKeys(signing_kid="0", keys={"0": SecretStr(other)})
    with pytest.raises(ResumeRefused) as refused:
        check(sign(claims, forged), claims.tenant)
    assert refused.value.code == ErrorCode.unauthorized


@given(claims_st, st.floats(0, 1e6, allow_nan=False))
def test_an_expired_token_is_not_found(claims: ResumeClaims, later: float) -> None:
    with pytest.raises(ResumeRefused) as refused:
        check(sign(claims, SECRET), claims.tenant, now=claims.expires_at + later)
    assert refused.value.code == ErrorCode.not_found


@given(claims_st, tenants)
def test_another_tenants_token_is_unauthorized(claims: ResumeClaims, tenant: str) -> None:
    assume(tenant != claims.tenant)
    with pytest.raises(ResumeRefused) as refused:
        check(sign(claims, SECRET), tenant)
    assert refused.value.code == ErrorCode.unauthorized


@given(st.text(max_size=300))
def test_garbage_is_unauthorized(token: str) -> None:
    with pytest.raises(ResumeRefused) as refused:
        check(token, "t")
    assert refused.value.code == ErrorCode.unauthorized


def test_a_token_for_a_topic_of_another_deployment_is_not_found() -> None:
    claims = ResumeClaims(
        tenant="t", request_id="r", topic="other.results", offset=0, expires_at=NOW + 5
    )
    with pytest.raises(ResumeRefused) as refused:
        check(sign(claims, SECRET), "t")
    assert refused.value.code == ErrorCode.not_found


@given(
    sent=st.integers(0, 30),  # deltas the log holds for the attempt
    attempts=st.integers(1, 3),  # attempts the log holds
    attempt=st.integers(0, 4),
    after_seq=st.integers(-1, 40),
)
def test_after_seq_beyond_the_log_is_refused_and_anything_within_is_not(
    sent: int, attempts: int, attempt: int, after_seq: int
) -> None:
    point = ResumePoint(attempt=attempt, after_seq=after_seq)
    for a in range(attempts):
        for seq in range(sent):
            point.observe(a, seq)
    claims_nothing = attempt == 0 and after_seq == -1
    possible = claims_nothing or (attempt < attempts and after_seq < sent)
    # An attempt exists in the log only through its records; one with no delta yet is
    # known only if another record of it was read.
    if sent == 0 and not claims_nothing:
        possible = False
    assert point.ahead_of_log() is not possible


# -- the keys ------------------------------------------------------------------------------

CLAIMS = ResumeClaims(tenant="t", request_id="r", topic=RESULTS, offset=0, expires_at=NOW + 60)


def keys(listed: str) -> ResumeKeys:
    return ResumeKeys.from_settings(None, SecretStr(listed))


def refused_code(token: str, ring: ResumeKeys) -> ErrorCode | None:
    try:
        check_resume(token, ring, tenant="t", results_topic=RESULTS, now=NOW)
    except ResumeRefused as exc:
        return exc.code
    return None


def test_during_a_rollover_old_tokens_verify_and_new_ones_are_signed_with_the_new_key() -> None:
    before = keys(f"k1:{OLD_SECRET}")
    during = keys(f"k2:{NEW_SECRET},k1:{OLD_SECRET}")
    after = keys(f"k2:{NEW_SECRET}")
    old_token = sign(CLAIMS, before)
    assert refused_code(old_token, during) is None
    new_token = sign(CLAIMS, during)
    assert new_token.startswith("k2.")
    assert refused_code(new_token, after) is None
    assert refused_code(old_token, after) is ErrorCode.unauthorized  # old key removed


def test_a_tampered_key_id_is_refused() -> None:
    ring = keys(f"k2:{NEW_SECRET},k1:{OLD_SECRET}")
    token = sign(CLAIMS, ring)
    _, rest = token.split(".", 1)
    for kid in ("k1", "k3", "0", ""):
        assert refused_code(f"{kid}.{rest}", ring) is ErrorCode.unauthorized, kid


def test_the_single_key_form_is_key_id_0_and_the_list_wins_over_it() -> None:
    single = ResumeKeys.from_settings(SecretStr(OLD_SECRET), None)
    assert single.signing_kid == "0"
    both = ResumeKeys.from_settings(SecretStr(OLD_SECRET), SecretStr(f"n:{NEW_SECRET}"))
    assert both.signing_kid == "n"
    assert set(both.keys) == {"n"}
    # Rotating away from the single form: name the old key `0` in the list.
    rotating = keys(f"n:{NEW_SECRET},0:{OLD_SECRET}")
    assert refused_code(sign(CLAIMS, single), rotating) is None


@pytest.mark.parametrize(
    ("single", "listed", "complaint"),
    [
        (None, None, "TOKENBUS_RESUME_SECRET is unset"),
        ("", None, "0 bytes"),
        ("change-me", None, "placeholder"),
        ("test-secret", None, "placeholder"),
        ("Secret", None, "placeholder"),
        ("abcdefghij" * 3 + "k", None, "31 bytes"),
        ("ab" * 20, None, "too few characters"),
        (None, f"k1:{NEW_SECRET},k2:short", "key 'k2' is 5 bytes"),
        (None, f"k1:{NEW_SECRET},k1:{OLD_SECRET}", "twice"),
        (None, f"{NEW_SECRET}", "entry 1 is not `kid:secret`"),
        (None, f"k.1:{NEW_SECRET}", "entry 1 is not `kid:secret`"),
        ("ok" * 20, f"k1:{NEW_SECRET},change-me", "entry 2"),
    ],
    # Ids without the secrets, which are random: the same in every process that collects.
    ids=lambda v: v.replace(NEW_SECRET, "NEW").replace(OLD_SECRET, "OLD") if v else None,
)
def test_the_edge_refuses_to_start_without_a_strong_secret(
    single: str | None, listed: str | None, complaint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TOKENBUS_RESUME_SECRET", raising=False)
    monkeypatch.delenv("TOKENBUS_RESUME_SECRETS", raising=False)
    given_ = {"resume_secret": single, "resume_secrets": listed}
    with pytest.raises(ValidationError) as refused:
        EdgeSettings(**{k: v for k, v in given_.items() if v is not None})
    message = str(refused.value)
    assert complaint in message
    for secret in (NEW_SECRET, OLD_SECRET, single, "short"):
        if secret:
            assert secret not in message  # the error names the problem, never the value


def test_secrets_never_show_in_reprs_dumps_or_strings() -> None:
    settings = EdgeSettings(
        resume_secret=SecretStr(OLD_SECRET),
        resume_secrets=SecretStr(f"k2:{NEW_SECRET},k1:{OLD_SECRET}"),
    )
    ring = settings.resume_keys()
    shown = [
        repr(settings),
        str(settings),
        settings.model_dump_json(),
        repr(settings.model_dump()),
        repr(ring),
        str(ring),
        ring.model_dump_json(),
    ]
    for text in shown:
        assert OLD_SECRET not in text
        assert NEW_SECRET not in text
    assert ring.keys["k1"].get_secret_value() == OLD_SECRET  # ...though it is there to use
