"""Settings every service shares: where Kafka is and how to reach it, topic names, limits."""

from __future__ import annotations

from typing import Annotated, Literal, Self

from pydantic import AliasChoices, Field, FilePath, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.cascades import Route, check_route_names
from shared.messages import RequestLimits
from shared.topics import Topics

LogFormat = Literal["json", "console"]


class TokenbusSettings(BaseSettings):
    """Base of every service's settings; read from `TOKENBUS_*` environment variables."""

    # hide_input_in_errors: a validation error shows no input value, so no password (the
    # SASL and key passwords, read from the environment) reaches a log or a crash report.
    model_config = SettingsConfigDict(
        env_prefix="TOKENBUS_", extra="ignore", hide_input_in_errors=True
    )

    bootstrap_servers: str = Field(
        default="127.0.0.1:9092",
        validation_alias=AliasChoices("KAFKA_BOOTSTRAP_SERVERS", "TOKENBUS_BOOTSTRAP_SERVERS"),
        description="Kafka bootstrap servers (KAFKA_BOOTSTRAP_SERVERS wins).",
    )
    # Kafka client security: one set for every client of a process (producers, consumers,
    # admin clients), built into clients by `shared.kafka` alone.
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        default="PLAINTEXT",
        description="How clients talk to Kafka: PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL.",
    )
    kafka_sasl_mechanism: Literal["SCRAM-SHA-512", "PLAIN"] = Field(
        default="SCRAM-SHA-512",
        description="SASL mechanism of the SASL_* protocols: SCRAM-SHA-512 or PLAIN.",
    )
    kafka_sasl_username: str | None = Field(
        default=None, description="SASL user (the process's principal); needed by SASL_*."
    )
    kafka_sasl_password: SecretStr | None = Field(
        default=None, description="SASL password of `TOKENBUS_KAFKA_SASL_USERNAME`."
    )
    kafka_ssl_cafile: FilePath | None = Field(
        default=None,
        description="PEM CA bundle the broker certificate is checked against "
        "(SSL, SASL_SSL; unset: the system's CAs).",
    )
    kafka_ssl_certfile: FilePath | None = Field(
        default=None, description="PEM client certificate for mutual TLS (SSL, SASL_SSL)."
    )
    kafka_ssl_keyfile: FilePath | None = Field(
        default=None, description="PEM private key of `TOKENBUS_KAFKA_SSL_CERTFILE`."
    )
    kafka_ssl_key_password: SecretStr | None = Field(
        default=None, description="Password of an encrypted `TOKENBUS_KAFKA_SSL_KEYFILE`."
    )
    kafka_producer_request_timeout_ms: int = Field(
        default=30000,
        ge=1000,
        description="Producers: longest a write waits for buffer room, its partition's leader"
        " or the broker's answer; a batch whose partition has no leader this long expires"
        " (aiokafka's request_timeout_ms). Producers that bound their writes themselves keep"
        " their own: ingest's (TOKENBUS_INGEST_PUBLISH_TIMEOUT_MS), the workers' heartbeats.",
    )
    kafka_session_timeout_ms: int = Field(
        default=10000,
        ge=1000,
        description="Consumer groups (the schedulers', ingest's): a member not heard from this"
        " long leaves its group, and a member whose heartbeats fail this long looks for its"
        " coordinator anew; heartbeats go every 3/10 of it. Within the broker's"
        " group.min.session.timeout.ms and group.max.session.timeout.ms.",
    )
    topic_prefix: str = Field(
        default="tokenbus",
        pattern=r"^[A-Za-z0-9._-]{1,100}$",
        description="First part of every topic name; tests use their own to stay isolated.",
    )
    fetch_max_wait_ms: int = Field(
        default=10,
        ge=1,
        le=500,
        description="Longest an empty fetch waits at the broker, for consumers whose seeks and"
        " new partitions must not wait (per-request result topics, read-backs, replays).",
    )
    long_poll_ms: int = Field(
        default=500,
        ge=1,
        le=5000,
        description="Longest an empty fetch waits at the broker, for the long-lived readers"
        " (requests, tiers, heartbeats, batches, control, an edge's results partition): a"
        " record ends the wait at once; a seek or new partition waits it out (ADR 0041).",
    )
    max_tokens_cap: int | None = Field(
        default=None,
        ge=1,
        description="Largest max_tokens accepted; unset: no cap but the model's context"
        " (a max_tokens above the smallest context of its model's live workers is refused).",
    )
    default_max_tokens: int = Field(
        default=256,
        ge=1,
        description="The output estimate that batch budgets and quota charges use for a"
        " request that sets no max_tokens; the answer itself may be longer (it runs to the"
        " end of the context or a stop).",
    )
    max_prompt_chars: int = Field(
        default=65536, ge=1, description="Largest prompt (all message contents together)."
    )
    log_level: str = Field(default="INFO", description="DEBUG, INFO, WARNING or ERROR.")
    log_format: LogFormat = Field(
        default="console",
        description="`console`: one `key=value` line per event; `json`: one JSON object per line.",
    )
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

    # The response cache's topic (ADR 0036): `tokenbus topics create` makes it with these
    # bounds, and ingest serves no entry older than the age bound.
    cache_retention_ms: int = Field(
        default=86_400_000,
        ge=60_000,
        description="Response cache: oldest answer served, and the cache topic's retention.ms.",
    )
    cache_retention_bytes: int = Field(
        default=268_435_456,
        ge=1_048_576,
        description="Response cache: retention.bytes of each cache topic partition (4 of them).",
    )
    # Warm pools (docs/lifecycle.md): the edge and the schedulers take these models as known
    # while none of their workers is live, and hold their requests while a worker starts.
    served_models: tuple[Annotated[str, Field(min_length=1)], ...] = Field(
        default=(),
        description="Models (JSON list) this deployment serves even while none of their"
        " workers is live (a pool scaled to zero, a worker restarting): a request for one is"
        " held while a worker starts, not refused as an unknown model. `tokenbus up"
        " --workers` sets it.",
    )

    # Cascades (docs/lifecycle.md "Cascades", shared/cascades.py): names clients may ask for
    # as a model, each running a cascade of models with a verifier.
    routes: dict[str, Route] = Field(
        default={},
        description="Routes (JSON object, name -> route): a model name clients may ask for"
        ' that runs `cascade` (2 or more models, fastest first), e.g. {"auto": {"cascade":'
        ' ["small", "large"], "verifiers": [{"kind": "refusal"}], "rules": [{"start":'
        ' "large", "min_prompt_tokens": 2000}]}}; an answer failing a verifier goes on to the'
        " next model. Every service must be given the same.",
    )

    # A canary's evidence (issue 37, N7, shared/tenant_share.py): read by the workers that
    # count outcomes and the schedulers that window shadow scores.
    canary_tenant_share: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="The most one tenant's requests may be of a canary's evidence (its"
        " workers' outcomes, each 10 s; its shadow scores, each window) beside other"
        " tenants': past it its oldest are left out. A tenant alone counts whole; 1 counts"
        " everything.",
    )
    canary_tenant_floor: int = Field(
        default=4,
        ge=0,
        description="Per 10 s: this many of one tenant's requests count in a canary's evidence"
        " whatever canary_tenant_share leaves.",
    )

    @model_validator(mode="after")
    def _routes_are_names(self) -> Self:
        check_route_names(self.routes, self.served_models)
        return self

    @model_validator(mode="after")
    def _kafka_security_is_whole(self) -> Self:
        """A half-configured security setting fails at start, not at the first connect."""
        sasl = self.kafka_security_protocol.startswith("SASL_")
        tls = self.kafka_security_protocol.endswith("SSL")
        if sasl and (not self.kafka_sasl_username or self.kafka_sasl_password is None):
            raise ValueError(
                f"TOKENBUS_KAFKA_SECURITY_PROTOCOL={self.kafka_security_protocol} needs "
                "TOKENBUS_KAFKA_SASL_USERNAME and TOKENBUS_KAFKA_SASL_PASSWORD"
            )
        tls_files = (self.kafka_ssl_cafile, self.kafka_ssl_certfile, self.kafka_ssl_keyfile)
        if not tls and any(f is not None for f in tls_files):
            raise ValueError(
                "TOKENBUS_KAFKA_SSL_* files are set but TOKENBUS_KAFKA_SECURITY_PROTOCOL="
                f"{self.kafka_security_protocol} does not use TLS (SSL or SASL_SSL)"
            )
        if self.kafka_ssl_keyfile is not None and self.kafka_ssl_certfile is None:
            raise ValueError("TOKENBUS_KAFKA_SSL_KEYFILE needs TOKENBUS_KAFKA_SSL_CERTFILE")
        return self

    @property
    def largest_token_budget(self) -> int:
        """The most tokens one request may ask for: the largest tier token budget."""
        return max(
            self.scheduler_interactive_max_batch_tokens, self.scheduler_background_max_batch_tokens
        )

    def topic_configs(self) -> dict[str, dict[str, str]]:
        """Configs of the topics that need any (the cache topic's bounds), by name."""
        return Topics(self.topic_prefix).configs(
            self.cache_retention_ms, self.cache_retention_bytes
        )

    def limits(self) -> RequestLimits:
        """The request bounds every validating process checks against."""
        return RequestLimits(
            max_tokens_cap=self.max_tokens_cap,
            default_max_tokens=self.default_max_tokens,
            max_prompt_chars=self.max_prompt_chars,
        )
