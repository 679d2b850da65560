"""A stack for shadow validation's tests: one model with three sim workers, the baseline
(the gold), a faithful variant `good` and a variant `bad` that answers a share of its
prompts wrongly; and the rollout that gives both variants a share, every answer of theirs
run again on the baseline. Used by tests/test_shadow_stack.py and, with an embedding model
on the gold, tests/real_engine/test_embedding_shadow.py."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from shared.kafka import encode, make_producer
from shared.variants import ModelRollout, Shadow, Variant
from tests.stack import Stack, new_prefix, wait_until

MODEL = "m"
GOOD, BAD = "good", "bad"
WRONG_SHARE = 0.5


@contextmanager
def shadow_stack(
    bootstrap: str, log_dir: Path, gold_env: Mapping[str, str] | None = None
) -> Iterator[Stack]:
    """The three workers' stack, started and heard (`gold_env`: the baseline's extra
    settings), stopped on exit."""
    stack = Stack(
        bootstrap=bootstrap,
        prefix=new_prefix(),
        log_dir=log_dir,
        env_overrides={
            "TOKENBUS_WORKER_MODEL": MODEL,
            # These tests tell the variants apart by what `chat.done` names (issue 37, N7).
            "TOKENBUS_EDGE_NAME_VARIANTS": "true",
            # Judge only: these tests watch the scores, not what the canary judge does.
            "TOKENBUS_SCHEDULER_CANARY_ROLLBACK": "false",
        },
        workers={
            "worker": {"TOKENBUS_WORKER_ID": "worker", **(gold_env or {})},
            "worker-good": {
                "TOKENBUS_WORKER_ID": "worker-good",
                "TOKENBUS_WORKER_BATCH_PARTITION": "1",
                "TOKENBUS_WORKER_VARIANT": GOOD,
            },
            "worker-bad": {
                "TOKENBUS_WORKER_ID": "worker-bad",
                "TOKENBUS_WORKER_BATCH_PARTITION": "2",
                "TOKENBUS_WORKER_VARIANT": BAD,
                "TOKENBUS_WORKER_SIM_WRONG_SHARE": str(WRONG_SHARE),
            },
        },
    )
    try:
        stack.start()
        want = {"worker", "worker-good", "worker-bad"}
        wait_until(lambda: stack.workers_heard() == want, 60, "the three workers")
        yield stack
    finally:
        stack.stop()


def scheduler_metric(stack: Stack, name: str, variant: str) -> float | None:
    """A per-variant metric of the model on the scheduler's /metrics; None: not there."""
    pattern = rf'^{name}\{{model="{MODEL}",variant="{variant}"\}} (\S+)$'
    try:
        found = re.search(pattern, stack.metrics("scheduler"), re.MULTILINE)
    except OSError:
        return None
    return None if found is None else float(found.group(1))


async def roll_out(stack: Stack) -> None:
    """The variants' shares, written as `tokenbus models rollout` would (its promotion
    checks aside), with shadow validation at 100 % on the baseline; returns once the
    scheduler routes by them."""
    rollout = ModelRollout(
        model=MODEL,
        variants=[Variant(name=GOOD, percent=40.0), Variant(name=BAD, percent=40.0)],
        shadow=Shadow(gold="baseline", percent=100.0),
    )
    producer = make_producer(stack.settings, "shadow-test")
    await producer.start()
    try:
        await producer.send_and_wait(stack.topics.variants, encode(rollout), key=MODEL.encode())
    finally:
        await producer.stop()

    def routed() -> bool:
        return scheduler_metric(stack, "tokenbus_scheduler_variant_share_percent", BAD) == 40

    await asyncio.to_thread(wait_until, routed, 30, "the scheduler routing by the rollout")
