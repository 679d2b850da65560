"""Variants on a real stack: one model, a baseline worker and a canary worker, rolled out with
the real `tokenbus models` command while the stack runs.

A rollout to 25 % moves about a quarter of the conversations to the canary, each
conversation stays on its variant from turn to turn, `chat.done` names the variant that
answered, and a restarted scheduler routes every conversation as before (it reads the
rollout back from the compacted variants topic). And on the real broker alone: the
scheduler's reader of that topic, where the topic is made only after it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets
from aiokafka import ConsumerRecord

from services.scheduler import variants as scheduler_variants
from services.scheduler.variants import RolloutReader, Rollouts
from shared import semconv
from shared.kafka import (
    create_topics,
    delete_topics,
    encode,
    make_admin,
    make_consumer,
    make_producer,
)
from shared.telemetry import read_span_file
from shared.topics import Topics
from shared.variants import ModelRollout, Variant
from tests.chat_client import openai_sdk, run_requests
from tests.stack import Stack, new_prefix, settings_from_env, wait_until

MODEL = "m"
CANARY = "canary"
BASE_WORKER, CANARY_WORKER = "worker", "worker-canary"
CONVERSATIONS = 80


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("variant-traces")


@pytest.fixture(scope="module")
def variants(bootstrap: str, log_dir: Path, trace_dir: Path) -> Iterator[Stack]:
    stack = Stack(
        bootstrap=bootstrap,
        prefix=new_prefix(),
        log_dir=log_dir,
        env_overrides={
            "TOKENBUS_TRACE_DIR": str(trace_dir),
            "TOKENBUS_TRACE_FLUSH_MS": "50",
            "TOKENBUS_WORKER_MODEL": MODEL,
            # A stable id: the restarted scheduler takes its partitions back at once.
            "TOKENBUS_SCHEDULER_ID": "sched-variants",
            # These tests tell the variants apart by what `chat.done` names (issue 37, N7).
            "TOKENBUS_EDGE_NAME_VARIANTS": "true",
        },
        workers={
            BASE_WORKER: {"TOKENBUS_WORKER_ID": BASE_WORKER},
            CANARY_WORKER: {
                "TOKENBUS_WORKER_ID": CANARY_WORKER,
                "TOKENBUS_WORKER_BATCH_PARTITION": "1",
                "TOKENBUS_WORKER_VARIANT": CANARY,
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


def status(stack: Stack) -> dict[str, dict[str, Any]]:
    """`tokenbus models status --json` for MODEL: its variants by name."""
    done = models(stack, "status", MODEL, "--json")
    assert done.returncode == 0, done.stderr
    [found] = json.loads(done.stdout)
    return {v["name"]: v for v in found["variants"]}


def canary_metric(stack: Stack, name: str) -> float | None:
    """One of the scheduler's metrics for the model's canary; None if it has none (yet), or
    the scheduler does not answer (restarting)."""
    pattern = rf'^{name}\{{model="m",variant="canary"\}} (\S+)$'
    try:
        found = re.search(pattern, stack.metrics("scheduler"), re.MULTILINE)
    except OSError:
        return None
    return None if found is None else float(found.group(1))


def scheduler_share(stack: Stack) -> float | None:
    """The canary's share as the scheduler routes by it (its share gauge), if set."""
    return canary_metric(stack, "tokenbus_scheduler_variant_share_percent")


def conversation(i: int, turn: int) -> dict[str, Any]:
    messages = [{"role": "user", "content": f"conversation {i}, turn {t}"} for t in range(turn)]
    return {
        "client_id": f"c{i}-t{turn}",
        "conversation_id": f"conversation-{i}",
        "messages": messages,
        "model": MODEL,
        "max_tokens": 3,
    }


def openai_fingerprints(stack: Stack, i: int) -> list[str | None]:
    """The `system_fingerprint` of conversation `i`'s next turn over the OpenAI API (with
    the `openai` SDK): of the whole answer, then of a stream's finishing chunk."""
    ask: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"conversation {i}, over the OpenAI API"}],
        "max_tokens": 3,
        "extra_body": {"conversation_id": f"conversation-{i}"},
    }
    with openai_sdk(stack) as sdk:  # its connections closed here, not whenever it is freed
        whole = sdk.chat.completions.create(**ask)
        chunks = list(sdk.chat.completions.create(stream=True, **ask))
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finishing) == 1, chunks
    return [whole.system_fingerprint, finishing[0].system_fingerprint]


