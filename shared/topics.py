"""Topic names and the partition counts the project creates them with."""

from __future__ import annotations

import re
from dataclasses import dataclass

from shared.messages import Tier

# An outside application's name: its principal's user name, its tenant, and a part of its
# topics' names (no dot, so a LITERAL ACL on its topic can match no other app's).
APP_NAME = r"^[a-z0-9][a-z0-9-]{0,47}$"
# Names an application may not take: the services' roles and the broker's admin user. An app
# logs in as `User:<name>` by default, so an app named `edge` would be granted its ACLs on
# the edge's own principal, and its tenant would read as a service's.
RESERVED_APP_NAMES = frozenset({"edge", "ingest", "scheduler", "worker", "admin"})


def app_name_problem(name: str) -> str | None:
    """Why `name` cannot name an outside application, or None."""
    if not re.fullmatch(APP_NAME, name):
        return f"app name {name!r} does not match {APP_NAME}"
    if name in RESERVED_APP_NAMES:
        return (
            f"app name {name!r} is a service's (reserved: {', '.join(sorted(RESERVED_APP_NAMES))})"
        )
    return None


# Retention of the topics outside writers fill (the DLQ, each application's topics): a week,
# and at most 1 GiB per partition, whichever comes first.
BOUNDED_RETENTION: dict[str, str] = {
    "retention.ms": str(7 * 24 * 3600 * 1000),
    "retention.bytes": str(1 << 30),
}


