"""Worker settings (`TOKENBUS_WORKER_*`)."""

from __future__ import annotations

import os
import socket

from pydantic import Field

from shared.settings import TokenbusSettings


def _default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class WorkerSettings(TokenbusSettings):
    worker_id: str = Field(default_factory=_default_worker_id)
    worker_engine: str = Field(default="sim", pattern="^(sim|vllm|transformers)$")
    worker_model: str = Field(default="sim-8b", description="Model name in heartbeats.")
    worker_sim_token_rate: float = Field(default=50.0, gt=0, description="sim: tokens/s/seq.")
    worker_max_num_seqs: int = Field(default=64, ge=1, description="Sequences run at once.")
    worker_flush_ms: float = Field(default=20.0, gt=0, description="Longest a token waits.")
    worker_flush_tokens: int = Field(default=16, ge=1, description="Send a chunk at this size.")
