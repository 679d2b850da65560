"""Ingest settings: the shared ones; limits come from `TokenbusSettings`."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from shared.messages import RequestLimits
from shared.settings import TokenbusSettings
from shared.topics import app_name_problem


class IngestSettings(TokenbusSettings):
    ingest_dedupe_window: int = Field(
        default=100_000,
        ge=1,
        description="Request ids remembered, and records read back from the tier topics and"
        " the DLQ to remember them after a restart.",
    )
    ingest_reply_timeout_ms: int = Field(
        default=2000,
        ge=1,
        description="Longest one write of an error to a reply_to (or one look-up of it) waits.",
    )
    ingest_reply_to_grace_ms: int = Field(
        default=200,
        ge=0,
        description="How long after a reply_to topic is reported missing it is asked about"
        " once more before the request is refused (a topic just created may lag).",
    )
    ingest_reply_attempts: int = Field(
        default=3,
        ge=1,
        description="Failed writes to an existing reply_to before its error is given up on.",
    )
    ingest_publish_timeout_ms: int = Field(
        default=30000,
        ge=1000,
        description="Longest one write to a tier topic or the DLQ waits before it is retried.",
    )
    ingest_retry_backoff_ms: int = Field(
        default=100, ge=1, description="First wait before a failed Kafka write is retried."
    )
    ingest_retry_backoff_max_ms: int = Field(
        default=5000, ge=1, description="Longest wait between retries of a failed Kafka write."
    )
    ingest_commit_interval_ms: float = Field(
        default=200.0,
        ge=0,
        description="Commit requests-topic offsets at most this often; a restart re-reads what"
        " was handed on since, and the dedupe memory drops it (0: after every fetch).",
    )
    ingest_max_record_bytes: int = Field(
        default=1_000_000,
        ge=10_000,
        description="Largest record ingest writes (keep below the broker's message.max.bytes):"
        " a larger request is refused, a larger DLQ copy is truncated.",
    )

    ingest_cache: bool = Field(
        default=True,
        description="Response cache: answer deterministic requests (temperature 0 or a seed)"
        " from complete answers stored on the cache topic; false: every request runs.",
    )
    ingest_cache_max_entries: int = Field(
        default=100_000, ge=1, description="Response cache: most answers one ingest holds."
    )
    ingest_cache_max_bytes: int = Field(
        default=134_217_728,
        ge=1_048_576,
        description="Response cache: most memory one ingest's answers take (bytes, estimated).",
    )

    ingest_apps: str = Field(
        default="",
        description="Outside applications, comma-separated: ingest also reads each one's own"
        " requests topic (`<prefix>.app-requests.<app>`), and takes its tenant, reply topic"
        " and request-id scope from that topic, not from the record (ADR 0044).",
    )
    ingest_app_rps: float = Field(
        default=50.0, gt=0, description="Requests per second each outside application may send."
    )
    ingest_app_burst: int = Field(
        default=100, ge=1, description="Requests an outside application may send at once."
    )
    ingest_app_bytes_per_s: float = Field(
        default=2_000_000,
        gt=0,
        description="Bytes per second of records each outside application may send, charged"
        " before a record is parsed; over it, records are refused unread (rate_limited).",
    )
    ingest_app_burst_bytes: int = Field(
        default=16_000_000,
        ge=1_000_000,
        description="Bytes of records an outside application may send at once (at least one"
        " record of ingest_max_record_bytes).",
    )

    @field_validator("ingest_apps")
    @classmethod
    def _app_names(cls, value: str) -> str:
        for name in _names(value):
            if problem := app_name_problem(name):
                raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _backoff_in_order(self) -> IngestSettings:
        if self.ingest_retry_backoff_ms > self.ingest_retry_backoff_max_ms:
            raise ValueError(
                f"ingest_retry_backoff_ms ({self.ingest_retry_backoff_ms}) must be at most"
                f" ingest_retry_backoff_max_ms ({self.ingest_retry_backoff_max_ms})"
            )
        return self

    @property
    def apps(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(_names(self.ingest_apps)))

    @property
    def reply_timeout_s(self) -> float:
        return self.ingest_reply_timeout_ms / 1000

    def limits(self) -> RequestLimits:
        # Ingest also refuses a request no tier's batch could ever carry.
        return super().limits().model_copy(update={"max_request_tokens": self.largest_token_budget})


def _names(value: str) -> list[str]:
    return [name.strip() for name in value.split(",") if name.strip()]
