"""Resume-token checks (pure, property-based): tampered, expired, other tenant, future seq."""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from services.edge.resume import ResumeClaims, ResumeRefused, check_resume, sign
from services.edge.streams import ResumePoint
from shared.messages import DeltaResult, ErrorCode

SECRET = b"edge-secret"
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


@given(claims_st, st.binary(min_size=1, max_size=64))
def test_a_token_signed_with_another_secret_is_unauthorized(
    claims: ResumeClaims, other: bytes
) -> None:
    assume(other != SECRET)
    with pytest.raises(ResumeRefused) as refused:
        check(sign(claims, other), claims.tenant)
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
            point.observe(DeltaResult(request_id="r", attempt=a, seq=seq, text="x"))
    claims_nothing = attempt == 0 and after_seq == -1
    possible = claims_nothing or (attempt < attempts and after_seq < sent)
    # An attempt exists in the log only through its records; one with no delta yet is
    # known only if another record of it was read.
    if sent == 0 and not claims_nothing:
        possible = False
    assert point.ahead_of_log() is not possible
