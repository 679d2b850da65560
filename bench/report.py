"""The benchmark report's JSON: every model `tokenbus bench` writes, and nothing else."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = 1


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Distribution(Model):
    """Percentiles of one measure; the statistics are None when there was no sample."""

    count: int = 0
    mean: float | None = None
    p50: float | None = None
    p95: float | None = None
    p99: float | None = None
    max: float | None = None


class TierSummary(Model):
    """What the clients of one tier (or of all tiers) saw."""

    sent: int
    completed: int
    errors: int
    incomplete: int
    output_tokens: int
    ttft_ms: Distribution
    itl_ms: Distribution = Field(description="Gaps between consecutive chat.delta frames.")
    tpot_ms: Distribution = Field(description="(e2e - ttft) / (completion_tokens - 1).")
    e2e_ms: Distribution
    engine_ttft_ms: Distribution = Field(description="Worker: engine start to first token.")
    batch_wait_ms: Distribution = Field(description="Scheduler: accepted to batch formed.")
    overhead_ms: Distribution = Field(description="ttft - engine_ttft - batch_wait.")
    hops_ms: dict[str, Distribution] = Field(
        default_factory=dict,
        description="TTFT cut at each service's stamp (bench/stats.py HOPS); pipeline only.",
    )


class BatchSummary(Model):
    """Batch sizes: from the scheduler's batches topic, else from chat.done timings.

    With the scheduler as source every batch counts once; from timings every request
    counts once, with the size of the batch it ran in (`counts` says which).
    """

    source: Literal["scheduler", "timings", "none"]
    counts: Literal["batches", "requests"]
    batches: int = Field(description="Batches seen (scheduler source), else 0.")
    size: Distribution
    fill: Distribution = Field(description="Batch size / the tier's max batch size.")
    histogram: dict[str, dict[str, int]] = Field(description="Tier -> batch size -> count.")
    reasons: dict[str, int] = Field(description="Why batches left (full, timeout, ...).")


class RunSummary(Model):
    """One open-loop run at one offered rate."""

    policy: str
    offered_rps: float
    duration_s: float
    seed: int
    connections: int
    concurrency_cap: int
    sent: int
    completed: int
    shed: int = Field(description="Arrivals not sent because the concurrency cap was reached.")
    incomplete: int = Field(description="Sent, no chat.done or error before the drain ended.")
    errors: dict[str, int] = Field(description="Error frames by code.")
    elapsed_s: float = Field(description="First send to last answer.")
    achieved_rps: float
    output_tokens_per_s: float
    tiers: dict[str, TierSummary] = Field(description="interactive, background and all.")
    batches: BatchSummary
    generator_lag_ms: Distribution = Field(description="How late arrivals were sent.")
    load_avg_1m: float = Field(description="The machine's 1-minute load average at the end.")
    ttft_samples_ms: dict[str, list[float]] = Field(description="Sorted TTFTs per tier.")


class PolicyReport(Model):
    """One stack configuration and its runs, or why it was not run."""

    name: str
    kind: Literal["pipeline", "direct", "external"]
    available: bool
    failed: bool = Field(default=False, description="It should have run, but did not start.")
    note: str = ""
    env: dict[str, str] = Field(default_factory=dict)
    max_batch_size: dict[str, int] = Field(default_factory=dict)
    runs: list[RunSummary] = Field(default_factory=list)


class OverheadPoint(Model):
    offered_rps: float
    p50_ms: float | None
    p99_ms: float | None
    completed: int


class SloResult(Model):
    """The highest swept rate with interactive p99 TTFT under the SLO, and the next one."""

    highest_passing_rps: float | None
    first_failing_rps: float | None
    p99_at_highest_ms: float | None


class Saturation(Model):
    """The best output tokens/s of a sweep, and whether the sweep overloaded the policy."""

    tokens_per_s: float
    at_offered_rps: float
    reached: bool = Field(description="Some run shed, left requests unanswered or fell behind.")


class Target(Model):
    name: str
    measured: str
    target: str
    holds: bool | None = Field(description="None when it could not be measured.")


class Findings(Model):
    slo_ttft_ms: float
    overhead: dict[str, list[OverheadPoint]]
    slo: dict[str, SloResult]
    saturation: dict[str, Saturation]
    low_load_ttft_p50_ms: dict[str, float | None]
    targets: list[Target]


class Machine(Model):
    platform: str
    python: str
    cpu: str
    cores: int
    memory_gib: float | None
    load_before: list[float]
    load_after: list[float] = Field(default_factory=list)


class BenchReport(Model):
    schema_version: int = SCHEMA_VERSION
    created_at: str
    command: str
    target: str = Field(description="The WebSocket URL, or 'stacks started by the bench'.")
    sim_profile: str
    sim_profile_note: str = ""
    workload: str = Field(default="", description="The mix: its file, classes and shares.")
    machine: Machine
    policies: list[PolicyReport]
    findings: Findings | None = None
    elapsed_s: float = 0.0
