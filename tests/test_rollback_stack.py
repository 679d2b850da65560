"""Automatic rollback on a real stack: a canary that answers worse is rolled back under load.

One model, a baseline sim worker and a canary sim worker that answers half its prompts
wrongly (`TOKENBUS_WORKER_SIM_WRONG_SHARE`); every canary request is also run on the
baseline (shadow validation, gold = baseline) and scored. With the canary rolled out to
50 %, a few clients keep asking over the Kafka channel (each request a new conversation,
its results on a reply topic of the test's) until the schedulers, judging the canary's
window against the baseline's, set its share to 0 with a reason naming quality. Then: every
request ended exactly once (one final record each: none lost, none answered twice), the
conversations started after the rollback ran on the baseline, `tokenbus models status`
says why, raising the canary again is refused without `--force`, and with it, rolled back
again while its window still shows the regression.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from shared.kafka import create_topics, make_consumer, make_producer
from shared.producers import RenewingProducer
from shared.variants import ModelRollout
from tests.stack import Stack, new_prefix, read_topic, wait_until

pytestmark = pytest.mark.kafka

MODEL = "m"
CANARY = "canary"
BASE_WORKER, CANARY_WORKER = "worker", "worker-canary"
CLIENTS = 8
AFTER_ROLLBACK = 20  # new conversations asked after the rollback, at least
ROLLBACK_WITHIN_S = 60.0


@pytest.fixture(scope="module")
def rollback_stack(bootstrap: str, log_dir: Path) -> Iterator[Stack]:
    stack = Stack(
        bootstrap=bootstrap,
        prefix=new_prefix(),
        log_dir=log_dir,
        env_overrides={
            "TOKENBUS_WORKER_MODEL": MODEL,
            # These tests tell the variants apart by what `chat.done` names (issue 37, N7).
            "TOKENBUS_EDGE_NAME_VARIANTS": "true",
            # A short window and small samples: the test's load decides within seconds.
            "TOKENBUS_SCHEDULER_CANARY_WINDOW_S": "30",
            "TOKENBUS_SCHEDULER_CANARY_MIN_REQUESTS": "20",
            "TOKENBUS_SCHEDULER_CANARY_MIN_SCORES": "20",
            "TOKENBUS_SCHEDULER_CANARY_JUDGE_MS": "250",
            "TOKENBUS_SCHEDULER_CANARY_PUBLISH_S": "1",
            # The canary answers worse, not slower: its TTFT is the baseline's, give or take
            # the machine. Stop 18's clean clone had the TTFT check roll it back first (p99
            # 341 ms against 212 ms, on two cores shared with the broker and five services),
            # before the quality check had its 20 scores; the TTFT check has its own tests.
            "TOKENBUS_SCHEDULER_CANARY_TTFT_MIN_EXCESS_MS": "60000",
        },
        workers={
            BASE_WORKER: {"TOKENBUS_WORKER_ID": BASE_WORKER},
            CANARY_WORKER: {
                "TOKENBUS_WORKER_ID": CANARY_WORKER,
                "TOKENBUS_WORKER_BATCH_PARTITION": "1",
                "TOKENBUS_WORKER_VARIANT": CANARY,
                "TOKENBUS_WORKER_SIM_WRONG_SHARE": "0.5",
            },
        },
    )
    try:
        stack.start()
        wait_until(
            lambda: stack.workers_heard() == {BASE_WORKER, CANARY_WORKER}, 60, "both workers"
        )
        yield stack
    finally:
        stack.stop()


def models(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    """`tokenbus models ARGS`, run as an operator would, against the stack's broker."""
    return stack.tokenbus("models", *args)


def canary_share(stack: Stack) -> float | None:
    """The canary's share as the scheduler routes by it now (its share gauge)."""
    labels = rf'\{{model="{MODEL}",variant="{CANARY}"\}}'
    pattern = rf"^tokenbus_scheduler_variant_share_percent{labels} (\S+)$"
    try:
        found = re.search(pattern, stack.metrics("scheduler"), re.MULTILINE)
    except OSError:
        return None
    return None if found is None else float(found.group(1))


