"""What this worker's requests came to: answers, failures and times to first token, counted
since the process started and carried by every heartbeat (`Heartbeat.outcomes`), so the
schedulers can compare a canary's workers with its baseline's (ADR 0058).
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable

from shared.messages import (
    OUTCOME_TTFT_BOUNDS_S,
    DoneResult,
    ErrorCode,
    ErrorResult,
    Outcomes,
    QueuedRequest,
)
from shared.tenant_share import SLICE_S, allowance

# Errors the worker answers for: the engine failed the request. A cancel is the client's
# wish, a refused request (too long a prompt) its own fault, neither the variant's.
FAILURES = frozenset({ErrorCode.internal})


def ttft_bucket(seconds: float) -> int:
    """The index of the `Outcomes.ttft` bucket that `seconds` falls in (upper bounds are
    inclusive, as Prometheus's `le`)."""
    return bisect.bisect_left(OUTCOME_TTFT_BOUNDS_S, seconds)


class OutcomeCounts:
    """Cumulative counts of this process's finished requests.

    With a tenant share below 1 (`canary_tenant_share`, issue 37, N7, ADR 0068), each slice
    of `SLICE_S` counts a tenant's requests as they end up to its allowance beside the other
    tenants' requests of the slice (shared/tenant_share.py); one past it counts later, if
    the others' grow, or never. A count is never taken back (heartbeats carry cumulative
    counts), so a tenant alone in a slice counts whole until another is seen.

    Caller: `WorkerTelemetry.answered` (`record`, each final record stored) and the
    heartbeat (`snapshot`), on one event loop. Affects: only itself.
    """

    def __init__(
        self,
        share: float = 1.0,
        floor: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._share, self._floor, self._clock = share, floor, clock
        self._answered = 0
        self._failed = 0
        self._ttft = [0] * (len(OUTCOME_TTFT_BOUNDS_S) + 1)
        self._slot: int | None = None
        self._ended: dict[str, list[int | None]] = {}  # this slice's, per tenant, in order
        self._counted: dict[str, int] = {}  # how many of them are counted

    def record(self, request: QueuedRequest, final: DoneResult | ErrorResult) -> None:
        """A request's final record is stored. A shadow validation's gold run (`judged`) is
        not the variant's own traffic: a background copy, it would only blur its TTFT. Nor
        is a request pinned to its variant (`variant` set): whoever may pin chose it, so a
        canary's verdict rests on the traffic its rollout sent it (issue 37, N7: a tenant
        pinning the canary could fail it, or flood it with easy answers, at will)."""
        if request.judged is not None or request.variant is not None:
            return
        if isinstance(final, DoneResult):
            outcome: int | None = ttft_bucket(max(0.0, final.timings.ttft_ms) / 1000.0)
        elif final.code in FAILURES:
            outcome = None
        else:
            return
        if self._share >= 1.0:
            self._count(outcome)
            return
        slot = math.floor(self._clock() / SLICE_S)
        if slot != self._slot:
            self._slot, self._ended, self._counted = slot, {}, {}
        self._ended.setdefault(request.tenant, []).append(outcome)
        total = sum(len(ended) for ended in self._ended.values())
        for tenant, ended in self._ended.items():
            allowed = int(min(len(ended), allowance(self._share, total - len(ended), self._floor)))
            counted = self._counted.get(tenant, 0)
            for held in ended[counted:allowed]:
                self._count(held)
            self._counted[tenant] = max(counted, allowed)

    def snapshot(self) -> Outcomes:
        return Outcomes(answered=self._answered, failed=self._failed, ttft=list(self._ttft))

    def _count(self, outcome: int | None) -> None:
        if outcome is None:
            self._failed += 1
        else:
            self._answered += 1
            self._ttft[outcome] += 1
