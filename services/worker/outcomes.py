"""What this worker's requests came to: answers, failures and times to first token, counted
since the process started and carried by every heartbeat (`Heartbeat.outcomes`), so the
schedulers can compare a canary's workers with its baseline's (ADR 0058).
"""

from __future__ import annotations

import bisect

from shared.messages import (
    OUTCOME_TTFT_BOUNDS_S,
    DoneResult,
    ErrorCode,
    ErrorResult,
    Outcomes,
    QueuedRequest,
)

# Errors the worker answers for: the engine failed the request. A cancel is the client's
# wish, a refused request (too long a prompt) its own fault, neither the variant's.
FAILURES = frozenset({ErrorCode.internal})


def ttft_bucket(seconds: float) -> int:
    """The index of the `Outcomes.ttft` bucket that `seconds` falls in (upper bounds are
    inclusive, as Prometheus's `le`)."""
    return bisect.bisect_left(OUTCOME_TTFT_BOUNDS_S, seconds)


class OutcomeCounts:
    """Cumulative counts of this process's finished requests.

    Caller: `WorkerTelemetry.answered` (`record`, each final record stored) and the
    heartbeat (`snapshot`), on one event loop. Affects: only itself.
    """

    def __init__(self) -> None:
        self._answered = 0
        self._failed = 0
        self._ttft = [0] * (len(OUTCOME_TTFT_BOUNDS_S) + 1)

    def record(self, request: QueuedRequest, final: DoneResult | ErrorResult) -> None:
        """A request's final record is stored. A shadow validation's gold run (`judged`) is
        not the variant's own traffic: a background copy, it would only blur its TTFT. Nor
        is a request pinned to its variant (`variant` set): whoever may pin chose it, so a
        canary's verdict rests on the traffic its rollout sent it (issue 37, N7: a tenant
        pinning the canary could fail it, or flood it with easy answers, at will)."""
        if request.judged is not None or request.variant is not None:
            return
        if isinstance(final, DoneResult):
            self._answered += 1
            self._ttft[ttft_bucket(max(0.0, final.timings.ttft_ms) / 1000.0)] += 1
        elif final.code in FAILURES:
            self._failed += 1

    def snapshot(self) -> Outcomes:
        return Outcomes(answered=self._answered, failed=self._failed, ttft=list(self._ttft))
