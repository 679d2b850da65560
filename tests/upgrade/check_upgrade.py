"""`make upgrade-check` (issue 38, item 3): a rolling upgrade and its rollback, under load.

The three-node cluster, two edges, two workers, two schedulers and ingest start from another
release (`TOKENBUS_UPGRADE_FROM`, a commit; by default the previous release, the one
`docs/schema/released/` was copied from), under open-loop load on four channels (WebSocket,
OpenAI streaming and whole answers through the `openai` SDK, a Kafka application) with
answers of 10-30 s. Every process is then rolled to this checkout one at a time, in the
order docs/operations.md gives (tests/upgrade/roll.py), and back the same way.

It passes when, over both rolls: no acknowledged request is lost, duplicated or corrupt on
any channel (tests/chaos/checker.py); no request whose answer is shorter than the edge's
drain bound ends in an error or sees an SSE `error` event; no service log says
`result.invalid` or `worker.dead`; nothing new is dead-lettered; no process exits unless the
roll stopped it, and each one stopped exits by itself. Not in `make test` (about ten
minutes); its report is written to `.tokenbus/upgrade/last-run.md`.

Run it with `make upgrade-check` (or `make upgrade-check FROM=<commit>`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.loadgen import warm_up
from services.edge.settings import EdgeSettings
from services.worker.engines.sim_text import complete
from shared.kafka import create_topics
from tests.chaos.checker import OPENAI_CHANNELS, Verdict, failures, judge, summarize, table
from tests.chaos.load import KafkaRequester, LoadRun, Planned, WsUser, cancel_all, plan_load
from tests.chaos.openai_load import OpenAiRequester, sim_prompt
from tests.chaos.system import ChaosSystem, LocalCluster, Service, chaos_stack, fresh_run_dir
from tests.chaos.toxiproxy import ProxiedCluster
from tests.stack import ROOT
from tests.upgrade.releases import (
    commit_of,
    dependencies_differ,
    previous_release,
    says_it_leaves,
    source_tree,
)
from tests.upgrade.roll import Fleet, Step
from tests.worker_logs import events

# Requests/s, open loop. With answers of 10-30 s, about 40 streams are in flight at a time.
RATE = {"websocket": 1.2, "kafka": 0.6, "openai-stream": 0.6, "openai": 0.3}
SIM_TOKEN_RATE = 4  # tokens/s per sequence
TOKENS = (40, 120)  # max_tokens: 10-30 s at that rate (the sim's own answers end some sooner)
WS_USERS = 4
REPLY_PARTITIONS = 2
WARM_S = 20.0  # load before the first step: every kind of request in flight
TAIL_S = 10.0  # load after the last step
PLAN_S = 1800.0  # the load's plan; sending stops TAIL_S after the rollback
DRAIN_S = 180.0  # after the load, for the last answers (30 s long at most)
DRAIN_BOUND_S = float(EdgeSettings.model_fields["edge_drain_s"].default)
# An answer this much shorter than the drain bound ends within it, whatever queueing it met.
MARGIN_S = 2.0
REPORT_DIR = ROOT / ".tokenbus" / "upgrade"
RUN_DIR = REPORT_DIR / "run"
NOT_LOGGED = ("result.invalid", "worker.dead")


@dataclass(frozen=True)
class Releases:
    old: str  # commit
    new: str  # "this checkout" (its HEAD, and what the work tree changes)
    old_tree: Path


@pytest.fixture(scope="module")
def releases() -> Releases:
    old = commit_of(os.environ.get("TOKENBUS_UPGRADE_FROM") or previous_release())
    if dependencies_differ(old):
        pytest.fail(
            f"{old[:10]} pins a dependency (pyproject.toml) this checkout does not pin as it"
            " does; both releases run in this checkout's environment: pick a release whose"
            " dependencies this checkout's include"
        )
    return Releases(old, commit_of("HEAD")[:10] + " (this checkout)", source_tree(old))


@pytest.fixture
def run_dir() -> Path:
    return fresh_run_dir(RUN_DIR)


@pytest.fixture
def cluster(three_nodes: ProxiedCluster) -> LocalCluster:
    return LocalCluster(three_nodes.whole().cluster)


@pytest.fixture
def system(cluster: LocalCluster, releases: Releases, run_dir: Path) -> Iterator[ChaosSystem]:
    stack = chaos_stack(
        cluster.cluster, run_dir, TOKENBUS_WORKER_SIM_TOKEN_RATE=str(SIM_TOKEN_RATE)
    )
    stack.tree = releases.old_tree  # every service, until the roll starts one of another
    try:
        system = ChaosSystem.start(stack)
        system.services["scheduler-b"] = Service(
            "scheduler", "scheduler-b", {"TOKENBUS_SCHEDULER_ID": "sched-b"}
        )
        system.launch("scheduler-b")
        yield system
    finally:
        stack.stop()


@pytest.mark.integration
@pytest.mark.timeout(3600)
def test_a_rolling_upgrade_and_its_rollback_fail_no_request(
    system: ChaosSystem,
    cluster: LocalCluster,
    releases: Releases,
    run_dir: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.CRITICAL, logger="aiokafka")
    seed = int(os.environ.get("TOKENBUS_UPGRADE_SEED") or random.SystemRandom().randrange(1 << 30))

    def say(line: str) -> None:
        with (run_dir / "upgrade.log").open("a") as timeline:
            timeline.write(f"{time.strftime('%H:%M:%S')} {line}\n")
        with capsys.disabled():
            print(f"[upgrade] {line}", flush=True)

    say(f"seed {seed}; {releases.old[:10]} -> {releases.new} -> {releases.old[:10]}")
    began = time.monotonic()
    run, fleet, dlq = asyncio.run(_run(system, cluster, releases, seed, say))
    minutes = (time.monotonic() - began) / 60

    verdicts = [judge(h) for h in run.histories()]
    summary = summarize(verdicts)
    durations = _durations(run)
    short = {rid for rid, s in durations.items() if s <= DRAIN_BOUND_S - MARGIN_S}
    error_finals = [v for v in verdicts if v.outcome not in (None, "done")]
    short_errors = [v for v in error_finals if v.request_id in short]
    sse_errors = _sse_error_events(run)
    short_sse = {rid: n for rid, n in sse_errors.items() if rid in short}
    logged = {
        name: sum(len(events(log, name)) for log in sorted((run_dir / "logs").glob("*.log")))
        for name in NOT_LOGGED
    }
    # A process stopped by SIGTERM exits 0, or -15: uvicorn raises the signal again once
    # it has shut down (an edge); None: it had to be killed.
    unclean = [s for s in fleet.steps if s.stopped and s.exit_code not in (0, -signal.SIGTERM)]
    # A release whose workers do not say they leave (the `tokenbus-leaving` header), or whose
    # schedulers do not read it, sees each drained worker die: only a pair that both do can
    # be held to no `worker.dead`.
    both_leave = says_it_leaves(releases.old_tree)
    report = _report(
        releases,
        seed,
        minutes,
        fleet,
        verdicts,
        run,
        durations,
        error_finals,
        sse_errors,
        logged,
        dlq,
    )
    if not both_leave:
        report += (
            f"\n{releases.old[:10]}'s workers do not say they leave (the `tokenbus-leaving`"
            " header), nor do its schedulers read it: each worker drained under one of them"
            " was declared dead, its recovery finding nothing to hand back.\n"
        )
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    (REPORT_DIR / "last-run.md").write_text(report)
    say("\n" + report)

    assert summary.passed, report
    assert not short_errors, f"errors for answers shorter than the drain bound:\n{report}"
    assert not short_sse, f"SSE error events for answers shorter than the drain bound:\n{report}"
    assert logged["result.invalid"] == 0, report
    assert logged["worker.dead"] == 0 or not both_leave, report
    assert dlq == 0, f"{dlq} records dead-lettered during the roll\n{report}"
    assert not fleet.unexpected_exits, report
    assert not unclean, f"processes that did not stop by themselves: {unclean}\n{report}"
    assert summary.acknowledged >= len(run.planned) * 0.99, run.counts()


async def _run(
    system: ChaosSystem,
    cluster: LocalCluster,
    releases: Releases,
    seed: int,
    say: Callable[[str], None],
) -> tuple[LoadRun, Fleet, int]:
    stack = system.stack
    reply_topic = f"{stack.prefix}.upgrade-replies"
    await create_topics(stack.settings, {reply_topic: REPLY_PARTITIONS})
    for url in system.urls:
        await warm_up(url, requests=2, timeout_s=90)
    dlq_before = len(await stack.read_async(stack.topics.dlq))
    ws_slots = list(system.urls)
    app = KafkaRequester(stack.bootstrap, stack.topics.requests, reply_topic, REPLY_PARTITIONS, "u")
    users = [WsUser(f"u{i}", ws_slots, i % 2, say, retry_refused=True) for i in range(WS_USERS)]
    apis = {
        channel: OpenAiRequester(channel, system.api_urls, system.api_key, retry_refused=True)
        for channel in OPENAI_CHANNELS
    }
    run = LoadRun(users, app, plan_load(seed, RATE, PLAN_S, TOKENS), apis)
    zero = time.monotonic()
    fleet = Fleet(system, cluster.cluster, ws_slots, list(apis.values()), say, zero)
    rolled_back: list[float] = []
    await app.start()
    tasks = [asyncio.create_task(u.run()) for u in users]
    tasks += [asyncio.create_task(app.read()), asyncio.create_task(fleet.supervise())]
    try:
        sending = asyncio.create_task(
            run.send_all(zero, until=lambda: bool(rolled_back) and fleet.now() > rolled_back[0])
        )
        tasks.append(sending)
        await asyncio.sleep(WARM_S)
        await fleet.roll(ROOT, releases.new)
        await fleet.roll(releases.old_tree, releases.old[:10])
        rolled_back.append(fleet.now() + TAIL_S)
        await sending
        say(f"t={fleet.now():5.1f}s load sent ({len(run.planned)} requests); draining")
        deadline = time.monotonic() + DRAIN_S
        while True:
            if run.settled() or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        say(f"t={fleet.now():5.1f}s drained: settled={run.settled()}")
        dlq = len(await stack.read_async(stack.topics.dlq)) - dlq_before
    finally:
        await cancel_all(tasks)
        await app.stop()
        for api in apis.values():
            await api.stop()
    return run, fleet, dlq


def _planned_by_id(run: LoadRun) -> dict[str, Planned]:
    """Each judged request's plan, by the id its history carries."""
    out = {r.request_id: r.planned for u in run.users for r in u.requests.values() if r.request_id}
    out |= {r.request_id: r.planned for r in run.app.requests.values()}
    for api in run.apis.values():
        out |= {api.id_of(r): r.planned for r in api.requests}
    return out