@dataclass
class Load:
    """A few clients, each asking one new conversation at a time over the Kafka channel.

    Every result record on the reply topic is kept by request id; a request's future
    resolves at its first final record (`done` or `error`).
    """

    stack: Stack
    reply_topic: str
    sent_at: dict[str, float] = field(default_factory=dict)  # request id -> monotonic
    ended_at: dict[str, float] = field(default_factory=dict)  # ... -> its first final
    results: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    waiting: dict[str, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    _ids: Iterator[int] = field(default_factory=itertools.count)

    async def read(self, consumer: AIOKafkaConsumer) -> None:
        while True:
            for records in (await consumer.getmany(timeout_ms=200)).values():
                for record in records:
                    result = json.loads(record.value or b"{}")
                    self.results.setdefault(result["request_id"], []).append(result)
                    if result["kind"] in ("done", "error"):
                        self.ended_at.setdefault(result["request_id"], time.monotonic())
                        future = self.waiting.pop(result["request_id"], None)
                        if future is not None:
                            future.set_result(result)

    async def client(self, producer: RenewingProducer, i: int) -> None:
        loop = asyncio.get_running_loop()
        while not self.stop.is_set():
            rid = f"rb-{i}-{next(self._ids)}"
            record = {
                "request_id": rid,
                "model": MODEL,
                "conversation_id": f"conversation-{rid}",  # a new one each time
                "prompt": f"question {rid}: tell me something",
                "max_tokens": 8,
                "temperature": 0,  # deterministic: a wrong answer scores 0, a right one 1
                "cache": False,
                "priority": "interactive",
                "reply_to": {"topic": self.reply_topic},
            }
            self.waiting[rid] = future = loop.create_future()
            self.sent_at[rid] = time.monotonic()
            await producer.send_and_wait(
                self.stack.topics.requests, json.dumps(record).encode(), key=rid.encode()
            )
            await asyncio.wait_for(future, 30)

    def finals(self, rid: str) -> list[dict[str, Any]]:
        return [r for r in self.results.get(rid, []) if r["kind"] in ("done", "error")]


async def drive(stack: Stack, load: Load) -> float:
    """Run the clients until the canary has been rolled back and `AFTER_ROLLBACK` requests
    asked after it have ended; the monotonic time the rollback was seen."""
    settings = stack.settings
    producer = RenewingProducer(lambda: make_producer(settings, client_id="rollback-load"))
    consumer = make_consumer(settings, group_id=None, client_id="rollback-replies")
    await producer.start()
    await consumer.start()
    seen_at: float | None = None
    try:
        tp = TopicPartition(load.reply_topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        async with asyncio.TaskGroup() as tg:
            reader = tg.create_task(load.read(consumer))
            clients = [tg.create_task(load.client(producer, i)) for i in range(CLIENTS)]
            deadline = time.monotonic() + ROLLBACK_WITHIN_S
            while True:
                await asyncio.sleep(0.2)  # poll interval of the checks below
                assert time.monotonic() < deadline, "the canary was not rolled back in time"
                assert not any(c.done() for c in clients), [c.exception() for c in clients]
                if seen_at is None and await asyncio.to_thread(canary_share, stack) == 0.0:
                    seen_at = time.monotonic()
                if seen_at is not None:
                    later = [r for r, at in load.sent_at.items() if at > seen_at]
                    if sum(1 for r in later if load.finals(r)) >= AFTER_ROLLBACK:
                        break
            load.stop.set()
            await asyncio.gather(*clients)  # each ends once its request has its final
            # A last look for a second final of any request (none should come).
            await asyncio.sleep(1.0)
            reader.cancel()
    finally:
        await consumer.stop()
        await producer.stop()
    assert seen_at is not None
    return seen_at


async def test_a_worse_answering_canary_is_rolled_back_under_load(rollback_stack: Stack) -> None:
    stack = rollback_stack
    reply_topic = f"{stack.prefix}.rollback-replies"
    await create_topics(stack.settings, {reply_topic: 1})
    shadow = await asyncio.to_thread(
        models, stack, "shadow", MODEL, "--gold", "baseline", "--percent", "100"
    )
    assert shadow.returncode == 0, shadow.stderr
    # A start from 0 % needs no evidence (there can be none yet).
    started = await asyncio.to_thread(
        models, stack, "rollout", MODEL, "--variant", CANARY, "--percent", "50"
    )
    assert started.returncode == 0, started.stderr
    await asyncio.to_thread(wait_until, lambda: canary_share(stack) == 50.0, 30, "the rollout")

    load = Load(stack, reply_topic)
    started_at = time.monotonic()
    seen_at = await drive(stack, load)

    # Every request ended exactly once, with an answer.
    assert load.sent_at
    for rid in load.sent_at:
        finals = load.finals(rid)
        assert len(finals) == 1, (rid, load.results.get(rid))
        assert finals[0]["kind"] == "done", finals[0]
    variant_of = {rid: load.finals(rid)[0].get("variant") for rid in load.sent_at}
    # The switch came under load: requests asked before it ended after it.
    across = [r for r, at in load.sent_at.items() if at < seen_at < load.ended_at[r]]
    assert across
    # The canary took its share before the rollback...
    assert CANARY in {variant_of[r] for r, at in load.sent_at.items() if at < seen_at}
    # ...and no new conversation after it.
    later = [r for r, at in load.sent_at.items() if at > seen_at]
    assert len(later) >= AFTER_ROLLBACK
    assert {variant_of[r] for r in later} == {None}  # the baseline
    print(
        f"rolled back {seen_at - started_at:.1f} s into the load; {len(load.sent_at)} requests,"
        f" {len(across)} in flight across it, {len(later)} after it"
    )

    # The rollout on the topic says why, as does `tokenbus models status`.
    rollouts = [
        ModelRollout.model_validate_json(v)
        for v in await read_topic(stack.settings, stack.topics.variants, 1)
    ]
    [canary] = [v for v in rollouts[-1].variants if v.name == CANARY]
    assert canary.percent == 0.0
    assert canary.rolled_back is not None
    assert canary.rolled_back.checks[0] == "quality", canary.rolled_back
    status = await asyncio.to_thread(models, stack, "status", MODEL, "--json")
    assert status.returncode == 0, status.stderr
    rows = {v["name"]: v for v in json.loads(status.stdout)[0]["variants"]}
    shown, baseline = rows[CANARY], rows["baseline"]
    assert "quality" in shown["rolled_back"]
    assert shown["evidence"]["quality"] < 0.9
    assert shown["evidence"]["scores"] >= 20
    # Latency and errors came from the workers' heartbeats, both sides.
    for row in (shown, baseline):
        assert row["evidence"]["answered"] > 0, row
        assert row["evidence"]["ttft_p99_ms"] > 0, row
        assert row["evidence"]["error_rate"] == 0.0, row

    # Raising it again needs --force: it was rolled back.
    again = await asyncio.to_thread(
        models, stack, "rollout", MODEL, "--variant", CANARY, "--percent", "10"
    )
    assert again.returncode == 2, again.stdout + again.stderr
    assert "refused" in again.stderr
    assert "rolled back" in again.stderr
    # Forced, it is raised; its window still shows the regression, so back to 0 it goes.
    forced = await asyncio.to_thread(
        models, stack, "rollout", MODEL, "--variant", CANARY, "--percent", "10", "--force"
    )
    assert forced.returncode == 0, forced.stderr
    assert "forced" in forced.stderr

    async def canary_on_topic() -> list[float]:
        values = await read_topic(stack.settings, stack.topics.variants, 1)
        rollouts = [ModelRollout.model_validate_json(v) for v in values]
        return [v.percent for r in rollouts for v in r.variants if v.name == CANARY]

    deadline = time.monotonic() + 30
    while (shares := await canary_on_topic())[-2:] != [10.0, 0.0]:
        assert time.monotonic() < deadline, shares
        await asyncio.sleep(0.2)  # poll interval
