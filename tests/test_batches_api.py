"""The Batch API through the official `openai` SDK, as its docs show it (issue 39 items 2-3,
ADR 0075), on the session's shared stack with two edges of its own that run batches: a
batch of either endpoint runs to `completed` and its output file answers every `custom_id`
once; a runner killed -9 mid-batch is taken over and nothing is lost or answered twice;
another tenant gets 404; a cancel stops one batch and leaves another whole; bad input is
refused with OpenAI's errors."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from openai.types import Batch

from bench.ports import free_port
from services.edge.openai.batch_lines import Checked, check_lines
from shared.messages import RequestLimits
from tests.chat_client import openai_sdk
from tests.stack import Stack, wait_until
from tests.test_files_api import batch_file

OWNER, OTHER = "batch-owner", "batch-other"  # tests/tenants.py
RUNNERS = ("edge-batch-a", "edge-batch-b")
RUNNER_ENV = {
    "TOKENBUS_EDGE_BATCH_RUNNER": "true",
    "TOKENBUS_EDGE_BATCH_WINDOW": "16",
    "TOKENBUS_KAFKA_SESSION_TIMEOUT_MS": "6000",  # a killed runner's partitions move soon
}
ENDED = ("completed", "failed", "expired", "cancelled")
TOKENBUS = str(Path(sys.executable).parent / "tokenbus")  # the venv's command line


@dataclass
class Runners:
    stack: Stack
    ports: dict[str, int]

    def sdk(self, tenant: str = OWNER, key: str = RUNNERS[0]) -> openai.OpenAI:
        return openai_sdk(self.stack, tenant, port=self.ports[key])

    def start(self, key: str) -> None:
        """Start the edge `key`; started again (after a kill), on the port it had."""
        port = self.ports.get(key) or free_port()
        self.stack.start_service("edge", key=key, TOKENBUS_EDGE_PORT=str(port), **RUNNER_ENV)
        wait_until(lambda: self.stack.edge_ready(port), 60, f"{key}'s /readyz")
        self.ports[key] = port


@pytest.fixture(scope="module")
def runners(stack: Stack) -> Iterator[Runners]:
    found = Runners(stack, {})
    try:
        for key in RUNNERS:
            found.start(key)
        yield found
    finally:
        for key in RUNNERS:
            if key in stack.processes:
                stack.stop_service(key)
                stack.processes.pop(key)
                stack.health_ports.pop(key, None)


def wait_ended(client: openai.OpenAI, batch_id: str, timeout: float = 180) -> Batch:
    found: list[Batch] = []

    def ended() -> bool:
        found[:] = [client.batches.retrieve(batch_id)]
        return found[0].status in ENDED

    wait_until(ended, timeout, f"batch {batch_id} ended", interval=0.5)
    return found[0]


def ran(stack: Stack, key: str, batch_id: str) -> bool:
    """Whether the edge started under `key` has run (a part of) the batch."""
    return any(
        "batch.run" in line and batch_id in line for line in stack.log(key).read_text().splitlines()
    )


def ran_last(stack: Stack, keys: Sequence[str], batch_id: str) -> str | None:
    """The edge (of `keys`) that started running the batch last: a rebalance may have moved
    it since the first (its log says `batch.run`; each line starts with its ISO time)."""
    last: tuple[str, str] | None = None
    for key in keys:
        for line in stack.log(key).read_text().splitlines():
            if "batch.run" in line and batch_id in line and (last is None or line > last[1]):
                last = (key, line)
    return None if last is None else last[0]


def metric(text: str, name: str) -> float:
    """The value of the sample `name` (with its labels) in a /metrics text; 0 if absent."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict[str, object]]:
    if file_id is None:
        return []
    text = client.files.content(file_id).read().decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_a_batch_runs_to_completed_and_answers_every_custom_id_once(
    runners: Runners, endpoint: str
) -> None:
    client = runners.sdk()
    uploaded = client.files.create(file=("in.jsonl", batch_file(40, url=endpoint)), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint=endpoint,  # type: ignore[arg-type]
        completion_window="24h",
        metadata={"job": "nightly"},
    )
    assert (batch.object, batch.status, batch.endpoint) == ("batch", "validating", endpoint)
    assert batch.metadata == {"job": "nightly"}
    done = wait_ended(runners.sdk(key=RUNNERS[1]), batch.id)  # either edge shows it
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed) == (40, 40)
    assert done.request_counts.failed == 0
    assert done.error_file_id is None
    assert done.completed_at
    assert done.in_progress_at
    assert done.finalizing_at
    output = lines_of(client, done.output_file_id)
    assert sorted(str(line["custom_id"]) for line in output) == sorted(
        f"req-{i}" for i in range(40)
    )
    for line in output:
        response = line["response"]
        assert isinstance(response, dict)
        assert response["status_code"] == 200
        body = response["body"]
        assert body["object"] == ("chat.completion" if "chat" in endpoint else "text_completion")
        choice = body["choices"][0]
        assert choice["message"]["content"] if "chat" in endpoint else choice["text"]
        assert body["usage"]["completion_tokens"] <= 8
    assert done.output_file_id is not None
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    ok = sum(
        metric(runners.stack.edge_metrics(k), 'tokenbus_edge_batch_lines_total{outcome="ok"}')
        for k in RUNNERS
    )
    assert ok >= 40
    # Each line went on the bus as a background request naming its batch and custom_id.
    asked = [json.loads(v) for v in asyncio.run(runners.stack.read_requests())]
    mine = [r for r in asked if (r.get("batch_line") or {}).get("batch_id") == batch.id]
    assert {r["batch_line"]["custom_id"] for r in mine} == {f"req-{i}" for i in range(40)}
    assert {r["priority"] for r in mine} == {"background"}
    assert batch.id in [b.id for b in client.batches.list()]