def _durations(run: LoadRun) -> dict[str, float]:
    """Seconds each judged request's answer takes at the sim's pace, by id."""
    out = {}
    for rid, p in _planned_by_id(run).items():
        prompt = sim_prompt(p) if p.channel in OPENAI_CHANNELS else p.prompt
        out[rid] = complete(prompt, p.max_tokens).completion_tokens / SIM_TOKEN_RATE
    return out


def _sse_error_events(run: LoadRun) -> dict[str, int]:
    """The SSE `error` events each streamed request was shown, by id (those shown any)."""
    api = run.apis["openai-stream"]
    return {api.id_of(r): len(r.error_events_at) for r in api.requests if r.error_events_at}


def _report(
    releases: Releases,
    seed: int,
    minutes: float,
    fleet: Fleet,
    verdicts: list[Verdict],
    run: LoadRun,
    durations: dict[str, float],
    error_finals: list[Verdict],
    sse_errors: dict[str, int],
    logged: dict[str, int],
    dlq: int,
) -> str:
    lengths = sorted(durations.values())
    long_ = sum(s > DRAIN_BOUND_S - MARGIN_S for s in lengths)
    seen: dict[str, int] = {
        "ws_reconnects": sum(u.reconnects for u in run.users),
        "ws_refusals_retried": sum(u.refusals_retried for u in run.users),
        "ws_resets": sum(len(r.resets_at) for u in run.users for r in u.requests.values()),
    }
    for api in run.apis.values():
        seen |= api.seen()
        seen[f"{api.channel}_refusals_retried"] = api.refusals_retried
    errors = ", ".join(
        f"{v.request_id} {v.outcome} ({durations.get(v.request_id or '', 0):.0f} s)"
        for v in error_finals
    )
    sse = ", ".join(f"{rid} x{n} ({durations.get(rid, 0):.0f} s)" for rid, n in sse_errors.items())
    return (
        f"# Rolling upgrade {releases.old[:10]} -> {releases.new} -> {releases.old[:10]}\n\n"
        f"Seed {seed}; {minutes:.1f} minutes in all; load open loop at"
        f" {', '.join(f'{k} {v:g}/s' for k, v in RATE.items())}; answers at"
        f" {SIM_TOKEN_RATE} tokens/s: {min(lengths, default=0):.0f}-{max(lengths, default=0):.0f} s"
        f" (median {statistics.median(lengths) if lengths else 0:.0f} s), {long_} of"
        f" {len(lengths)} longer than the edge's drain bound ({DRAIN_BOUND_S:g} s) less"
        f" {MARGIN_S:g} s.\n\n"
        f"## Steps\n\n{_steps(fleet.steps)}\n\n"
        f"## What clients saw\n\n{table(verdicts)}\n\n"
        f"Error outcomes: {errors or 'none'}\n\n"
        f"SSE error events (a draining edge's `edge_restarting`, then resumed): {sse or 'none'}"
        f"\n\n{', '.join(f'{k}={v}' for k, v in seen.items())}\n\n"
        f"Not acknowledged, so not judged: {run.counts()}\n\n"
        f"Logged: {logged}; dead-lettered during the roll: {dlq}; processes that exited"
        f" unasked: {fleet.unexpected_exits or 'none'}\n"
        + (
            f"\nFirst failed requests:\n```\n{failed}\n```\n"
            if (failed := failures(verdicts, limit=10))
            else ""
        )
    )


def _steps(steps: list[Step]) -> str:
    lines = ["| step | from (s) | took (s) | exit |", "|---|---:|---:|---:|"]
    for s in steps:
        took = s.ended_s - s.started_s
        code = s.exit_code if s.stopped else "-"
        lines.append(f"| {s.what} | {s.started_s:.1f} | {took:.1f} | {code} |")
    return "\n".join(lines)
