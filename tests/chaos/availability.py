"""Availability and latency under faults: per-request samples and fault windows in, figures out.

Pure: no I/O, no clock. Times are seconds from the load's zero (`LoadRun.send_all(zero)`).

Definitions:

- **offered**: every planned request, sent or not. **accepted**: WebSocket `chat.accepted`, or
  the Kafka producer's write acknowledged. **answered**: accepted, and its final is `done`
  (`chat.done`, or a final `done` record on the reply topic); an `error` final is not.
  Ratios: accepted/offered, answered/accepted.
- **TTFT**: WebSocket, from sending `chat.request` to the first `chat.delta` ever shown (a
  `chat.reset` does not restart it); Kafka, from the app calling send to the first `delta`
  record read from its reply topic. A request that never got a first token has no TTFT: it
  is counted apart ("no first token", among the accepted) and left out of the percentiles.
- **Percentiles**: `bench.stats.percentile`, linear interpolation between closest ranks
  (numpy's default), the one the benchmarks use.
- **Fault window**: from a fault's start to its end (a kill to the restart), as the
  injector records it. A request is *in* a window if it was sent in `[start_s, end_s]`;
  windows may overlap, and a request then counts in each. *After settle*: sent in
  `[start_s + settle_s, end_s]`, once leader election has settled (empty for a fault shorter
  than `settle_s`: nothing to judge there).
- **Steady state**: the requests sent outside every `[start_s, end_s + tail_s]` (a fault
  window and its recovery tail), and not in flight when a fault struck (sent before it,
  first token after it).
- **Slow**: a TTFT above `SLOW_FACTOR` (2) times the steady p99 of the same channel scope.
- **Time to recover** after a fault: from its end to the latest first token of a slow
  request sent in `[start_s - tail_s, end_s + tail_s]` (in flight when it struck, during it,
  or just after it); 0 if there is none or that first token came before the end; unknown
  (None) without a steady p99. Requests with no first token are not in it: they show in the
  answered ratio and the "no first token" count.

Every figure is given per channel scope: `websocket`, `kafka`, `openai-stream`, `openai` and
`all` (every channel together). For `openai-stream` accepted is the stream's `200` and TTFT
runs to the first chunk with text; for `openai` (non-streaming) accepted is the answer's
arrival and TTFT runs to it (the whole answer is its first token).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from bench.stats import percentile
from tests.chaos.checker import CHANNELS, Channel

Scope = Literal["all", "websocket", "kafka", "openai-stream", "openai"]
SCOPES: tuple[Scope, ...] = ("all", *CHANNELS)
SLOW_FACTOR = 2.0
STEADY = "steady"


@dataclass(frozen=True)
class Sample:
    """What one offered request showed the client, in time."""

    channel: Channel
    sent_at_s: float  # when it was sent; never sent: when it was planned (offered)
    ttft_s: float | None  # None: no first token
    accepted: bool
    answered: bool  # accepted, and the final was `done`
    final_code: str | None = None  # "done", an error code (a refusal's too), or None: none

    def __post_init__(self) -> None:
        if self.channel not in CHANNELS:
            raise ValueError(f"unknown channel {self.channel!r}; one of {CHANNELS}")
        if self.ttft_s is not None and self.ttft_s < 0:
            raise ValueError(f"negative TTFT {self.ttft_s} s")
        if self.answered and not self.accepted:
            raise ValueError("a request answered but never accepted")

    @property
    def first_token_s(self) -> float | None:
        """When its first token came, from the load's zero."""
        return None if self.ttft_s is None else self.sent_at_s + self.ttft_s


@dataclass(frozen=True)
class FaultWindow:
    """A fault from its start to its end (kill to restart), in seconds from the load's zero."""

    label: str
    start_s: float
    end_s: float

    def __post_init__(self) -> None:
        if self.end_s < self.start_s:
            raise ValueError(f"fault {self.label!r} ends at {self.end_s} before {self.start_s}")

    def holds(self, at_s: float, tail_s: float = 0.0) -> bool:
        return self.start_s <= at_s <= self.end_s + tail_s


@dataclass(frozen=True)
class Totals:
    """Offered, accepted and answered over the whole run, for one scope."""

    scope: Scope
    offered: int
    accepted: int
    answered: int

    @property
    def accepted_ratio(self) -> float | None:
        return _ratio(self.accepted, self.offered)

    @property
    def answered_ratio(self) -> float | None:
        """answered/accepted."""
        return _ratio(self.answered, self.accepted)


