"""Any Kafka client can ask: a record written with kcat gets its whole answer on its reply_to."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
import uuid

from services.worker.engines.sim_text import complete
from shared.kafka import create_topics
from tests.stack import Stack


def kcat(*args: str, stdin: bytes | None = None, timeout: float = 30) -> bytes:
    exe = shutil.which("kcat")
    assert exe, "kcat is missing: `make test` installs it (apt-get install kcat)"
    done = subprocess.run(
        [exe, *args], input=stdin, capture_output=True, timeout=timeout, check=True
    )
    return done.stdout


def test_kcat_request_gets_its_full_result_on_reply_to(stack: Stack) -> None:
    reply_topic = f"{stack.prefix}.my-app-replies"
    asyncio.run(create_topics(stack.settings, {reply_topic: 1}))
    request_id = "kcat-" + uuid.uuid4().hex[:8]
    record = {
        "request_id": request_id,
        "prompt": "written by kcat",
        "max_tokens": 12,
        "priority": "background",
        "reply_to": {"topic": reply_topic},
    }
    # The README's example: key = request_id, value = the JSON request, on one line.
    kcat(
        "-P",
        "-b",
        stack.bootstrap,
        "-t",
        stack.topics.requests,
        "-K",
        "\t",
        stdin=f"{request_id}\t{json.dumps(record)}\n".encode(),
    )

    results: list[dict[str, object]] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        out = kcat(
            "-C",
            "-b",
            stack.bootstrap,
            "-t",
            reply_topic,
            "-o",
            "beginning",
            "-e",
            "-q",
            "-f",
            "%s\n",
        )
        results = [json.loads(line) for line in out.decode().splitlines() if line.strip()]
        if results and results[-1]["kind"] in ("done", "error"):
            break
        time.sleep(0.2)  # poll interval between kcat reads, not a wait for an event
    assert results, "no result reached the reply_to topic"
    assert all(r["request_id"] == request_id for r in results)
    deltas = [r for r in results if r["kind"] == "delta"]
    assert [d["seq"] for d in deltas] == list(range(len(deltas)))
    plan = complete("written by kcat", 12)
    assert "".join(str(d["text"]) for d in deltas) == plan.text
    done = results[-1]
    assert done["kind"] == "done"
    assert done["usage"] == {"prompt_tokens": 3, "completion_tokens": 12}
