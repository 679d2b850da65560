"""The chaos check: open-loop load over WebSocket and Kafka while processes die with kill -9.

Every request that got `chat.accepted`, or whose record the broker acknowledged, must end in
exactly one final outcome, and every `done` must carry the engine's exact text with no gap and
no duplicate (tests/chaos/checker.py). Faults come from a seed printed at the start; run
`TOKENBUS_CHAOS_SEED=<seed> pytest tests/test_chaos.py` to play the same plan again.
The table of the last run is written to `.tokenbus/chaos/last-run.md`.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bench.loadgen import warm_up
from shared.kafka import create_topics
from tests.chaos.checker import failures, judge, summarize, table
from tests.chaos.faults import SERVICE_KINDS, Fault, plan
from tests.chaos.load import KafkaRequester, LoadRun, WsUser, cancel_all, plan_load, until
from tests.chaos.system import CHAOS_ENV, ChaosSystem, Injector
from tests.stack import ROOT, Stack, new_prefix

LOAD_S = 60.0
RATE = {"websocket": 20.0, "kafka": 10.0}  # requests/s, open loop
FAULT_WINDOW_S = (5.0, 50.0)  # the last restart is done well before the load ends
DRAIN_S = 90.0  # after the load: longest wait for every acknowledged request's final
WS_USERS = 6
REPLY_PARTITIONS = 2
REPORT = ROOT / ".tokenbus" / "chaos" / "last-run.md"


@pytest.fixture
def system(bootstrap: str, log_dir: Path) -> Iterator[ChaosSystem]:
    stack = Stack(
        bootstrap=bootstrap, prefix=new_prefix(), log_dir=log_dir, env_overrides=dict(CHAOS_ENV)
    )
    try:
        yield ChaosSystem.start(stack)
    finally:
        stack.stop()


def test_no_acknowledged_request_is_lost_or_answered_twice_under_kill_9(
    system: ChaosSystem, capsys: pytest.CaptureFixture[str]
) -> None:
    seed = int(os.environ.get("TOKENBUS_CHAOS_SEED") or random.SystemRandom().randrange(1 << 30))
    faults = plan(seed, SERVICE_KINDS * 2, *FAULT_WINDOW_S)
    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        with capsys.disabled():
            print(f"[chaos] {line}", flush=True)

    say(f"seed {seed} (replay: TOKENBUS_CHAOS_SEED={seed} pytest tests/test_chaos.py)")
    for fault in faults:
        say("planned: " + fault.describe())

    run, done = asyncio.run(_run(system, seed, faults, say))
    verdicts = [judge(h) for h in run.histories()]
    summary = summarize(verdicts)
    report = _report(seed, faults, done, table(verdicts), run.counts(), run.seen())
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(report)
    say("\n" + report)

    assert not [u.protocol_errors for u in run.users if u.protocol_errors]
    assert not run.app.foreign, f"records for no request on the reply topic: {run.app.foreign[:3]}"
    assert len(done) == len(faults), f"faults played: {done}"
    system.stack.check_alive()
    assert summary.done >= summary.acknowledged // 2, "most requests should complete"
    assert summary.passed, "\n" + failures(verdicts)


async def _run(
    system: ChaosSystem, seed: int, faults: list[Fault], say: Callable[[str], None]
) -> tuple[LoadRun, list[str]]:
    stack = system.stack
    reply_topic = f"{stack.prefix}.chaos-replies"
    await create_topics(stack.settings, {reply_topic: REPLY_PARTITIONS})
    for url in system.urls:
        await warm_up(url, requests=2, timeout_s=90)
    app = KafkaRequester(stack.bootstrap, stack.topics.requests, reply_topic, REPLY_PARTITIONS, "a")
    users = [WsUser(f"u{i}", system.urls, i % 2, say) for i in range(WS_USERS)]
    run = LoadRun(users, app, plan_load(seed, RATE, LOAD_S))
    injector = Injector(system, None, say)
    await app.start()
    tasks = [asyncio.create_task(u.run()) for u in users]
    tasks.append(asyncio.create_task(app.read()))
    try:
        zero = time.monotonic()
        await asyncio.gather(run.send_all(zero), injector.run(faults, zero))
        say(f"load sent at t={time.monotonic() - zero:.1f}s; draining")
        settled = await until(run.settled, DRAIN_S)
        say(f"{'settled' if settled else 'NOT settled'} at t={time.monotonic() - zero:.1f}s")
    finally:
        await cancel_all(tasks)
        await app.stop()
    return run, injector.done


def _report(
    seed: int,
    faults: list[Fault],
    done: list[str],
    summary_table: str,
    counts: dict[str, int],
    seen: dict[str, int],
) -> str:
    played = "\n".join(f"- {line}" for line in done)
    planned = "\n".join(f"- {f.describe()}" for f in faults)
    extra = ", ".join(f"{k}={v}" for k, v in counts.items())
    return (
        f"Seed {seed}; load {LOAD_S:g} s open loop at {RATE['websocket']:g} req/s over"
        f" WebSocket and {RATE['kafka']:g} req/s from a Kafka producer.\n\n"
        f"Faults planned:\n{planned}\n\nFaults played:\n{played}\n\n{summary_table}\n\n"
        f"Not acknowledged, so not judged: {extra}\n\n"
        f"What the faults showed: {', '.join(f'{k}={v}' for k, v in seen.items())}\n"
    )
