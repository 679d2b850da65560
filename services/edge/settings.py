"""Edge settings (`TOKENBUS_EDGE_*`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from services.edge.resume import ResumeKeys
from shared.settings import TokenbusSettings

ResultTopology = Literal["partition", "topic"]


class KeysSettings(TokenbusSettings):
    """Where API keys live: read by the edge, `tokenbus keys` and `tokenbus up`."""

    edge_keys_file: Path = Field(
        default=Path(".tokenbus/keys.json"),
        description=(
            "API keys file (hashes, tenants, limits; `tokenbus keys`). Re-read when it changes."
            " Missing or empty: every key is refused."
        ),
    )


class EdgeSettings(KeysSettings):
    # An error message must never carry a secret it was given.
    model_config = SettingsConfigDict(hide_input_in_errors=True)

    edge_host: str = Field(default="127.0.0.1", description="Bind address of the edge.")
    edge_port: int = Field(
        default=8000, ge=0, le=65535, description="HTTP and WebSocket port of the edge."
    )
    edge_result_topology: ResultTopology = Field(
        default="partition",
        description=(
            "Where results come back: `partition` (one leased partition of the shared results"
            " topic per edge) or `topic` (a topic per request, deleted after a retention window)."
        ),
    )
    edge_result_partition: int | None = Field(
        default=None,
        ge=0,
        description=(
            "partition topology: the results partition this edge must own; unset = lease the"
            " lowest free one. Either way it is held by a lease, so two live edges never share one."
        ),
    )
    edge_lease_ttl_s: float = Field(
        default=10.0,
        gt=0.5,
        description="A result-partition lease lasts this long unless renewed (every third of it).",
    )
    edge_result_topic_retention_s: float = Field(
        default=300.0,
        ge=0,
        description="topic topology: a request's topic is deleted this long after its stream ends.",
    )
    edge_result_topic_orphan_after_s: float = Field(
        default=900.0,
        gt=0,
        description=(
            "Sweeper (every edge): a per-request topic no live edge reads is deleted once its"
            " last record, or its first sighting if it is empty, is this old (a crashed edge's"
            " leftovers). Keep it above the retention and the longest queueing."
        ),
    )
    edge_result_topic_sweep_interval_s: float = Field(
        default=60.0, gt=0, description="How often the sweeper lists per-request topics."
    )
    edge_direct_to_tier: bool = Field(
        default=True,
        description=(
            "Write a request straight to its tier topic, one Kafka hop fewer, unless the"
            " response cache may answer it (temperature 0 or a seed: those go through"
            " tokenbus.requests and ingest). false: every request goes through ingest (ADR 0041)."
        ),
    )
    edge_name_variants: bool = Field(
        default=False,
        description="Name the variant that answered (`chat.done` `variant`, OpenAI"
        " `system_fingerprint`) to every tenant; off: only to a request that pinned it, so"
        " a rollout's canary stays unknown to the tenants it serves.",
    )
    edge_disconnect_grace_s: float = Field(
        default=30.0,
        ge=0,
        description="A dropped socket's requests are cancelled after this long without a resume.",
    )
    edge_drain_s: float = Field(
        default=20.0,
        ge=0,
        description="On SIGTERM the edge takes no new request (/readyz 503; requests and"
        " resumes refused `overloaded`) and lets the streams in flight finish for up to this"
        " long; then sockets close 1012, SSE streams end with an `edge_restarting` event that"
        " says where to resume, whole answers still running are refused 503 and cancelled, all"
        " to go on at another edge. A second signal stops it at once.",
    )
    edge_stream_stall_s: float = Field(
        default=60.0,
        gt=0,
        description=(
            "A started stream (or one open through a broker outage) with no result record for"
            " this long while the broker is reachable ends with `error` code `internal`."
        ),
    )
    edge_max_frame_bytes: int = Field(
        default=1 << 20, ge=1024, description="Largest frame answered; above it: invalid_request."
    )
    edge_outbox_bytes: int = Field(
        default=4 * 1024 * 1024,
        ge=64 * 1024,
        description="The weight (an upper estimate of memory: services/edge/outbox.py) of the"
        " frames queued for one client (a WebSocket, an HTTP answer); a client that lets more"
        " pile up is let go as for edge_outbox_frames.",
    )
    edge_outbox_budget_bytes: int = Field(
        default=256 * 1024 * 1024,
        ge=1024 * 1024,
        description="The weight of the frames queued for all of this edge's clients"
        " together; a client whose next frame would pass it is let go, as a slow one is.",
    )
    edge_outbox_frames: int = Field(
        default=4096,
        ge=16,
        description=(
            "Frames queued for one socket; a client that lets more pile up is closed with 1013"
            " and its streams wait out the disconnect grace for a resume."
        ),
    )
    edge_produce_timeout_s: float = Field(
        default=3.0,
        gt=0,
        description=(
            "Longest a request waits to be written to Kafka (or its topic created); past it"
            " the client gets `overloaded` with `retry_after_ms`."
        ),
    )
    edge_produce_wait_s: float = Field(
        default=25.0,
        gt=0,
        description=(
            "Longest a written request waits for its partition's leader while the rest of the"
            " cluster answers (one node of several away: an election, or the node's return);"
            " new requests meanwhile go to partitions whose leaders answer (ADR 0049)."
        ),
    )
    edge_retry_after_ms: int = Field(
        default=2000,
        ge=0,
        description="`retry_after_ms` of an `overloaded` answer (the broker unreachable, or a"
        " write that did not land in the edge's bounds).",
    )
    resume_secret: SecretStr | None = Field(
        default=None,
        description="HMAC key of resume tokens, the same on every edge: required, at least 32"
        " random bytes (`tokenbus up` generates one); the edge refuses to start without it.",
    )
    resume_secrets: SecretStr | None = Field(
        default=None,
        description="Key rotation: `kid:secret,kid:secret` (each secret 32+ bytes, no commas);"
        " the first signs, all verify. Set, it replaces TOKENBUS_RESUME_SECRET (key id `0`).",
    )
    edge_resume_ttl_s: float = Field(
        default=600.0, gt=0, description="How long a resume token stays valid."
    )
    # A resume replays its stream with a consumer of its own (services/edge/replay.py); the
    # edge's shared reader is never rewound for it.
    edge_resume_timeout_s: float = Field(
        default=10.0, gt=0, description="A resume's replay of its stream ends within this."
    )
    edge_resume_max_records: int = Field(
        default=200_000,
        ge=1,
        description="Records a resume's replay may read (its own and other streams') at most;"
        " a stream further back is refused `not_found`.",
    )
    edge_resume_replays: int = Field(
        default=16,
        ge=1,
        description="Result partitions replayed at once for resumes on this edge, each by one"
        " consumer for all its resumes; more wait.",
    )
    edge_models_stale_s: float = Field(
        default=10.0,
        gt=0,
        description=(
            "`/v1/models` lists the model of each worker whose last heartbeat is younger than"
            " this; a request naming another model gets 404."
        ),
    )
    edge_sse_keepalive_s: float = Field(
        default=15.0,
        gt=0,
        description=(
            "An OpenAI stream sends an SSE comment (`: keep-alive`) after this long without an"
            " event, from its headers on, so proxies with a read timeout keep it open."
        ),
    )

    @model_validator(mode="after")
    def _resume_keys_configured(self) -> EdgeSettings:
        self.resume_keys()  # ValueError naming what is missing or weak, never the secret
        return self

    def resume_keys(self) -> ResumeKeys:
        return ResumeKeys.from_settings(self.resume_secret, self.resume_secrets)

    # -- security: API keys, origins, quotas (services/edge/auth.py, keys.py, quotas.py) -----
    edge_allowed_origins: list[str] | None = Field(
        default=None,
        description=(
            "Origins (JSON list) whose pages may open /v1/chat; unset: the edge's own origin"
            ' (all loopback spellings on a loopback bind); `["*"]`: any. No Origin is allowed.'
        ),
    )
    edge_auth_timeout_s: float = Field(
        default=5.0, gt=0, description="A socket without a valid key by then is closed (1008)."
    )
    edge_max_unauthenticated_sockets: int = Field(
        default=1024,
        ge=1,
        description="Sockets open without a key yet, at most; above it an upgrade gets HTTP 503.",
    )
    edge_max_unauthenticated_frames: int = Field(
        default=8, ge=1, description="Frames answered `unauthorized` before the socket is closed."
    )

    # -- security: the listener's limits (services/edge/listener.py, openai/routes.py) ------
    edge_header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description=(
            "A connection's request head (a WebSocket handshake's too) must arrive whole within"
            " this, from the connection or the end of its previous answer; else it is closed."
        ),
    )
    edge_keep_alive_timeout_s: int = Field(
        default=5, ge=1, description="An idle keep-alive connection is closed after this long."
    )
    edge_max_connections: int = Field(
        default=4096,
        ge=1,
        description="Connections (and requests) at once; above it a request gets HTTP 503.",
    )
    edge_body_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="An HTTP request's body must arrive whole within this after its head"
        " (else 408, connection closed), a WebSocket message within this after its first"
        " frame (else closed 1008); uvicorn has no such timeout of its own.",
    )
    edge_body_budget_bytes: int = Field(
        default=128 * 1024 * 1024,
        ge=1024 * 1024,
        description="Bytes of HTTP request bodies the edge holds while they arrive, all"
        " clients together (503 and a retry hint past it), and the same again of WebSocket"
        " messages (the socket closed 1013 past it).",
    )
    edge_file_max_bytes: int = Field(
        default=200 * 1024 * 1024,
        ge=1024,
        le=200 * 1024 * 1024,
        description="Largest file `POST /v1/files` takes (OpenAI's limit for a batch's"
        " input, 200 MB; 413 past it). It streams to a temporary file, not to memory.",
    )
    edge_file_uploads: int = Field(
        default=4,
        ge=1,
        description="`POST /v1/files` uploads one edge takes at once (each holds up to"
        " edge_file_max_bytes of its disk while it is checked and stored); 503 and a retry"
        " hint past it.",
    )
    edge_file_upload_s: float = Field(
        default=600.0,
        gt=0,
        description="An upload must arrive whole within this (else 408, connection closed).",
    )
    edge_batch_runner: bool = Field(
        default=True,
        description="Run OpenAI batches: the edge joins the batch runners' group and runs the"
        " batches of the partitions it is given (ADR 0075). false: it only takes and shows them.",
    )
    edge_batch_window: int = Field(
        default=64,
        ge=1,
        le=4096,
        description="A runner's batch lines in flight at once, all its batches together: each"
        " is a background-tier request on the bus; the scheduler keeps interactive ones ahead.",
    )
    edge_batch_progress_s: float = Field(
        default=1.0,
        gt=0,
        description="A running batch's request_counts are written at most this often.",
    )
    edge_max_connections_per_ip: int = Field(
        default=0,
        ge=0,
        description="Connections at once from one client address (idle keep-alive and"
        " WebSocket ones included); one more is dropped as it opens. 0: no limit (the default:"
        " behind a load balancer or an ingress every client shares its address). Set it where"
        " clients reach the edge directly.",
    )
    edge_send_buffer_bytes: int = Field(
        default=256 * 1024,
        ge=0,
        description="The kernel's send buffer of each client connection (SO_SNDBUF; Linux"
        " doubles it): what a client that reads slowly holds in the kernel before its frames"
        " queue in the edge's outbox, where they are weighed. A token stream needs KB/s; the"
        " kernel's own tuning grows a buffer to 4 MB. 0: the kernel's tuning.",
    )
    edge_max_header_bytes: int = Field(
        default=16384,
        ge=1024,
        description="Largest request head (request line and headers); above it: HTTP 400.",
    )
    edge_max_unauthenticated_frame_bytes: int = Field(
        default=4096,
        ge=256,
        description="Largest frame on a socket before its key is accepted; above it: close 1009.",
    )
    edge_http_write_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description=(
            "An HTTP client (an SSE stream's) that takes nothing written to it for this long,"
            " its write buffer full, is dropped: its stream is detached and waits out the"
            " disconnect grace for a resume."
        ),
    )
    edge_trust_traceparent: bool = Field(
        default=False,
        description=(
            "Continue the trace of a client's `traceparent`; off: a request starts a trace of"
            " its own and keeps the client's only as a span link."
        ),
    )
