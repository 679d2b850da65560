"""Ingest settings: the shared ones; limits come from `TokenbusSettings`."""

from __future__ import annotations

from pydantic import Field

from shared.messages import RequestLimits
from shared.settings import TokenbusSettings


class IngestSettings(TokenbusSettings):
    ingest_dedupe_window: int = Field(default=100_000, ge=1, description="Request ids remembered.")

    def limits(self) -> RequestLimits:
        # Ingest also refuses a request no tier's batch could ever carry.
        return super().limits().model_copy(update={"max_request_tokens": self.largest_token_budget})
