"""Edge settings (`TOKENBUS_EDGE_*`)."""

from __future__ import annotations

from pydantic import Field, SecretStr

from shared.messages import RequestLimits
from shared.settings import TokenbusSettings


class EdgeSettings(TokenbusSettings):
    edge_host: str = Field(default="127.0.0.1")
    edge_port: int = Field(default=8000, ge=0, le=65535)
    edge_result_partition: int = Field(
        default=0, ge=0, description="Partition of the results topic this edge owns."
    )
    edge_max_frame_bytes: int = Field(
        default=1 << 20, ge=1024, description="Largest frame answered; above it: invalid_request."
    )
    resume_secret: SecretStr | None = Field(
        default=None, description="HMAC key of resume tokens; the same on every edge."
    )
    edge_resume_ttl_s: float = Field(default=600.0, gt=0)

    def limits(self) -> RequestLimits:
        return RequestLimits(
            max_tokens_cap=self.max_tokens_cap,
            default_max_tokens=self.default_max_tokens,
            max_prompt_chars=self.max_prompt_chars,
        )