@dataclass(frozen=True)
class Row:
    """The requests sent in one fault window (or in steady state), for one scope."""

    label: str  # the fault's, or STEADY
    scope: Scope
    window: FaultWindow | None  # None: steady state
    sent: int
    accepted: int
    answered: int
    no_first_token: int  # accepted, and no first token ever came
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    p99_ratio: float | None  # ttft_p99_s over the steady p99
    p99_after_settle_s: float | None
    after_settle_ratio: float | None
    recovery_s: float | None  # None: steady state, or no steady p99 to judge against

    @property
    def accepted_ratio(self) -> float | None:
        return _ratio(self.accepted, self.sent)

    @property
    def answered_ratio(self) -> float | None:
        """answered/accepted."""
        return _ratio(self.answered, self.accepted)


@dataclass(frozen=True)
class Figures:
    totals: tuple[Totals, ...]  # one per scope, in SCOPES order
    rows: tuple[Row, ...]  # per scope: the steady row, then one per window in start order
    settle_s: float
    tail_s: float

    def total(self, scope: Scope) -> Totals:
        return next(t for t in self.totals if t.scope == scope)

    def steady(self, scope: Scope) -> Row:
        return next(r for r in self.rows if r.scope == scope and r.window is None)


def ttft_quantiles(samples: Iterable[Sample]) -> tuple[float | None, float | None]:
    """(p50, p99) of the TTFTs among `samples`; None where no sample has one."""
    ttfts = sorted(s.ttft_s for s in samples if s.ttft_s is not None)
    if not ttfts:
        return None, None
    return percentile(ttfts, 50), percentile(ttfts, 99)


def recovery_s(
    samples: Iterable[Sample], window: FaultWindow, slow_above_s: float, tail_s: float
) -> float:
    """Time to recover after `window` (module docstring): 0 if no slow first token outlasted it."""
    late = [
        first - window.end_s
        for s in samples
        if window.start_s - tail_s <= s.sent_at_s <= window.end_s + tail_s
        and s.ttft_s is not None
        and s.ttft_s > slow_above_s
        and (first := s.first_token_s) is not None
    ]
    return max([0.0, *late])


def figures(
    samples: Sequence[Sample],
    windows: Sequence[FaultWindow],
    *,
    settle_s: float = 10.0,
    tail_s: float = 5.0,
) -> Figures:
    """Every figure of the module docstring, per scope."""
    if settle_s < 0 or tail_s < 0:
        raise ValueError(f"settle_s ({settle_s}) and tail_s ({tail_s}) must not be negative")
    ordered = sorted(windows, key=lambda w: (w.start_s, w.end_s, w.label))
    totals: list[Totals] = []
    rows: list[Row] = []
    for scope in SCOPES:
        mine = [s for s in samples if scope == "all" or s.channel == scope]
        totals.append(
            Totals(
                scope,
                offered=len(mine),
                accepted=sum(s.accepted for s in mine),
                answered=sum(s.answered for s in mine),
            )
        )
        steady = [s for s in mine if not any(_touched(s, w, tail_s) for w in ordered)]
        steady_row = _row(STEADY, scope, None, steady, [], None, None)
        rows.append(steady_row)
        for w in ordered:
            during = [s for s in mine if w.holds(s.sent_at_s)]
            settled = [s for s in during if s.sent_at_s >= w.start_s + settle_s]
            steady_p99 = steady_row.ttft_p99_s
            recovery = (
                None
                if steady_p99 is None
                else recovery_s(mine, w, SLOW_FACTOR * steady_p99, tail_s)
            )
            rows.append(_row(w.label, scope, w, during, settled, steady_p99, recovery))
    return Figures(tuple(totals), tuple(rows), settle_s=settle_s, tail_s=tail_s)


def _touched(sample: Sample, window: FaultWindow, tail_s: float) -> bool:
    """Whether `window` may have slowed `sample`: sent during it or its tail, or sent before
    it and still waiting for its first token when it struck (one that never came: unknown,
    counted apart anyway)."""
    if window.holds(sample.sent_at_s, tail_s):
        return True
    first = sample.first_token_s
    return first is not None and sample.sent_at_s < window.start_s < first


def _row(
    label: str,
    scope: Scope,
    window: FaultWindow | None,
    during: list[Sample],
    settled: list[Sample],
    steady_p99: float | None,
    recovery: float | None,
) -> Row:
    p50, p99 = ttft_quantiles(during)
    _, after_settle = ttft_quantiles(settled)
    return Row(
        label=label,
        scope=scope,
        window=window,
        sent=len(during),
        accepted=sum(s.accepted for s in during),
        answered=sum(s.answered for s in during),
        no_first_token=sum(s.accepted and s.ttft_s is None for s in during),
        ttft_p50_s=p50,
        ttft_p99_s=p99,
        p99_ratio=_over(p99, steady_p99),
        p99_after_settle_s=after_settle,
        after_settle_ratio=_over(after_settle, steady_p99),
        recovery_s=recovery,
    )


