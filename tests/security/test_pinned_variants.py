"""Pinned variants on a real stack, and `tokenbus eval`, which pins: one model with a
baseline worker, a faithful variant (`same`) and one made wrong half of the time (`wrong`,
TOKENBUS_WORKER_SIM_WRONG_SHARE=0.5), all sim engines, no rollout.

Here (tests/security/, moved from tests/test_eval_stack.py) because a pin is a privilege:
only a key with the `pin_variant` scope may pin, and a pin no worker serves must never hold
its tier partition for every other tenant (issue 37, N3: the attack, held requests, and the
partition's commit that keeps moving past them).

A request that names its variant runs there whatever the rollout says (here: all to the
baseline), over the edge only with a key that has the `pin_variant` scope; one pinned to a
variant with no worker waits, and ends `deadline_exceeded`, never answered by another.
`tokenbus eval` runs a set on the three variants, pinned, straight through Kafka, and its
report shows the faithful variant equal to the baseline and the wrong one apart.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import websockets
from aiokafka import TopicPartition

from services.edge import keys as keyfile
from services.edge.keys import PIN_VARIANT
from services.worker.engines.sim_text import natural_tokens
from shared.kafka import make_admin
from shared.messages import Tier
from tests.chat_client import openai_sdk, recv_json, run_requests
from tests.stack import UNLIMITED, Stack, new_prefix, read_records, wait_until

MODEL = "m"
WORKERS = {"worker": None, "worker-same": "same", "worker-wrong": "wrong"}
EVALUATOR = "evaluator"  # a tenant whose key may pin variants
ITEMS = 40
UNSERVED_HOLD_S = 12.0  # a pin no live worker serves is answered after this (issue 37, N3)
# A short read-ahead and requeue wait, so that a few hundred requests show what 16,000 and
# 30 s do in production (issue 37, N3: services/scheduler/requeue.py).
MAX_OPEN_OFFSETS = 64
REQUEUE_AFTER_S = 1.0


@pytest.fixture(scope="module")
def pinned_stack(bootstrap: str, log_dir: Path) -> Iterator[Stack]:
    workers: dict[str, dict[str, str]] = {}
    for partition, (name, variant) in enumerate(WORKERS.items()):
        env = {"TOKENBUS_WORKER_ID": name, "TOKENBUS_WORKER_BATCH_PARTITION": str(partition)}
        if variant is not None:
            env["TOKENBUS_WORKER_VARIANT"] = variant
        if variant == "wrong":
            env["TOKENBUS_WORKER_SIM_WRONG_SHARE"] = "0.5"
        workers[name] = env
    stack = Stack(
        bootstrap=bootstrap,
        prefix=new_prefix(),
        log_dir=log_dir,
        env_overrides={
            "TOKENBUS_WORKER_MODEL": MODEL,
            "TOKENBUS_SCHEDULER_UNSERVED_HOLD_S": str(UNSERVED_HOLD_S),
            "TOKENBUS_SCHEDULER_MAX_OPEN_OFFSETS": str(MAX_OPEN_OFFSETS),
            "TOKENBUS_SCHEDULER_REQUEUE_AFTER_S": str(REQUEUE_AFTER_S),
        },
        workers=workers,
    )
    # A key that may pin, beside the stack's own keys (which may not).
    keys = keyfile.load(stack.keys_file)
    keys, stack.keys[EVALUATOR], _ = keyfile.add_key(
        keys, EVALUATOR, UNLIMITED, time.time(), [PIN_VARIANT]
    )
    keyfile.save(stack.keys_file, keys)
    try:
        stack.start()
        wait_until(lambda: stack.workers_heard() == set(WORKERS), 60, "the three workers")
        yield stack
    finally:
        stack.stop()


def ask(i: int, variant: str | None, **fields: Any) -> dict[str, Any]:
    request = {
        "client_id": f"c{i}-{variant}",
        "prompt": f"pinned prompt {i}",
        "model": MODEL,
        "max_tokens": 4,
        "temperature": 0,
        **fields,
    }
    if variant is not None:
        request["variant"] = variant
    return request


async def test_a_pinned_request_runs_only_on_its_variant(pinned_stack: Stack) -> None:
    stack = pinned_stack
    # A key without the scope may not pin, over the WebSocket or the OpenAI API.
    async with websockets.connect(stack.ws_url) as ws:
        refused = await run_requests(ws, [ask(0, "same")])
    final = refused["c0-same"].final
    assert final is not None
    assert final["type"] == "error", final
    assert final["code"] == "invalid_request"
    assert final["message"].startswith("variant: this API key may not pin a variant")
    assert refused["c0-same"].request_id is None  # refused before anything reached Kafka
    with openai_sdk(stack) as sdk, pytest.raises(openai.BadRequestError, match="pin_variant"):
        sdk.completions.create(
            model=MODEL, prompt="p", max_tokens=2, extra_body={"variant": "same"}
        )

    # With it, each request runs on the variant it names; unpinned ones on the baseline
    # (no rollout), the same prompt twice.
    requests = [ask(i, v) for i in range(6) for v in ("same", "wrong", "baseline", None)]
    async with websockets.connect(stack.ws_url_as(EVALUATOR)) as ws:
        answered = await run_requests(ws, requests, timeout=60)
    for r in requests:
        final = answered[r["client_id"]].final
        assert final is not None
        assert final["type"] == "chat.done", final
        named = r.get("variant")
        assert final.get("variant") == (None if named in (None, "baseline") else named)
    with openai_sdk(stack, EVALUATOR) as sdk:
        whole = sdk.completions.create(
            model=MODEL, prompt="p", max_tokens=2, extra_body={"variant": "wrong"}
        )
    assert whole.system_fingerprint == "wrong"

    # A variant with no worker: the request waits for one until its deadline, and is never
    # run on another (the baseline has room all along).
    started = time.monotonic()
    async with websockets.connect(stack.ws_url_as(EVALUATOR)) as ws:
        ghost = await run_requests(ws, [ask(9, "ghost", deadline_ms=1500)], timeout=30)
    final = ghost["c9-ghost"].final
    assert final is not None
    assert final["type"] == "error", final
    assert final["code"] == "deadline_exceeded"
    assert ghost["c9-ghost"].deltas == []
    assert time.monotonic() - started >= 1.4
    # Without a deadline it was held for ever, its tier partition's commit behind it
    # (issue 37, N3): now it is answered `overloaded` after the scheduler's unserved hold.
    started = time.monotonic()
    async with websockets.connect(stack.ws_url_as(EVALUATOR)) as ws:
        ghost = await run_requests(ws, [ask(10, "ghost")], timeout=60)
    final = ghost["c10-ghost"].final
    assert final is not None
    assert (final["type"], final["code"]) == ("error", "overloaded"), final
    assert "no live worker has served model 'm', variant 'ghost'" in final["message"]
    assert UNSERVED_HOLD_S * 0.9 <= time.monotonic() - started < UNSERVED_HOLD_S + 30


async def tier_records(stack: Stack, request_id: str) -> list[tuple[int, int, dict[str, Any]]]:
    """(partition, offset, record) of every interactive tier record of `request_id`."""
    topic = stack.topics.tier(Tier.interactive)
    records = await read_records(stack.settings, topic, stack.topics.partitions()[topic])
    bodies = ((r, json.loads(r.value or b"{}")) for r in records)
    return [(r.partition, r.offset, b) for r, b in bodies if b.get("request_id") == request_id]


async def committed(stack: Stack, tp: TopicPartition) -> int:
    """The schedulers' committed position of `tp` (-1: none yet)."""
    admin = make_admin(stack.settings, client_id="test-commits")
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(f"{stack.prefix}.scheduler")
    finally:
        await admin.close()
    entry = offsets.get(tp)
    return -1 if entry is None else entry.offset


