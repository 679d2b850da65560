"""What the session's shared stack (`stack` in tests/conftest.py) is provisioned with up front,
so that modules which differ only in these share it (issue 36): every tenant its tests use,
each named for the one module that uses it, with its limits, in one keys file; and the sim's
test-only markers, which act per request (a prompt that carries one), so they change nothing
for a request that does not.

A module takes its tenants from here by name; a test that revokes a key revokes only its own
module's tenant's.
"""

from __future__ import annotations

from tests.stack import UNLIMITED

# tests/test_quotas_e2e.py: each quota, one tenant each; tests/security/test_output_charges.py:
# the streamer and the abandoner.
QUOTAS: dict[str, dict[str, object]] = {
    # One request per 100 s after a burst of two: the third is refused however slow the test.
    "quota-slow": {**UNLIMITED, "rps": 0.01, "burst": 2},
    "quota-single": {**UNLIMITED, "concurrency": 1},
    "quota-frugal": {**UNLIMITED, "tokens_per_min": 150},
    "quota-twosockets": {**UNLIMITED, "sockets": 2},
    "quota-streamer": {**UNLIMITED, "tokens_per_min": 2000},
    "quota-abandoner": {**UNLIMITED, "tokens_per_min": 2000},
}

# tests/security/test_token_counts.py
TOKEN_COUNTS: dict[str, dict[str, object]] = {
    "counts-capped": {**UNLIMITED, "tokens_per_min": 10_000},
    "counts-unmetered": dict(UNLIMITED),
    # 100 tokens a second: a gap of 1,000 tokens takes 10 s to refill.
    "counts-settling": {**UNLIMITED, "tokens_per_min": 6_000},
}

# tests/security/test_revoked_keys.py: one tenant per key it revokes (the WebSocket's, the
# SSE stream's, the waiting answer's).
REVOKED_KEYS: dict[str, dict[str, object]] = {
    "revoked-socket": {"rps": 100.0},
    "revoked-sse": dict(UNLIMITED),
    "revoked-waiting": dict(UNLIMITED),
}

# tests/security/test_resume_and_cancel.py
RESUME_ATTACKER_RPS = 4.0  # burst 4: ceil(rps)
RESUME_AND_CANCEL: dict[str, dict[str, object]] = {
    "flood-attacker": {"rps": RESUME_ATTACKER_RPS, "concurrency": 8},
    "flood-one-stream": {"rps": 100.0, "concurrency": 1},
    # Resumes far back (issue 37, N8): one partition replayed at once, and a request a second
    # after a burst of two, so that what its replays read shows as a debt.
    "replay-attacker": {**UNLIMITED, "rps": 1.0, "burst": 2, "replays": 1},
    "replay-victim": dict(UNLIMITED),
}

# tests/security/test_http_limits.py: streams and held bodies against `sockets`.
HTTP_LIMITS: dict[str, dict[str, object]] = {
    "http-two-streams": {**UNLIMITED, "sockets": 2},
    "http-one-stream": {**UNLIMITED, "sockets": 1},
}

# tests/test_files_api.py: the files' owner and a tenant that must not see them.
FILES: dict[str, dict[str, object]] = {
    "files-owner": dict(UNLIMITED),
    "files-other": dict(UNLIMITED),
}

# tests/test_batches_api.py: the batches' owner and a tenant that must not see them.
BATCHES: dict[str, dict[str, object]] = {
    "batch-owner": dict(UNLIMITED),
    "batch-other": dict(UNLIMITED),
    "batch-quota": {**UNLIMITED, "batch_tokens_per_day": 300},
}

SHARED_STACK_TENANTS: dict[str, dict[str, object]] = {
    **BATCHES,
    **FILES,
    **QUOTAS,
    **TOKEN_COUNTS,
    **REVOKED_KEYS,
    **RESUME_AND_CANCEL,
    **HTTP_LIMITS,
}

# The sim's test-only markers (services/worker/engines/sim.py), set on the shared stack: no
# other test's prompt contains them.
# A prompt with it is answered with its text after the marker, verbatim (the XSS tests).
ECHO_MARKER = "ECHO-7f3a9c::"
# A prompt with it fails inside the engine after its first token.
FAIL_MARKER = "FAIL-c41e08::"
# A prompt with `PACE-2b9d51=<tokens/s>` is answered at that rate (`paced`).
RATE_MARKER = "PACE-2b9d51"

SHARED_STACK_ENV: dict[str, str] = {
    "TOKENBUS_WORKER_SIM_ECHO_MARKER": ECHO_MARKER,
    "TOKENBUS_WORKER_SIM_FAIL_MARKER": FAIL_MARKER,
    "TOKENBUS_WORKER_SIM_RATE_MARKER": RATE_MARKER,
}


def paced(prompt: str, tokens_per_s: float) -> str:
    """`prompt`, answered by the shared stack's sim at `tokens_per_s` (its own rate is
    200 tokens/s, the most a paced request gets: one token a step)."""
    return f"{prompt} {RATE_MARKER}={tokens_per_s:g}"
