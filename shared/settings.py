"""Settings every service shares: where Kafka is, how topics are named, request limits."""

from __future__ import annotations

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.messages import RequestLimits


class TokenbusSettings(BaseSettings):
    """Base of every service's settings; read from `TOKENBUS_*` environment variables."""

    model_config = SettingsConfigDict(env_prefix="TOKENBUS_", extra="ignore")

    bootstrap_servers: str = Field(
        default="127.0.0.1:9092",
        validation_alias=AliasChoices("KAFKA_BOOTSTRAP_SERVERS", "TOKENBUS_BOOTSTRAP_SERVERS"),
        description="Kafka bootstrap servers (KAFKA_BOOTSTRAP_SERVERS wins).",
    )
    topic_prefix: str = Field(
        default="tokenbus",
        pattern=r"^[A-Za-z0-9._-]{1,100}$",
        description="First part of every topic name; tests use their own to stay isolated.",
    )
    fetch_max_wait_ms: int = Field(
        default=10, ge=1, le=500, description="Longest a consumer fetch waits at the broker."
    )
    max_tokens_cap: int = Field(default=4096, ge=1, description="Largest max_tokens accepted.")
    default_max_tokens: int = Field(
        default=256, ge=1, description="max_tokens of a request that names none."
    )
    max_prompt_chars: int = Field(
        default=65536, ge=1, description="Largest prompt (all message contents together)."
    )
    log_level: str = Field(default="INFO", description="DEBUG, INFO, WARNING or ERROR.")
    # Token budgets per tier (prompt tokens + max_tokens per batch): the scheduler forms
    # batches within them, ingest refuses a request no batch could ever hold.
    scheduler_interactive_max_batch_tokens: int = Field(
        default=65536,
        ge=1,
        description="Token budget of an interactive batch (prompt + max_tokens).",
    )
    scheduler_background_max_batch_tokens: int = Field(
        default=131072,
        ge=1,
        description="Token budget of a background batch (prompt + max_tokens).",
    )

    @property
    def largest_token_budget(self) -> int:
        """The most tokens one request may ask for: the largest tier token budget."""
        return max(
            self.scheduler_interactive_max_batch_tokens, self.scheduler_background_max_batch_tokens
        )

    def limits(self) -> RequestLimits:
        """The request bounds every validating process checks against."""
        return RequestLimits(
            max_tokens_cap=self.max_tokens_cap,
            default_max_tokens=self.default_max_tokens,
            max_prompt_chars=self.max_prompt_chars,
        )