async def answers(stack: Stack, turn: int) -> dict[int, tuple[str, str]]:
    """Conversation number -> the variant whose worker answered its turn `turn` (as
    `chat.done` names it), and the request's id."""
    requests = [conversation(i, turn) for i in range(CONVERSATIONS)]
    async with websockets.connect(stack.ws_url) as ws:
        transcripts = await run_requests(ws, requests, timeout=120)
    out: dict[int, tuple[str, str]] = {}
    for i in range(CONVERSATIONS):
        t = transcripts[f"c{i}-t{turn}"]
        assert t.final is not None
        assert t.final["type"] == "chat.done", t.final
        assert t.final["model"] == MODEL
        assert t.request_id is not None
        out[i] = (t.final.get("variant", "baseline"), t.request_id)
    return out


async def answered_by(stack: Stack, turn: int) -> dict[int, str]:
    """Conversation number -> the variant whose worker answered its turn `turn`."""
    return {i: variant for i, (variant, _) in (await answers(stack, turn)).items()}


def span_variants(trace_dir: Path, request_id: str) -> dict[str, str | None]:
    """The `tokenbus.variant` of the request's worker and edge spans, by span name (those
    written so far)."""
    spans = [s for path in trace_dir.glob("*.jsonl") for s in read_span_file(path)]
    traces = {s.trace_id for s in spans if s.attributes.get(semconv.REQUEST_ID) == request_id}
    return {
        s.name: s.attributes.get(semconv.VARIANT)
        for s in spans
        if s.trace_id in traces and s.name in (semconv.SPAN_WORKER_REQUEST, semconv.SPAN_CHAT)
    }


async def test_a_rollout_moves_its_share_sticks_and_survives_a_scheduler_restart(
    variants: Stack, trace_dir: Path
) -> None:
    stack = variants
    # Before any rollout, everything runs on the baseline; the canary is live but idle.
    await asyncio.to_thread(
        wait_until, lambda: CANARY_WORKER in status(stack).get(CANARY, {}).get("workers", []),
        30, "the canary worker in `tokenbus models status`",
    )  # fmt: skip
    before = await answered_by(stack, 1)
    assert set(before.values()) == {"baseline"}

    done = models(stack, "rollout", MODEL, "--variant", CANARY, "--percent", "25")
    assert done.returncode == 0, done.stderr
    assert "canary 0 % -> 25 %" in done.stdout
    shares = status(stack)
    assert (shares["baseline"]["percent"], shares[CANARY]["percent"]) == (75.0, 25.0)
    assert shares[CANARY]["workers"] == [CANARY_WORKER]
    assert shares["baseline"]["workers"] == [BASE_WORKER]
    await asyncio.to_thread(wait_until, lambda: scheduler_share(stack) == 25.0, 30, "25 %")

    turn = await answers(stack, 2)
    first = {i: variant for i, (variant, _) in turn.items()}
    on_canary = sum(v == CANARY for v in first.values())
    # 80 conversations at 25 %: 20 expected, 3.9 standard deviation; 3 either side.
    assert 8 <= on_canary <= 32, first
    assert set(first.values()) == {"baseline", CANARY}
    # The trace names the variant that answered: the worker's span and the edge's root.
    for variant in ("baseline", CANARY):
        rid = next(rid for v, rid in turn.values() if v == variant)
        named = None if variant == "baseline" else variant
        expected = {semconv.SPAN_WORKER_REQUEST: named, semconv.SPAN_CHAT: named}

        def written(rid: str = rid, expected: dict[str, str | None] = expected) -> bool:
            return span_variants(trace_dir, rid) == expected

        await asyncio.to_thread(wait_until, written, 30, f"the {variant}'s spans")
    # Sticky: every conversation's next turn lands on the same variant.
    assert await answered_by(stack, 3) == first
    # The OpenAI API names the variant in `system_fingerprint` (absent: the baseline), in a
    # whole answer and in a stream's finishing chunk.
    for variant in ("baseline", CANARY):
        i = next(i for i, v in first.items() if v == variant)
        fingerprints = await asyncio.to_thread(openai_fingerprints, stack, i)
        assert fingerprints == [None if variant == "baseline" else variant] * 2

    # A restarted scheduler reads the rollout back: the same conversations, same variants.
    await asyncio.to_thread(stack.stop_service, "scheduler", signal.SIGTERM)
    stack.start_service("scheduler")
    await asyncio.to_thread(wait_until, lambda: scheduler_share(stack) == 25.0, 60, "restart")
    assert await answered_by(stack, 4) == first

    # The canary gone, its conversations are answered by the baseline, and counted so.
    await asyncio.to_thread(stack.stop_service, CANARY_WORKER, signal.SIGTERM)
    await asyncio.to_thread(
        wait_until, lambda: status(stack)[CANARY]["workers"] == [], 30, "the canary gone"
    )
    assert set((await answered_by(stack, 5)).values()) == {"baseline"}
    assert canary_metric(stack, "tokenbus_scheduler_variant_fallbacks_total") == on_canary