@dataclass(frozen=True)
class Topics:
    """Every topic of one tokenbus deployment, named from its prefix."""

    prefix: str = "tokenbus"

    @property
    def requests(self) -> str:
        return f"{self.prefix}.requests"

    @property
    def dlq(self) -> str:
        return f"{self.prefix}.requests.dlq"

    def tier(self, tier: Tier) -> str:
        return f"{self.prefix}.requests.{tier.value}"

    @property
    def tiers(self) -> tuple[str, ...]:
        return tuple(self.tier(t) for t in Tier)

    @property
    def batches(self) -> str:
        return f"{self.prefix}.batches"

    @property
    def results(self) -> str:
        return f"{self.prefix}.results"

    @property
    def result_leases(self) -> str:
        """Compacted log of which edge holds which results partition (the edge creates it)."""
        return f"{self.prefix}.results.leases"

    def request_results(self, request_id: str) -> str:
        """A per-request result topic (the edge's `topic` result topology)."""
        return f"{self.prefix}.results.{request_id}"

    @property
    def workers(self) -> str:
        """Heartbeats: every worker writes each beat to every partition (ADR 0056)."""
        return f"{self.prefix}.workers"

    def single_copy(self) -> frozenset[str]:
        """Topics made with one copy per partition, whatever the cluster's replication.

        The heartbeats (ADR 0056): with replication, a replica on a hung node holds back
        every partition's high watermark until the controller fences the node, so no beat
        is readable anywhere and every worker looks dead. One copy per partition, spread over
        the nodes, and each beat on every partition: a node away silences only its own.
        """
        return frozenset({self.workers})

    @property
    def control(self) -> str:
        return f"{self.prefix}.control"

    @property
    def cache(self) -> str:
        """Compacted log of complete deterministic answers, keyed by cache key (ADR 0036)."""
        return f"{self.prefix}.cache"

    @property
    def files(self) -> str:
        """Compacted: one record per uploaded file, keyed by its id (ADR 0074)."""
        return f"{self.prefix}.files"

    @property
    def file_chunks(self) -> str:
        """Compacted: the files' content, in chunks keyed `<file id>/<n>` (ADR 0074)."""
        return f"{self.prefix}.file-chunks"

    @property
    def batch_jobs(self) -> str:
        """Compacted: one record per OpenAI batch, keyed by its id, and its cancel, keyed
        `<id>/cancel` (ADR 0075)."""
        return f"{self.prefix}.batch-jobs"

    @property
    def batch_outcomes(self) -> str:
        """Compacted: each batch line's outcome, keyed `<batch id>/<line>`, on its batch's
        partition number (ADR 0075)."""
        return f"{self.prefix}.batch-outcomes"

    @property
    def batch_runners(self) -> str:
        """The edges' consumer group that shares out `batch_jobs`' partitions: the member
        holding one runs its batches (ADR 0075)."""
        return f"{self.prefix}.batch-runners"

    @property
    def variants(self) -> str:
        """Compacted log of each model's rollout (variants and shares), keyed by model name
        (ADR 0054)."""
        return f"{self.prefix}.variants"

    @property
    def verdicts(self) -> str:
        """Compacted log of the schedulers' latest canary verdicts, keyed by model name
        (ADR 0058): what `tokenbus models status` shows and a promotion is checked against."""
        return f"{self.prefix}.verdicts"

    @property
    def scores(self) -> str:
        """Shadow validation's scores (shared/shadows.py `ShadowScore`), keyed by model name:
        written by gold workers, read by every scheduler (ADR 0057)."""
        return f"{self.prefix}.scores"

    @property
    def shadow(self) -> str:
        """Where shadow validation's gold runs stream their answers: read by nobody (their
        worker scores them itself), so kept briefly."""
        return f"{self.prefix}.shadow"

    def app_requests(self, app: str) -> str:
        """The requests topic of one outside application: only its principal may WRITE it,
        so the topic a record was read from names who wrote it (ADR 0044)."""
        return f"{self.app_requests_prefix}{app}"

    @property
    def app_requests_prefix(self) -> str:
        """Where every application's requests topic lives (ingest READs under it)."""
        return f"{self.prefix}.app-requests."

    def app_replies(self, app: str) -> str:
        """The one topic an outside application's results and errors go to; only it READs it."""
        return f"{self.prefix}.replies.{app}"

    def app_partitions(self, app: str) -> dict[str, int]:
        """An application's two topics, as `tokenbus topics create --app` makes them."""
        return {self.app_requests(app): 4, self.app_replies(app): 4}

    def worker_group(self, worker_id: str) -> str:
        """The consumer group under which one worker commits its batch partition progress."""
        return f"{self.prefix}.worker.{worker_id}"

    def partitions(self) -> dict[str, int]:
        """Topic name -> partition count, as `tokenbus topics create` makes them."""
        return {
            self.requests: 4,
            self.dlq: 1,
            **{t: 4 for t in self.tiers},
            self.batches: 4,
            # One partition per edge process (reply-partition pattern).
            self.results: 16,
            # The edge sets its configs (compacted, broker append time) when it starts.
            self.result_leases: 1,
            # One per node of a three-node cluster, each a single copy (`single_copy`).
            self.workers: 3,
            self.control: 1,
            self.cache: 4,
            # One small record per file; the content's chunks, a file's all on one partition.
            self.files: 1,
            self.file_chunks: 4,
            # One runner (an edge) per partition runs its batches: as many as may run apart.
            self.batch_jobs: 4,
            self.batch_outcomes: 4,
            self.variants: 1,
            self.verdicts: 1,
            self.scores: 3,
            self.shadow: 3,
        }

    def configs(
        self, cache_retention_ms: int, cache_retention_bytes: int
    ) -> dict[str, dict[str, str]]:
        """Topic configs the project creates topics with, by name (those that need any)."""
        return {
            self.cache: {
                # Compaction keeps one answer per key; deletion bounds age and size.
                "cleanup.policy": "compact,delete",
                "retention.ms": str(cache_retention_ms),
                "retention.bytes": str(cache_retention_bytes),
                # Only closed segments are deleted or compacted: roll them well within the age.
                "segment.ms": str(max(60_000, cache_retention_ms // 4)),
            },
            # Files are kept until deleted (tombstones), as OpenAI keeps them (ADR 0074).
            self.files: {"cleanup.policy": "compact"},
            self.file_chunks: {"cleanup.policy": "compact", "max.message.bytes": str(1 << 20)},
            # Batches and their lines' outcomes are kept until a batch's files are written.
            self.batch_jobs: {"cleanup.policy": "compact"},
            self.batch_outcomes: {"cleanup.policy": "compact"},
            # The latest rollout of each model, kept for ever: a restart forgets nothing.
            self.variants: {"cleanup.policy": "compact"},
            # The latest verdicts of each model; the schedulers rewrite them every few seconds.
            self.verdicts: {"cleanup.policy": "compact"},
            # Read as they come (a scheduler starts at the end): a day is plenty to look back.
            self.scores: {"retention.ms": str(24 * 3600 * 1000)},
            # Nobody reads the gold runs' streams: gone within the hour.
            self.shadow: {"retention.ms": str(3600 * 1000), "segment.ms": str(600 * 1000)},
            # Bounded in bytes as well as age: a flood of refused records (issue 37, N6)
            # rolls old letters off instead of filling the disk. Ingest's memory reads it
            # back only for records not yet committed, which are far younger than that.
            self.dlq: dict(BOUNDED_RETENTION),
        }

    def app_configs(self, app: str) -> dict[str, dict[str, str]]:
        """An application's two topics' configs: bounded in bytes (per partition) and age,
        so that one writer cannot fill the brokers' disks (issue 37, N6)."""
        return {topic: dict(BOUNDED_RETENTION) for topic in self.app_partitions(app)}