async def test_a_request_held_for_its_variant_does_not_hold_its_partitions_commit(
    pinned_stack: Stack,
) -> None:
    """Issue 37, N3: a request pinned to a variant no worker declares, without a deadline,
    waits for the unserved hold. Before, its record fixed its tier partition's commit
    position all that time, and 16,000 records later (here 64) the partition paused for
    every tenant. Now, once it has waited and lies far behind, it is written again at the
    partition's tail: the commit moves past it while it still waits, every other request
    is answered, and it still ends exactly once, `overloaded`, after the hold."""
    stack = pinned_stack
    started = time.monotonic()
    async with websockets.connect(stack.ws_url_as(EVALUATOR)) as held_ws:
        await held_ws.send(json.dumps({"type": "chat.request", **ask(20, "ghost")}))
        accepted = await recv_json(held_ws, 30)
        assert accepted["type"] == "chat.accepted", accepted
        request_id = accepted["request_id"]
        # On its tier partition once ingest has passed it on.
        while not (records := await tier_records(stack, request_id)):
            assert time.monotonic() < started + 30, "the held request never reached its tier"
            await asyncio.sleep(0.2)
        [(partition, offset, _)] = records
        tp = TopicPartition(stack.topics.tier(Tier.interactive), partition)

        # Others' traffic: enough that a few dozen records land behind it on its partition.
        flood = [ask(100 + i, None, max_tokens=2) for i in range(240)]
        async with websockets.connect(stack.ws_url_as(EVALUATOR)) as ws:
            answering = asyncio.create_task(run_requests(ws, flood, timeout=60))
            # Well inside the hold (before: not until the hold had answered it).
            deadline = started + UNSERVED_HOLD_S / 2
            while await committed(stack, tp) <= offset:
                assert time.monotonic() < deadline, "the commit did not move past the held record"
                await asyncio.sleep(0.2)
            answered = await answering
        ends = [t.final["type"] if t.final else None for t in answered.values()]
        assert ends == ["chat.done"] * len(flood)
        copies = await tier_records(stack, request_id)
        assert len(copies) >= 2
        assert all(p == partition for p, _, _ in copies)
        assert [body.get("requeued", 0) for _, _, body in copies] == list(range(len(copies)))

        final = await recv_json(held_ws, UNSERVED_HOLD_S + 30)
        while final["type"] not in ("chat.done", "error"):
            assert final.get("request_id") == request_id, final
            final = await recv_json(held_ws, UNSERVED_HOLD_S + 30)
    assert (final["type"], final.get("code")) == ("error", "overloaded"), final
    assert time.monotonic() - started >= UNSERVED_HOLD_S * 0.9