def rollout_of(stack: Stack) -> dict[str, dict[str, Any]]:
    """The rollout itself in `status`: each variant's share and description, without the
    schedulers' evidence, which moves with every heartbeat."""
    return {
        name: {k: v for k, v in entry.items() if k not in ("evidence", "workers")}
        for name, entry in status(stack).items()
    }


def test_bad_rollouts_are_refused_with_a_clear_error_and_change_nothing(variants: Stack) -> None:
    before = rollout_of(variants)
    over = models(variants, "rollout", MODEL, "--variant", "other", "--percent", "101")
    assert over.returncode == 2
    assert "percent: Input should be less than or equal to 100" in over.stderr
    odd = models(variants, "rollout", MODEL, "--variant", "a/b", "--percent", "5")
    assert odd.returncode == 2
    assert "name: String should match pattern" in odd.stderr
    named = models(variants, "rollout", MODEL, "--variant", "baseline", "--percent", "5")
    assert named.returncode == 2
    assert "workers without a variant" in named.stderr
    assert rollout_of(variants) == before


async def test_a_reader_started_before_its_topic_reads_it_once_it_is_made(
    bootstrap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deployment upgraded without `tokenbus topics create`: the scheduler starts with no
    rollout (its start is not held up), and follows the topic from its start once made."""
    monkeypatch.setattr(scheduler_variants, "MISSING_RETRY_S", 0.2)
    settings = settings_from_env({}, KAFKA_BOOTSTRAP_SERVERS=bootstrap, topic_prefix=new_prefix())
    topic = Topics(settings.topic_prefix).variants
    rollouts = Rollouts()
    dead_letters: list[str] = []
    took, refused = asyncio.Event(), asyncio.Event()

    async def dead_letter(record: ConsumerRecord[bytes, bytes], reason: str) -> None:
        dead_letters.append(reason)  # records what the scheduler would dead-letter
        refused.set()

    consumer = make_consumer(settings, group_id=None, client_id="test-variants")
    admin, producer = make_admin(settings), make_producer(settings, client_id="test-variants")
    for client in (consumer, admin, producer):
        await client.start()
    try:
        reader = RolloutReader(consumer, rollouts, admin, topic, lambda _: took.set())
        assert await reader.load() is False
        following = asyncio.create_task(reader.run(dead_letter))
        await create_topics(settings, {topic: 1}, 1, configs=settings.topic_configs())
        rollout = ModelRollout(model=MODEL, variants=[Variant(name=CANARY, percent=40)])
        await producer.send_and_wait(topic, encode(rollout), key=MODEL.encode())
        await producer.send_and_wait(topic, b"{not a rollout", key=MODEL.encode())
        await asyncio.wait_for(asyncio.gather(took.wait(), refused.wait()), 30)
        assert rollouts.get(MODEL) == rollout
        assert len(dead_letters) == 1
        assert dead_letters[0].startswith("invalid rollout: ")
        following.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await following
    finally:
        await consumer.stop()
        await producer.stop()
        await admin.close()
        await delete_topics(settings, [topic])
