"""What a test run starts that costs time (stacks, JVM nodes, model loads), counted for
`make test`'s closing table (deploy/test_report.py).

Each start appends one JSON line to the file `TOKENBUS_TEST_LEDGER` names (deploy/test.sh
sets it; unset, nothing is written). A line per start, appended with O_APPEND, so the
services' environment, vLLM's and any subprocess a test runs (the launcher's CLI, `tokenbus
up`) add to one file without a lock. Stdlib only: deploy/kafka/launcher.py counts its
nodes here.
"""

from __future__ import annotations

import json
import os
import time

LEDGER_ENV = "TOKENBUS_TEST_LEDGER"
# The kinds counted: a tests/stack.py stack, one JVM Kafka node, a model loaded by vLLM or
# by the transformers engine (in a worker process or in the test's own).
STACK, JVM_NODE, VLLM_LOAD, TRANSFORMERS_LOAD = "stack", "jvm_node", "vllm_load", "hf_load"


def note(kind: str, count: int = 1, where: str = "") -> None:
    """Count `count` starts of `kind` (`where`: the test or fixture, for the reader)."""
    path = os.environ.get(LEDGER_ENV)
    if not path or count <= 0:
        return
    line = json.dumps({"kind": kind, "count": count, "where": where, "at": time.time()})
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def engine_load(engine: str | None) -> str | None:
    """The ledger kind of a worker started with `TOKENBUS_WORKER_ENGINE=engine`; None for
    the sim, which loads nothing."""
    return {"vllm": VLLM_LOAD, "transformers": TRANSFORMERS_LOAD}.get(engine or "")