def check(
    result: Figures,
    min_availability: float = 0.99,
    max_p99_ratio: float = 2.0,
    max_recovery_s: float | None = None,
    *,
    ttft_scopes: Sequence[Scope] = SCOPES,
) -> list[str]:
    """The criteria `result` fails, one readable line each; empty when it passes all.

    Per scope that was offered anything: accepted/offered and answered/accepted at least
    `min_availability`; per fault window, the p99 TTFT after settle at most `max_p99_ratio`
    times the steady p99 (a window with no request sent after settle is not judged; nor a
    scope outside `ttft_scopes`, for TTFT and recovery); and,
    if `max_recovery_s` is given, each recovery at most that. No steady TTFT to compare with,
    or nothing offered at all, fails too: the figures could not be judged.
    """
    failed: list[str] = []
    if result.total("all").offered == 0:
        return ["nothing was offered: no availability to judge"]
    for t in result.totals:
        if t.offered == 0:
            continue
        if (ratio := t.accepted_ratio) is not None and ratio < min_availability:
            failed.append(
                f"{t.scope}: accepted/offered {_pct(ratio)} ({t.accepted}/{t.offered})"
                f" < {_pct(min_availability)}"
            )
        answered = t.answered_ratio
        if answered is None or answered < min_availability:
            failed.append(
                f"{t.scope}: answered/accepted {_pct(answered)} ({t.answered}/{t.accepted})"
                f" < {_pct(min_availability)}"
            )
    windows = [r for r in result.rows if r.window is not None]
    for scope in SCOPES:
        if result.total(scope).offered == 0 or not any(r.scope == scope for r in windows):
            continue
        if result.steady(scope).ttft_p99_s is None:
            failed.append(f"{scope}: no steady-state TTFT to compare the fault windows with")
    for r in (r for r in windows if r.scope in ttft_scopes):
        if r.after_settle_ratio is not None and r.after_settle_ratio > max_p99_ratio:
            failed.append(
                f"{r.scope} {r.label}: p99 TTFT after settle {_s(r.p99_after_settle_s)} s is"
                f" {r.after_settle_ratio:.2f}x steady, over {max_p99_ratio:g}x"
            )
        if (
            max_recovery_s is not None
            and r.recovery_s is not None
            and r.recovery_s > max_recovery_s
        ):
            failed.append(
                f"{r.scope} {r.label}: recovered after {r.recovery_s:.1f} s,"
                f" over {max_recovery_s:g} s"
            )
    return failed


def markdown(result: Figures, scopes: Sequence[Scope] = SCOPES) -> str:
    """A summary line and a table: per scope, the steady row, then one row per fault window
    (a channel the run offered nothing on is left out)."""
    scopes = [s for s in scopes if result.total(s).offered]
    summary = "; ".join(
        f"{t.scope}: offered {t.offered}, accepted {t.accepted} ({_pct(t.accepted_ratio)}),"
        f" answered {t.answered} ({_pct(t.answered_ratio)} of accepted)"
        for t in result.totals
        if t.scope in scopes
    )
    head = (
        "| fault | channel | window (s) | sent | accepted | answered | no first token"
        " | TTFT p50 (s) | TTFT p99 (s) | p99 / steady"
        f" | p99 after settle ({result.settle_s:g} s) | recovery (s) |\n"
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [summary, "", head]
    for r in result.rows:
        if r.scope not in scopes:
            continue
        window = "-" if r.window is None else f"{r.window.start_s:.1f}-{r.window.end_s:.1f}"
        after = _s(r.p99_after_settle_s)
        if r.after_settle_ratio is not None:
            after += f" ({r.after_settle_ratio:.2f}x)"
        lines.append(
            f"| {r.label} | {r.scope} | {window} | {r.sent} | {_pct(r.accepted_ratio)}"
            f" | {_pct(r.answered_ratio)} | {r.no_first_token} | {_s(r.ttft_p50_s)}"
            f" | {_s(r.ttft_p99_s)} | {_x(r.p99_ratio)} | {after} | {_s(r.recovery_s, 1)} |"
        )
    return "\n".join(lines)


def _ratio(part: int, whole: int) -> float | None:
    return None if whole == 0 else part / whole


def _over(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base <= 0:
        return None
    return value / base


def _pct(ratio: float | None) -> str:
    return "-" if ratio is None else f"{100 * ratio:.1f} %"


def _s(seconds: float | None, digits: int = 2) -> str:
    return "-" if seconds is None else f"{seconds:.{digits}f}"


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"
