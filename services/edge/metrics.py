"""The edge's Prometheus metrics, one registry per edge (tests run several in one process)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Topic admin calls take milliseconds on an idle broker and seconds on a busy controller.
ADMIN_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


@dataclass
class EdgeMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.streams_open = Gauge(
            "tokenbus_edge_streams_open", "Result streams this edge follows", registry=r
        )
        self.topics_created = Counter(
            "tokenbus_edge_result_topics_created", "Per-request result topics created", registry=r
        )
        self.topics_deleted = Counter(
            "tokenbus_edge_result_topics_deleted", "Per-request result topics deleted", registry=r
        )
        self.topics_swept = Counter(
            "tokenbus_edge_result_topics_swept",
            "Per-request result topics of other (crashed) edges deleted by this edge's sweeper",
            registry=r,
        )
        self.broker_reachable = Gauge(
            "tokenbus_edge_broker_reachable",
            "1 while this edge's bounded Kafka calls succeed; 0 while it refuses new requests",
            registry=r,
        )
        self.requests_moved = Counter(
            "tokenbus_edge_requests_moved",
            "New requests written to another partition than their keyed one, whose leader"
            " did not answer (a broker node away)",
            registry=r,
        )
        self.slow_client_closes = Counter(
            "tokenbus_edge_slow_client_closes",
            "Sockets closed with 1013 because their outbox was full (client not reading)",
            registry=r,
        )
        self.stalled_streams = Counter(
            "tokenbus_edge_stalled_streams",
            "Streams ended with an error after no result record for TOKENBUS_EDGE_STREAM_STALL_S",
            registry=r,
        )
        self.task_restarts = Counter(
            "tokenbus_edge_task_restarts",
            "Background tasks of the edge restarted after a failure",
            ["task"],
            registry=r,
        )
        self.topic_create_seconds = Histogram(
            "tokenbus_edge_result_topic_create_seconds",
            "Time to create one per-request result topic (on the request path)",
            buckets=ADMIN_BUCKETS,
            registry=r,
        )
        self.topic_delete_seconds = Histogram(
            "tokenbus_edge_result_topic_delete_seconds",
            "Time of one delete call for due per-request result topics",
            buckets=ADMIN_BUCKETS,
            registry=r,
        )
        self.resumes = Counter(
            "tokenbus_edge_resumes", "stream.resume outcomes", ["outcome"], registry=r
        )
        self.results_read = Counter(
            "tokenbus_edge_results_read",
            "Result records the edge's shared reader handed on (a resume's replay reads its"
            " own: this grows with new records only, never by a rewind)",
            registry=r,
        )
        self.replayed = Counter(
            "tokenbus_edge_resume_replay_records",
            "Records resume replays read, with readers of their own",
            registry=r,
        )
        self.batch_lines = Counter(
            "tokenbus_edge_batch_lines",
            "OpenAI batch lines this edge's runner answered, by outcome (ok, failed, expired)",
            ["outcome"],
            registry=r,
        )
        self.batch_progress = Gauge(
            "tokenbus_edge_batch_progress",
            "Each batch this edge runs now: its lines (total, completed, failed); gone when"
            " it ends here or its partition moves to another edge",
            ["batch_id", "state"],
            registry=r,
        )
        self.disconnect_cancels = Counter(
            "tokenbus_edge_disconnect_cancels",
            "Requests cancelled because their socket dropped and no resume came",
            registry=r,
        )
