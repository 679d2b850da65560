"""A 2,000-line batch through every fault issue 39 names (ADR 0075), on the session's fault
stack and faultable broker: kill -9 of the edge running it, of ingest, of the scheduler and
of the worker, in turn, each started again as its supervisor would; then every process and
the broker stopped and started again. The batch completes; every `custom_id` is answered
exactly once across the output and error files; `request_counts` equal the files' lines.

Half the lines are greedy (temperature 0: they go through ingest, whose kill they meet);
the rest go straight to their tier (ADR 0041)."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator

import openai
import pytest

from bench.ports import free_port
from tests.chat_client import openai_sdk
from tests.conftest import FaultableBroker
from tests.stack import SERVICES, Stack, wait_until
from tests.test_batches_api import ran_last

pytestmark = pytest.mark.integration

LINES = 2000
RUNNERS = ("edge-batch-a", "edge-batch-b")
RUNNER_ENV = {"TOKENBUS_EDGE_BATCH_RUNNER": "true", "TOKENBUS_EDGE_BATCH_WINDOW": "64"}
# (what is killed -9, once this many lines are answered); "runner": the edge running it.
KILLS = (("runner", 200), ("ingest", 450), ("scheduler", 700), ("worker", 950))
RESTART_ALL_AT = 1200
ENDED = ("completed", "failed", "expired", "cancelled")


def batch_input() -> bytes:
    rows = []
    for i in range(LINES):
        body: dict[str, object] = {
            "model": "sim-8b",
            "max_tokens": 3,
            "messages": [{"role": "user", "content": f"durable line {i}"}],
        }
        if i % 2 == 0:
            body["temperature"] = 0
        rows.append(
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": body,
            }
        )
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


class Runners:
    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.ports: dict[str, int] = {}

    def start(self, key: str) -> None:
        port = self.ports.setdefault(key, free_port())
        self.stack.start_service("edge", key=key, TOKENBUS_EDGE_PORT=str(port), **RUNNER_ENV)

    def ready(self, key: str) -> bool:
        return self.stack.edge_ready(self.ports[key])

    def running(self, batch_id: str) -> str | None:
        """The runner edge that ran the batch last."""
        return ran_last(self.stack, RUNNERS, batch_id)


@pytest.fixture
def runners(fault_stack: Stack) -> Iterator[Runners]:
    found = Runners(fault_stack)
    try:
        for key in RUNNERS:
            found.start(key)
        for key in RUNNERS:
            wait_until(lambda k=key: found.ready(k), 120, f"{key}'s /readyz")
        yield found
    finally:
        for key in RUNNERS:
            if key in fault_stack.processes:
                fault_stack.stop_service(key)
                fault_stack.processes.pop(key)
                fault_stack.health_ports.pop(key, None)


def restart(stack: Stack, key: str, runners: Runners) -> None:
    """Start `key` again after its kill, as its supervisor would."""
    if key in RUNNERS:
        runners.start(key)
    elif key in stack.workers:
        stack.start_service("worker", key, **stack.workers[key])
    else:
        stack.start_service(key)


def test_a_batch_survives_a_kill_of_every_service_and_a_restart_of_everything(
    fault_stack: Stack, faultable_broker: FaultableBroker, runners: Runners
) -> None:
    stack = fault_stack
    client = openai_sdk(stack, "default", port=runners.ports[RUNNERS[0]])
    uploaded = client.files.create(file=("durable.jsonl", batch_input()), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )

    def answered() -> int:
        """Lines answered, as any live runner edge shows the batch."""
        for key in RUNNERS:
            if key in stack.processes and stack.processes[key].poll() is None:
                try:
                    sdk = openai_sdk(stack, "default", port=runners.ports[key])
                    counts = sdk.batches.retrieve(batch.id).request_counts
                except openai.APIError:
                    continue
                return 0 if counts is None else counts.completed + counts.failed
        return 0

    for what, at in KILLS:
        wait_until(lambda a=at: answered() >= a, 300, f"{at} lines answered", interval=0.5)
        key = runners.running(batch.id) if what == "runner" else what
        assert key is not None
        stack.stop_service(key, signal.SIGKILL)
        restart(stack, key, runners)

    wait_until(
        lambda: answered() >= RESTART_ALL_AT, 300, f"{RESTART_ALL_AT} answered", interval=0.5
    )
    for key in list(stack.processes):
        stack.stop_service(key, signal.SIGKILL)
    faultable_broker.stop()
    faultable_broker.start()
    for key in [*SERVICES, *RUNNERS]:
        if key != "worker":
            restart(stack, key, runners)
    for key in stack.workers:
        restart(stack, key, runners)
    for key in RUNNERS:
        wait_until(lambda k=key: runners.ready(k), 240, f"{key}'s /readyz after the restart")

    final = openai_sdk(stack, "default", port=runners.ports[RUNNERS[1]])

    def ended() -> bool:
        try:
            return final.batches.retrieve(batch.id).status in ENDED
        except openai.APIError:
            return False

    wait_until(ended, 600, "the batch ended", interval=1.0)
    done = final.batches.retrieve(batch.id)
    assert done.status == "completed", done
    counts = done.request_counts
    assert counts is not None
    lines = []
    for file_id in (done.output_file_id, done.error_file_id):
        if file_id is not None:
            text = final.files.content(file_id).read().decode()
            lines += [json.loads(line) for line in text.splitlines() if line.strip()]
    ids = [line["custom_id"] for line in lines]
    assert len(ids) == len(set(ids)) == LINES, "a custom_id answered twice, or not at all"
    assert set(ids) == {f"line-{i}" for i in range(LINES)}
    assert (counts.total, counts.completed + counts.failed) == (LINES, LINES)
    failed = [
        line for line in lines if line["response"] is None or line["response"]["status_code"] != 200
    ]
    assert counts.failed == len(failed)
    assert failed == [], f"{len(failed)} lines failed, the first: {failed[:1]}"
    # Nothing needed a hand restart beyond the ones the faults asked for: all still running.
    assert not {k: c for k, c in stack.exited().items() if c not in (0, -9, -15)}
