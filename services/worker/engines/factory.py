"""Builds the engine the settings name."""

from __future__ import annotations

from services.worker.engines.base import Engine
from services.worker.engines.sim import SimEngine, SimProfile
from services.worker.settings import WorkerSettings


def build_engine(settings: WorkerSettings) -> Engine:
    if settings.worker_engine == "sim":
        return SimEngine(
            SimProfile(
                token_rate=settings.worker_sim_token_rate,
                max_num_seqs=settings.worker_max_num_seqs,
            )
        )
    raise ValueError(f"engine {settings.worker_engine!r} is not available in this build")