def test_a_runner_killed_mid_batch_is_taken_over_and_nothing_is_answered_twice(
    runners: Runners,
) -> None:
    """kill -9 of the edge running the batch: the other edge runs it on from the outcomes on
    the bus; every custom_id is in the output once and the counts equal its lines."""
    client = runners.sdk(key=RUNNERS[1])
    lines = 300
    content = batch_file(lines)
    uploaded = client.files.create(file=("big.jsonl", content), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )

    def running_on() -> str | None:
        return ran_last(runners.stack, RUNNERS, batch.id)

    wait_until(lambda: running_on() is not None, 60, "a runner took the batch")

    def some_done() -> bool:
        counts = client.batches.retrieve(batch.id).request_counts
        return counts is not None and counts.completed >= 30

    wait_until(some_done, 120, "30 lines answered", interval=0.2)
    victim = running_on()
    assert victim is not None
    # Its progress on the running edge's /metrics, for the dashboard's "Batch progress".
    gauge = f'tokenbus_edge_batch_progress{{batch_id="{batch.id}",state="total"}} {lines}.0'
    assert gauge in runners.stack.edge_metrics(victim)
    survivor = next(k for k in RUNNERS if k != victim)
    runners.stack.stop_service(victim, signal.SIGKILL)
    try:
        done = wait_ended(runners.sdk(key=survivor), batch.id, timeout=240)
    finally:
        runners.stack.processes.pop(victim)
        runners.start(victim)  # for the module's later tests
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed) == (lines, lines)
    output = lines_of(runners.sdk(key=survivor), done.output_file_id)
    ids = [str(line["custom_id"]) for line in output]
    assert len(ids) == lines
    assert set(ids) == {f"req-{i}" for i in range(lines)}
    assert done.error_file_id is None
    assert ran(runners.stack, survivor, batch.id)


