"""Ingest settings: the shared ones; limits come from `TokenbusSettings`."""

from __future__ import annotations

from pydantic import Field

from shared.messages import RequestLimits
from shared.settings import TokenbusSettings


class IngestSettings(TokenbusSettings):
    ingest_dedupe_window: int = Field(default=100_000, ge=1, description="Request ids remembered.")

    def limits(self) -> RequestLimits:
        return RequestLimits(
            max_tokens_cap=self.max_tokens_cap,
            default_max_tokens=self.default_max_tokens,
            max_prompt_chars=self.max_prompt_chars,
            max_request_tokens=self.largest_token_budget,
        )