def tokenbus(stack: Stack, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """`tokenbus ARGS`, run as an operator would, against the stack's broker."""
    return stack.tokenbus(*args, timeout=timeout)


def test_eval_reports_the_unfaithful_variant_apart(pinned_stack: Stack, tmp_path: Path) -> None:
    stack = pinned_stack
    items = [{"id": f"q{i}", "prompt": f"question {i}", "max_tokens": 6} for i in range(ITEMS)]
    items[0]["reference"] = "not what any sim says"
    path = tmp_path / "set.jsonl"
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    out = tmp_path / "report"
    variants = "baseline,same,wrong"
    done = tokenbus(stack, "eval", "--set", str(path), "--variants", variants, "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert f"[{3 * ITEMS}/{3 * ITEMS}]" in done.stderr  # progress, one line per answer
    assert "report: " in done.stdout
    report = json.loads((out / "report.json").read_text())
    assert (report["model"], report["reference_variant"]) == (MODEL, "baseline")
    # Every answer came from the variant it was pinned to.
    for item in report["items"]:
        for variant, answer in item["answers"].items():
            assert answer["answered_by"] == variant, item
            assert answer["text"], item
    summary = {s["variant"]: s for s in report["summary"]}
    assert all(s["answered"] == ITEMS and s["failed"] == 0 for s in summary.values())
    same = summary["same"]["against_reference_variant"]
    wrong = summary["wrong"]["against_reference_variant"]
    assert (same["compared"], same["exact_share"], same["quality"]) == (ITEMS, 1.0, 1.0)
    # Half the prompts, by a hash: 40 items, standard deviation 0.08; 3.5 either side.
    assert 0.2 <= wrong["exact_share"] <= 0.8, wrong
    assert wrong["quality"] == wrong["exact_share"]  # greedy items: quality is exact match
    assert wrong["rouge_l"] < same["rouge_l"]
    differing = report["most_different"]
    assert differing
    assert {d["variant"] for d in differing} == {"wrong"}
    assert summary["baseline"]["against_expected"]["compared"] == 1
    text = (out / "report.md").read_text()
    assert "## Where the candidates differ from baseline most" in text
    assert f"| {differing[0]['id']} | wrong |" in text

    # A variant with no live worker is refused before anything is sent.
    ghost = tokenbus(stack, "eval", "--set", str(path), "--variants", "baseline,ghost")
    assert ghost.returncode == 2
    assert "'ghost' is not a variant of 'm' with a live worker" in ghost.stderr
    assert len(ghost.stderr.strip().splitlines()) == 1


def long_prompt() -> str:
    """A prompt whose greedy sim answer is at least 100 tokens (0.5 s at the stack's 200
    tokens/s)."""
    return next(
        p
        for i in range(1000)
        if len(natural_tokens(p := f"a long one {i}", temperature=0.0)) >= 100
    )


def test_an_item_past_its_timeout_is_reported_failed_and_the_run_goes_on(
    pinned_stack: Stack, tmp_path: Path
) -> None:
    path = tmp_path / "set.jsonl"
    item = {"id": "long", "prompt": long_prompt(), "max_tokens": 200}
    path.write_text(json.dumps(item) + "\n")
    out = tmp_path / "report"
    args = ["--set", str(path), "--variants", "baseline,same", "--timeout", "0.2"]
    done = tokenbus(pinned_stack, "eval", *args, "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "long on same: failed: " in done.stderr
    report = json.loads((out / "report.json").read_text())
    [long] = report["items"]
    for answer in long["answers"].values():
        assert answer["text"] is None
        assert answer["error"].startswith(("timeout: no answer within 0.2 s", "deadline_exceeded"))
    assert [(s["answered"], s["failed"]) for s in report["summary"]] == [(0, 1), (0, 1)]
    assert "*no answer: " in (out / "report.md").read_text()
