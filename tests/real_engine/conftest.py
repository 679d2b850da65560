"""The real-engine suite: vLLM's CPU build and the transformers engine serve a real model.

It runs in the vLLM worker's own environment (deploy/vllm/install.sh), where vLLM imports,
as `make test` runs it (deploy/test.sh); the services' `.venv` has no vLLM, and
tests/conftest.py leaves this folder out of a run there. `prepare()` finds the environment
and the model that `make test` made before (cached by version); on a machine without them
it makes them, which takes minutes. `embedding_url`: the same model as an embedding model on
vLLM's own server, for the tests of shadow and eval scores with an embedding similarity.
`bus`: the suite's one stack of real-engine workers.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from deploy import test_ledger
from tests.stack import Stack, free_port, new_prefix, wait_until
from tokenbus.local_engine import KV_CACHE_GIB, MODEL_NAME, LocalEngine, prepare

EMBEDDER = "smollm2-embed"  # the embedding model's name at its server
LOAD_TIMEOUT_S = 300.0


# The suite's stack (`bus`): its workers and the models they serve.
VLLM_WORKERS = ("vllm-a", "vllm-b")
FP32, FP32_WORKER = "fp32", "vllm-fp32"  # a variant of the model: float32, not bfloat16
HF = "smollm2-hf"
HF_STATIC = "smollm2-hf-static"
# Loading a model takes 30-90 s per worker on 2 cores, five at once.
BUS_LOAD_TIMEOUT_S = 420.0
ENDS_THE_BUS = "ends_the_bus"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that ends a worker of the suite's `bus` runs after every other test."""
    items.sort(key=lambda item: item.get_closest_marker(ENDS_THE_BUS) is not None)  # stable


@pytest.fixture(scope="session")
def local_engine() -> LocalEngine:
    if importlib.util.find_spec("vllm") is None:
        pytest.fail(
            f"{sys.executable} has no vLLM: run this suite with the vLLM worker's Python"
            " (`make test` does; deploy/vllm/install.sh prints its path)",
            pytrace=False,
        )
    engine = prepare()
    return engine


@pytest.fixture(scope="session")
def embedding_url(local_engine: LocalEngine, log_dir: Path) -> Iterator[str]:
    """vLLM's OpenAI server with SmolLM2 converted to an embedding model (its last token's
    hidden state, normalised), float32 (eager bf16 meets ADR 0062's kernel)."""
    port = free_port()
    command = [
        str(local_engine.python), "-m", "vllm.entrypoints.openai.api_server",
        "--host", "127.0.0.1", "--port", str(port),
        "--model", str(local_engine.model_path), "--served-model-name", EMBEDDER,
        "--runner", "pooling", "--convert", "embed",
        "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB)}
    test_ledger.note(test_ledger.VLLM_LOAD, where="embedding server")
    with open(log_dir / "embedding-server.log", "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while not answers(f"{base}/v1/models"):
            assert process.poll() is None, f"vLLM's embedding server exited ({process.returncode})"
            assert time.monotonic() < deadline, f"{base} did not answer in {LOAD_TIMEOUT_S} s"
            time.sleep(1.0)
        yield f"{base}/v1"
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture(scope="session")
def bus(bootstrap: str, log_dir: Path, local_engine: LocalEngine) -> Iterator[Stack]:
    """The suite's stack (issue 36: one stack and one load of each worker for the session):
    two vLLM workers, the `fp32` variant's, a continuous and a static transformers worker,
    all on SmolLM2. tests/real_engine/test_bus.py and test_clients.py ask for it; a test
    marked `ends_the_bus` (the kill -9 of a vLLM worker) runs last of the session."""
    # An engine holding work silent for 10 s is taken for hung (the stopped engine core's
    # test, test_bus.py): far above this model's prefills here, far below the edge's 60 s.
    workers = {
        key: {
            **local_engine.worker_env("vllm"),
            "TOKENBUS_WORKER_ID": key,
            "TOKENBUS_WORKER_ENGINE_STALL_S": "10",
        }
        for key in VLLM_WORKERS
    }
    workers[FP32_WORKER] = {
        **local_engine.worker_env("vllm"),
        "TOKENBUS_WORKER_ID": FP32_WORKER,
        "TOKENBUS_WORKER_VARIANT": FP32,
        "TOKENBUS_WORKER_DTYPE": "float32",
    }
    workers["hf"] = {
        **local_engine.worker_env("transformers", model=HF, max_num_seqs=4),
        "TOKENBUS_WORKER_ID": "hf",
    }
    workers["hf-static"] = {
        **local_engine.worker_env(
            "transformers", model=HF_STATIC, max_num_seqs=4, batch_mode="static"
        ),
        "TOKENBUS_WORKER_ID": "hf-static",
    }
    stack = Stack(
        bootstrap=bootstrap,
        prefix=new_prefix(),
        log_dir=log_dir,
        workers=workers,
        env_overrides={
            "TOKENBUS_EDGE_DISCONNECT_GRACE_S": "3",
            "TOKENBUS_LOG_FORMAT": "json",
            "TOKENBUS_EDGE_BATCH_RUNNER": "true",  # test_bus.py runs a batch on the model
        },
    )
    try:
        stack.start()
        # While vLLM loads (half a minute or more here), each vLLM worker's /healthz
        # answers (its event loop is free) and /readyz says it is not ready yet. (The
        # transformers workers load before their loop starts, in a second or two.)
        alive_while_loading: set[str] = set()

        def loaded() -> bool:
            for key in workers:
                if key not in alive_while_loading:
                    health, _ = stack.health(key, "/healthz")
                    ready, body = stack.health(key, "/readyz")
                    if health == 200 and ready == 503 and body.get("reason") == "starting":
                        alive_while_loading.add(key)
            return {MODEL_NAME, HF, HF_STATIC} <= set(served(stack)) and all(
                stack.health(k, "/readyz")[0] == 200 for k in workers
            )

        wait_until(loaded, BUS_LOAD_TIMEOUT_S, "every worker's model loaded", interval=0.5)
        assert set(VLLM_WORKERS) <= alive_while_loading, "/healthz went silent as vLLM loaded"
        yield stack
    finally:
        stack.stop()


def served(stack: Stack) -> dict[str, dict[str, Any]]:
    client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key=stack.keys["default"])
    try:
        return {m.id: m.model_dump() for m in client.models.list()}
    except openai.APIConnectionError:
        return {}
