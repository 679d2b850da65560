"""The real-engine suite: vLLM's CPU build and the transformers engine serve a real model.

It runs in the vLLM worker's own environment (deploy/vllm/install.sh), where vLLM imports,
as `make test` runs it (deploy/test.sh); the services' `.venv` has no vLLM, and
tests/conftest.py leaves this folder out of a run there. `prepare()` finds the environment
and the model that `make test` made before (cached by version); on a machine without them
it makes them, which takes minutes. `embedding_url`: the same model as an embedding model on
vLLM's own server, for the tests of shadow and eval scores with an embedding similarity.
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

import pytest

from deploy import test_ledger
from tests.stack import free_port
from tokenbus.local_engine import KV_CACHE_GIB, LocalEngine, prepare

EMBEDDER = "smollm2-embed"  # the embedding model's name at its server
LOAD_TIMEOUT_S = 300.0


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
