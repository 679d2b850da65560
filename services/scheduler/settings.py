"""Scheduler settings (`TOKENBUS_SCHEDULER_*`)."""

from __future__ import annotations

from pydantic import Field

from shared.settings import TokenbusSettings


class SchedulerSettings(TokenbusSettings):
    scheduler_interactive_max_batch_size: int = Field(default=16, ge=1)
    scheduler_interactive_max_wait_ms: float = Field(default=10.0, ge=0)
    scheduler_background_max_batch_size: int = Field(default=32, ge=1)
    scheduler_background_max_wait_ms: float = Field(default=200.0, ge=0)