def test_another_tenant_gets_404_on_the_batch(runners: Runners) -> None:
    client = runners.sdk()
    uploaded = client.files.create(file=("in.jsonl", batch_file(2)), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    other = runners.sdk(OTHER, key=RUNNERS[1])
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.cancel(batch.id)
    assert batch.id not in [b.id for b in other.batches.list()]
    with pytest.raises(openai.NotFoundError):  # nor can it run the owner's file
        other.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    done = wait_ended(client, batch.id)
    assert done.output_file_id is not None
    with pytest.raises(openai.NotFoundError):
        other.files.content(done.output_file_id)


def test_a_cancel_stops_one_batch_and_leaves_another_whole(runners: Runners) -> None:
    client = runners.sdk()
    body = batch_file(200)
    first = client.files.create(file=("a.jsonl", body), purpose="batch")
    second = client.files.create(file=("b.jsonl", body), purpose="batch")
    doomed = client.batches.create(
        input_file_id=first.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    kept = client.batches.create(
        input_file_id=second.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    cancelling = client.batches.cancel(doomed.id)
    assert cancelling.status == "cancelling"
    assert cancelling.cancelling_at
    cancelled = wait_ended(client, doomed.id)
    assert cancelled.status == "cancelled"
    assert cancelled.cancelled_at
    counts = cancelled.request_counts
    assert counts is not None
    assert counts.completed + counts.failed < 200
    done = wait_ended(client, kept.id)
    assert done.status == "completed"
    assert done.request_counts is not None
    assert done.request_counts.completed == 200
    assert len(lines_of(client, done.output_file_id)) == 200
    assert client.batches.cancel(doomed.id).status == "cancelled"  # again: the same answer
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(kept.id)
    # The same file in a new batch runs whole: the old cancel names only its own batch.
    again = client.batches.create(
        input_file_id=first.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert wait_ended(client, again.id).status == "completed"


def test_bad_input_gets_openai_errors_and_nothing_is_created(runners: Runners) -> None:
    client = runners.sdk()
    uploaded = client.files.create(file=("in.jsonl", batch_file(2)), purpose="batch")
    before = [b.id for b in client.batches.list()]
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/embeddings",
            completion_window="24h",
        )
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="48h",  # type: ignore[arg-type]
        )
    with pytest.raises(openai.NotFoundError, match="No such File"):
        client.batches.create(
            input_file_id="file-nothing", endpoint="/v1/chat/completions", completion_window="24h"
        )
    with pytest.raises(openai.NotFoundError, match="No such Batch"):
        client.batches.retrieve("batch_nothing")
    assert [b.id for b in client.batches.list()] == before
    # A line whose url is not the batch's endpoint is that line's error, not the batch's.
    mixed = client.files.create(
        file=(
            "mixed.jsonl",
            batch_file(2) + batch_file(1, url="/v1/completions").replace(b"req-0", b"text-0"),
        ),
        purpose="batch",
    )
    batch = client.batches.create(
        input_file_id=mixed.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_ended(client, batch.id)
    assert done.status == "completed"
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 1)
    (error,) = lines_of(client, done.error_file_id)
    assert error["custom_id"] == "text-0"
    response = error["response"]
    assert isinstance(response, dict)
    assert response["status_code"] == 400
    # An output file is no batch's input.
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.batches.create(
            input_file_id=str(done.output_file_id),
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )


def test_the_cli_submits_follows_and_downloads_a_batch(runners: Runners, tmp_path: Path) -> None:
    """`tokenbus batch submit FILE`, as a person without code runs it: progress until done,
    then the output file beside it; status, list, download and a refused cancel."""
    source = tmp_path / "requests.jsonl"
    source.write_bytes(batch_file(12))
    base = ["--base-url", f"http://127.0.0.1:{runners.ports[RUNNERS[0]]}/v1"]
    env = {**os.environ, "OPENAI_API_KEY": runners.stack.keys[OWNER]}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [TOKENBUS, "batch", *base, *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=180,
            check=False,
        )

    submitted = cli("submit", str(source), "--out", str(tmp_path / "out"))
    assert submitted.returncode == 0, submitted.stderr
    assert "12/12 (0 failed) completed" in submitted.stderr
    batch = json.loads(submitted.stdout)
    assert batch["status"] == "completed"
    written = tmp_path / "out" / f"{batch['id']}_output.jsonl"
    ids = [json.loads(line)["custom_id"] for line in written.read_text().splitlines()]
    assert sorted(ids) == sorted(f"req-{i}" for i in range(12))

    status = cli("status", batch["id"])
    assert json.loads(status.stdout)["request_counts"]["completed"] == 12
    assert batch["id"] in cli("list").stdout
    again = cli("download", batch["id"], "--out", str(tmp_path / "again"))
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "again" / written.name).read_bytes() == written.read_bytes()
    refused = cli("cancel", batch["id"])
    assert refused.returncode == 1
    assert "Cannot cancel a batch with status 'completed'" in refused.stderr
    missing = cli("status", "batch_0")
    assert (missing.returncode, "No such Batch object" in missing.stderr) == (1, True)


def test_batch_tokens_per_day_holds_across_edges_and_apart_from_interactive_limits(
    runners: Runners,
) -> None:
    """The tenant's batch quota (300 tokens a day, tests/tenants.py) counts each batch's
    input when it is created, from the batches on the bus: two small batches through one
    edge fill it, a third through the other edge is 429 with a retry hint, a file larger
    than the whole allowance is 400, and the tenant's chat is not charged for any of it."""
    content = batch_file(2)
    checked = check_lines(io.BytesIO(content), RequestLimits())
    assert isinstance(checked, Checked)
    assert 2 * checked.tokens <= 300 < 3 * checked.tokens  # the quota holds two
    first, second = runners.sdk("batch-quota"), runners.sdk("batch-quota", key=RUNNERS[1])
    file = first.files.create(file=("in.jsonl", content), purpose="batch")
    for client in (first, first):
        client.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    with pytest.raises(openai.RateLimitError, match="batch_tokens_per_day") as refused:
        second.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    assert int(refused.value.response.headers["retry-after-ms"]) > 3600 * 1000
    big = first.files.create(file=("big.jsonl", batch_file(10)), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="whole allowance"):
        second.batches.create(
            input_file_id=big.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    answer = second.chat.completions.create(
        model="sim-8b", messages=[{"role": "user", "content": "still here"}], max_tokens=4
    )
    assert answer.choices[0].message.content
