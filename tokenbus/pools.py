"""`tokenbus up --workers model=N,…`: the warm pool of each model, the workers `up` keeps running.

Each worker of a pool serves its model from start to exit (a worker never changes model:
`TOKENBUS_WORKER_MODEL` is read once, at start); `up` restarts one that exits. Every
service is told the pools' models (`TOKENBUS_SERVED_MODELS`), so a request for a model
whose workers are all restarting is held, not refused as unknown (docs/lifecycle.md).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

# What a model name may be on the command line (the names workers advertise).
MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}$")
# Above this a typo ("sim=100") is likelier than a wish: each worker is a process.
MAX_PER_MODEL = 32


@dataclass(frozen=True)
class PoolWorker:
    """One worker `up` runs: its key in `up`'s output, the model it serves, its number."""

    key: str
    model: str
    index: int  # 1, 2, … within its pool


def parse_pools(text: str) -> dict[str, int]:
    """`big=2,small=1` -> {"big": 2, "small": 1}; argparse shows the error of a bad one."""
    pools: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",")):
        model, sep, count = part.partition("=")
        model = model.strip()
        if not sep or not MODEL_NAME.match(model):
            raise argparse.ArgumentTypeError(
                f"{part!r}: expected MODEL=N (a model name, then how many workers serve it)"
            )
        if model in pools:
            raise argparse.ArgumentTypeError(f"model {model} is named twice")
        try:
            n = int(count)
        except ValueError:
            n = 0
        if not 1 <= n <= MAX_PER_MODEL:
            raise argparse.ArgumentTypeError(
                f"{part!r}: the workers of a model are a whole number from 1 to {MAX_PER_MODEL}"
            )
        pools[model] = n
    return pools


def pool_workers(pools: Mapping[str, int]) -> list[PoolWorker]:
    """Every worker of every pool, in order: `worker-big-1`, `worker-big-2`, `worker-small-1`."""
    return [
        PoolWorker(f"worker-{model}-{i}", model, i)
        for model, count in pools.items()
        for i in range(1, count + 1)
    ]


def served_models_env(pools: Mapping[str, int]) -> dict[str, str]:
    """The variable that tells every service the pools' models."""
    return {"TOKENBUS_SERVED_MODELS": json.dumps(list(pools))}
