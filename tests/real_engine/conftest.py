"""The real-engine suite: vLLM's CPU build and the transformers engine serve a real model.

It runs in the vLLM worker's own environment (deploy/vllm/install.sh), where vLLM imports,
as `make test` runs it (deploy/test.sh); the services' `.venv` has no vLLM, and
tests/conftest.py leaves this folder out of a run there. `prepare()` finds the environment
and the model that `make test` made before (cached by version); on a machine without them
it makes them, which takes minutes.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tokenbus.local_engine import LocalEngine, prepare


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
