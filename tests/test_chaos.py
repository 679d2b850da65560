"""The chaos check: open-loop load over WebSocket and Kafka while processes and broker nodes fail.

Faults: kill -9 of every service, and one broker node of three at a time killed, hung
(SIGSTOP) or cut off from the services by the faults real networks make (Toxiproxy between
the services and each node: latency, bandwidth, a black hole, resets, slow close).

Safety: every request that got `chat.accepted`, or whose record the broker acknowledged,
must end in exactly one final outcome, and every `done` must carry the engine's exact text
with no gap and no duplicate (tests/chaos/checker.py). Availability: at least 99 % of the
offered requests accepted, and 99 % of those answered (tests/chaos/availability.py, which
also reports TTFT per fault window against steady state and the time to recover).

Faults come from a seed printed at the start; run `TOKENBUS_CHAOS_SEED=<seed> pytest
tests/test_chaos.py` to play the same plan again (`TOKENBUS_CHAOS_KINDS=ingest,edge,edge`
narrows the faults, and `TOKENBUS_CHAOS_HANG=coordinator` hangs the node coordinating the
scheduler's group instead of a partition's leader, both for a diagnosis only). The report
of the last run is written to `.tokenbus/chaos/last-run.md`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

import pytest

from bench.loadgen import warm_up
from bench.stats import percentile
from shared.kafka import create_topics
from tests import stack_dumps
from tests.chaos import availability
from tests.chaos.availability import FaultWindow
from tests.chaos.checker import OPENAI_CHANNELS, failures, judge, summarize, table
from tests.chaos.faults import ENGINE_KINDS, NODE_KINDS, SERVICE_KINDS, Fault, last_end_s, plan
from tests.chaos.load import KafkaRequester, LoadRun, WsUser, cancel_all, plan_load
from tests.chaos.openai_load import OpenAiRequester
from tests.chaos.system import (
    ChaosSystem,
    Injector,
    LocalCluster,
    ProxiedLinks,
    chaos_stack,
    fresh_run_dir,
)
from tests.chaos.toxiproxy import ProxiedCluster
from tests.stack import ROOT

# In `make test`; `make chaos` runs it alone (`-m chaos`).
pytestmark = pytest.mark.chaos

# Requests/s, open loop: chat users, an application on Kafka, and applications on the
# OpenAI API through the `openai` SDK, streaming and not (tests/chaos/openai_load.py).
RATE = {"websocket": 16.0, "kafka": 8.0, "openai-stream": 4.0, "openai": 2.0}
# Faults are planned in this window; node faults, one at a time, may run past its end
# (tests/chaos/faults.py), and the load lasts until LOAD_TAIL_S after the last fault ended.
# The first 15 s are steady state: the baseline every fault window's TTFT is compared with.
FAULT_WINDOW_S = (15.0, 100.0)
LOAD_TAIL_S = 10.0
MIN_LOAD_S = 60.0
# Availability (issue 25): of the offered requests, this share accepted, and of those, this
# share answered (`done`); judged per channel and over both.
MIN_AVAILABILITY = 0.99
# TTFT during a fault is reported against steady state from SETTLE_S after it struck, once
# leader election has settled (the controller fences a node after 6 s). It is not asserted:
# measured, the WebSocket p99 after settle is within 2x steady for a killed leader in most
# runs but not all (0.05-9x), for a hung node in some (1.6-9.6x since ADR 0056; a worker
# killed inside the hang costs its own recovery), and not for a black-holed link (~8-23x:
# nothing is elected). docs/reliability.md, "The promise"; issue 25.
SETTLE_S = 10.0
# Steady state: requests sent outside every fault and this long after it (a restarted
# ingest's backlog, a consumer group's rebalance).
TAIL_S = 15.0
# After the load, wait for every acknowledged request's final while answers keep coming:
# stop when none came for DRAIN_STALL_S with no fault under way (what is open then is
# lost), or once the run has used CALL_BUDGET_S. That bound is wide on purpose: on a
# quiet two-core box the drain settles in seconds; on a machine others load (a node's JVM
# taking a minute to start again, every process starved) answers keep coming for minutes,
# and a request still being answered is slow, not lost (docs/reliability.md, ADR 0022).
DRAIN_STALL_S = 20.0
CALL_BUDGET_S = 420.0
WS_USERS = 6
# Every process kind once, workers and edges twice (each instance in turn), a worker's
# engine dead and one hung (issue 38), and every node fault once: a leader of a requests
# and of a results partition killed, a leader hung, and the five network faults on the
# services' link to a leader.
KINDS = (*SERVICE_KINDS, "worker", "edge", *ENGINE_KINDS, *NODE_KINDS)
REPLY_PARTITIONS = 2
REPORT = ROOT / ".tokenbus" / "chaos" / "last-run.md"
# The last run's service logs and timeline (chaos.log, which names the cluster's state dir
# under pytest's temp dirs), kept for a post-mortem; each run clears it first.
RUN_DIR = ROOT / ".tokenbus" / "chaos" / "run"


@pytest.fixture
def run_dir() -> Path:
    return fresh_run_dir(RUN_DIR)


@pytest.fixture
def cluster(three_nodes: ProxiedCluster) -> LocalCluster:
    """The session's three KRaft nodes (tests/conftest.py; this test runs last of all, as
    it kills them): RF 3, min.insync.replicas 2 (the launcher's rule), which the services
    reach through a Toxiproxy proxy per node."""
    whole = three_nodes.whole()
    return LocalCluster(whole.cluster, ProxiedLinks(whole.proxy))


@pytest.fixture
def system(cluster: LocalCluster, run_dir: Path) -> Iterator[ChaosSystem]:
    stack = chaos_stack(cluster.cluster, run_dir)
    try:
        yield ChaosSystem.start(stack)
    finally:
        stack.stop()


# Two to three minutes on a quiet two-core machine (a JVM per node, six services); the
# margin is for a machine others share (CALL_BUDGET_S, plus the cluster's start and stop).
@pytest.mark.timeout(600)
def test_no_acknowledged_request_is_lost_or_answered_twice_under_kill_9(
    system: ChaosSystem,
    cluster: LocalCluster,
    run_dir: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The test's own clients log every refused connection to a killed node; the timeline in
    # chaos.log and the services' logs say what happened.
    caplog.set_level(logging.CRITICAL, logger="aiokafka")
    seed = int(os.environ.get("TOKENBUS_CHAOS_SEED") or random.SystemRandom().randrange(1 << 30))
    # TOKENBUS_CHAOS_KINDS narrows the faults for a diagnosis (e.g. "ingest,worker,worker");
    # the check itself always runs them all.
    kinds = tuple(k for k in os.environ.get("TOKENBUS_CHAOS_KINDS", "").split(",") if k) or KINDS
    faults = plan(seed, kinds, *FAULT_WINDOW_S)
    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        with (run_dir / "chaos.log").open("a") as timeline:
            timeline.write(f"{time.strftime('%H:%M:%S')} {line}\n")
        with capsys.disabled():
            print(f"[chaos] {line}", flush=True)

    load_s = max(MIN_LOAD_S, last_end_s(faults) + LOAD_TAIL_S)
    say(f"seed {seed} (replay: TOKENBUS_CHAOS_SEED={seed} pytest tests/test_chaos.py)")
    say(f"cluster: {cluster.cluster.bootstrap_servers}, state dir {cluster.cluster.state_dir}")
    for fault in faults:
        say("planned: " + fault.describe())

    deadline = time.monotonic() + load_s + CALL_BUDGET_S
    run, injector = asyncio.run(_run(system, cluster, seed, faults, load_s, say, deadline))
    done = injector.done
    histories = run.histories()
    verdicts = [judge(h) for h in histories]
    summary = summarize(verdicts)
    figures = availability.figures(
        run.samples(), injector.windows, settle_s=SETTLE_S, tail_s=TAIL_S
    )
    unavailable = availability.check(figures, MIN_AVAILABILITY, ttft_scopes=())
    report = _report(
        seed,
        load_s,
        faults,
        injector,
        system.startup_exits,
        table(verdicts),
        run.counts(),
        run.seen(),
        failures(verdicts, limit=10),
        availability.markdown(figures),
        _by_fault(run.marks(), injector.windows) + "\n\n" + _splices(run.splice_gaps()),
    )
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(report)
    say("\n" + report)
    with (run_dir / "failed.jsonl").open("w") as out:
        for verdict, history in zip(verdicts, histories, strict=True):
            if not verdict.ok:
                out.write(json.dumps({**asdict(verdict), "events": history.events}) + "\n")
    with (run_dir / "reruns.jsonl").open("w") as out:  # the Kafka channel's, with read times
        for r in run.app.requests.values():
            if any(int(x.get("attempt", 0)) for x in r.records):
                out.write(json.dumps({"records": r.records, "read_at": r.read_at}) + "\n")

    # The report (seed, faults played, table) and the timeline's end in the failure itself:
    # CI keeps the test's output, not the run directory.
    timeline = (run_dir / "chaos.log").read_text().splitlines()[-25:]
    if not summary.passed or unavailable:
        # Where each service waits now (a wedge logs nothing), at the end of the failure.
        timeline += stack_dumps.summary(system.dump_stacks(), run_dir / "stacks.txt")
    assert summary.passed, "\n" + report + "\n" + "\n".join(timeline)
    assert not unavailable, "\n".join(["", *unavailable, "", report, *timeline])
    assert summary.done >= summary.acknowledged // 2, "most requests should complete"
    # A system that refused most work would pass the rest trivially.
    assert summary.acknowledged >= len(run.planned) // 2, f"most refused: {run.counts()}"
    assert not [u.protocol_errors for u in run.users if u.protocol_errors]
    assert not run.app.foreign, f"records for no request on the reply topic: {run.app.foreign[:3]}"
    assert len(done) == len(faults), f"faults played: {done}"
    # A sick engine ends its worker by itself (services/worker/engine_health.py).
    assert not injector.engine_misses, injector.engine_misses
    # Every re-run here follows a lost worker or engine, and continues the answer its client
    # was shown (ADR 0071): no `chat.reset` (the checker above holds each text to the sim's).
    # Nor an SSE `error` event: an OpenAI stream simply goes on.
    assert run.seen()["ws_resets"] == run.seen()["sse_error_events"] == 0, report


async def _run(
    system: ChaosSystem,
    brokers: LocalCluster,
    seed: int,
    faults: list[Fault],
    load_s: float,
    say: Callable[[str], None],
    deadline: float,
) -> tuple[LoadRun, Injector]:
    stack = system.stack
    reply_topic = f"{stack.prefix}.chaos-replies"
    await create_topics(stack.settings, {reply_topic: REPLY_PARTITIONS})
    for url in system.urls:
        await warm_up(url, requests=2, timeout_s=90)
    app = KafkaRequester(stack.bootstrap, stack.topics.requests, reply_topic, REPLY_PARTITIONS, "a")
    users = [WsUser(f"u{i}", system.urls, i % 2, say) for i in range(WS_USERS)]
    apis = {
        channel: OpenAiRequester(channel, system.api_urls, system.api_key)
        for channel in OPENAI_CHANNELS
    }
    run = LoadRun(users, app, plan_load(seed, RATE, load_s), apis)
    injector = Injector(system, brokers, say, network=brokers.network)
    await app.start()
    tasks = [asyncio.create_task(u.run()) for u in users]
    tasks.append(asyncio.create_task(app.read()))
    zero = time.monotonic()
    tasks.append(asyncio.create_task(injector.supervise(zero)))
    inject = asyncio.create_task(injector.run(faults, zero))
    tasks.append(inject)
    try:
        await run.send_all(zero)
        say(f"load sent at t={time.monotonic() - zero:.1f}s; draining")
        # A fault a slow broker restart delayed past the load is skipped (and listed); one
        # under way finishes first: the drain waits for it, not for a stall (see _drain).
        injector.close()
        ended = await _drain(run, inject, deadline)
        say(f"drain: {ended} at t={time.monotonic() - zero:.1f}s")
        if not inject.done():
            say("a fault still under way after the drain (a node slow to restart): cancelled")
        else:
            await inject  # raises what the injector raised
    finally:
        await cancel_all(tasks)
        await app.stop()
        for api in apis.values():
            await api.stop()
    return run, injector


async def _drain(run: LoadRun, inject: asyncio.Task[None], deadline: float) -> str:
    """Wait until every acknowledged request has its final, or answers stop coming."""
    start = last_change = time.monotonic()
    last = run.finals()
    while True:
        now = time.monotonic()
        if inject.done() and run.settled():
            return "settled"
        if (finals := run.finals()) != last or not inject.done():
            # A node still on its way back holds answers up: that is no stall.
            last, last_change = finals, now
        if now - last_change > DRAIN_STALL_S:
            return f"no answer for {DRAIN_STALL_S:g} s"
        if now > deadline:
            return f"still answering after {now - start:.0f} s (the run's budget is spent)"
        await asyncio.sleep(0.2)


def _report(
    seed: int,
    load_s: float,
    faults: list[Fault],
    injector: Injector,
    startup_exits: list[str],
    summary_table: str,
    counts: dict[str, int],
    seen: dict[str, int],
    failed: str,
    availability_table: str,
    continuity: str,
) -> str:
    played = "\n".join(f"- {line}" for line in injector.done)
    skipped = "\n".join(f"- {line}" for line in injector.skipped) or "- none"
    exits = "\n".join(f"- {line}" for line in injector.self_exits) or "- none"
    misses = "\n".join(f"- {line}" for line in injector.engine_misses) or "- none"
    planned = "\n".join(f"- {f.describe()}" for f in faults)
    extra = ", ".join(f"{k}={v}" for k, v in counts.items())
    return (
        f"Seed {seed}; load {load_s:.0f} s open loop at {RATE['websocket']:g} req/s over"
        f" WebSocket, {RATE['kafka']:g} req/s from a Kafka producer, and over the OpenAI API"
        f" {RATE['openai-stream']:g} req/s streaming and {RATE['openai']:g} req/s whole.\n\n"
        f"Faults planned:\n{planned}\n\nFaults played:\n{played}\n\n"
        f"Faults skipped (not begun when the load ended):\n{skipped}\n\n"
        f"Services that exited on their own (restarted by the supervisor):\n{exits}\n\n"
        f"Sick engines whose worker did not exit by itself:\n{misses}\n\n"
        f"Exits while the system came up: {', '.join(startup_exits) or 'none'}\n\n"
        f"{summary_table}\n\n"
        f"Availability and TTFT under faults (TTFT after settle: sent {SETTLE_S:g} s or more"
        f" after the fault struck):\n\n{availability_table}\n\n"
        f"What clients were shown of a re-run, per fault (from its start to {TAIL_S:g} s"
        f" after its end):\n\n{continuity}\n\n"
        f"Not acknowledged, so not judged: {extra}\n\n"
        f"What the faults showed: {', '.join(f'{k}={v}' for k, v in seen.items())}\n"
        + (f"\nFirst failed requests:\n```\n{failed}\n```\n" if failed else "")
    )


def _by_fault(marks: list[tuple[str, float]], windows: list[FaultWindow]) -> str:
    """A Markdown table: the `chat.reset` frames and SSE `error` events clients were shown
    in each fault's window (to TAIL_S after its end), and outside every window."""
    kinds = ("chat.reset", "sse error")
    lines = ["| fault | window (s) | chat.reset | SSE error events |", "|---|---|---:|---:|"]
    for w in windows:
        n = Counter(kind for kind, at in marks if w.holds(at, TAIL_S))
        lines.append(
            f"| {w.label} | {w.start_s:.1f}-{w.end_s:.1f} | {n[kinds[0]]} | {n[kinds[1]]} |"
        )
    outside = Counter(kind for kind, at in marks if not any(w.holds(at, TAIL_S) for w in windows))
    lines.append(f"| outside every fault | - | {outside[kinds[0]]} | {outside[kinds[1]]} |")
    return "\n".join(lines)


def _splices(gaps: list[float]) -> str:
    """The splice gap of the re-runs on the Kafka channel (`KafkaRequest.splice_gaps`)."""
    if not gaps:
        return "Splice gap: no re-run on the Kafka channel."
    ordered = sorted(gaps)
    p50, p99 = (percentile(ordered, q) for q in (50, 99))
    return (
        f"Splice gap (Kafka channel: from the lost attempt's last record to the next attempt's"
        f" first that adds text), {len(gaps)} re-runs: p50 {p50:.2f} s, p99 {p99:.2f} s,"
        f" max {max(gaps):.2f} s"
    )
