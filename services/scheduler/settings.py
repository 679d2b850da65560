"""Scheduler settings (`TOKENBUS_SCHEDULER_*`); every default is documented in docs/scheduler.md."""

from __future__ import annotations

import os
import socket
from typing import Literal

from pydantic import Field, model_validator

from services.scheduler.canary import CanaryRule
from services.scheduler.departure import AdaptiveRule, CostModel, DepartureRule, FixedRule
from services.scheduler.limits import PolicyConfig, TierLimits
from services.scheduler.routing import DEFAULT_HOLD_S, DEFAULT_LOAD_FACTOR, Router, RoutingMode
from shared.messages import Tier
from shared.settings import TokenbusSettings


def _default_scheduler_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class SchedulerSettings(TokenbusSettings):
    """The per-tier token budgets (`scheduler_*_max_batch_tokens`) live on the shared base:
    ingest refuses any request larger than the largest of them."""

    scheduler_id: str = Field(
        default_factory=_default_scheduler_id,
        min_length=1,
        max_length=200,
        description="Stable name of this scheduler: a restart with the same id takes its"
        " tier partitions back at once (Kafka static group membership).",
    )
    scheduler_policy: Literal["fixed", "adaptive"] = Field(
        default="fixed", description="fixed: the bus rule; adaptive: cost-model wait."
    )

    scheduler_interactive_max_batch_size: int = Field(
        default=16, ge=1, description="Requests per interactive batch, at most."
    )
    scheduler_interactive_max_wait_ms: float = Field(
        default=10.0, ge=0, description="Longest an interactive request waits for its bus."
    )
    scheduler_background_max_batch_size: int = Field(
        default=32, ge=1, description="Requests per background batch, at most."
    )
    scheduler_background_max_wait_ms: float = Field(
        default=200.0, ge=0, description="Longest a background request waits for its bus."
    )
    scheduler_background_aging_ms: float = Field(
        default=2000.0, ge=0, description="Background waiting this long outranks interactive."
    )
    scheduler_background_min_share: float = Field(
        default=0.1,
        ge=0,
        le=1,
        description="Aged background outranks interactive only while background has had"
        " less than this share of recent dispatches (overload then falls on background).",
    )
    scheduler_interactive_reserve: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="Share of each worker's slots that background requests (a batch's lines)"
        " may not take until they have aged: kept free for interactive arrivals. 0: none.",
    )
    scheduler_fill_from_other_tier: bool = Field(
        default=True, description="Fill spare room in a leaving batch from the other tier."
    )
    scheduler_batching: Literal["pack", "buckets"] = Field(
        default="pack", description="pack: one queue per tier; buckets: per prompt length."
    )
    scheduler_bucket_edges: tuple[int, ...] = Field(
        default=(256, 1024, 4096), description="Prompt-token upper bounds of the buckets."
    )
    scheduler_fair_share: bool = Field(
        default=True,
        description="Inside a tier, share capacity between tenants by weighted fair queuing"
        " on tokens (prompt + max_tokens); false: first come, first served.",
    )
    scheduler_tenant_weights: dict[str, float] = Field(
        default_factory=dict,
        description='Fair-share weight per tenant id, JSON (e.g. `{"t-3f9c…": 3}`: the id'
        " `tokenbus keys list` shows with the edges' resume secret set; an app's id is its"
        " name); unnamed tenants weigh 1.",
    )

    scheduler_routing: RoutingMode = Field(
        default="prefix",
        description="Where a leaving batch's requests go. prefix: requests sharing a prompt"
        " prefix (a conversation_id, else the leading messages) go to the worker that last"
        " served it, within a bounded load (docs/scheduler.md); least_loaded: the worker with"
        " most free slots.",
    )
    scheduler_routing_load_factor: float = Field(
        default=DEFAULT_LOAD_FACTOR,
        ge=1.0,
        description="prefix routing: a worker takes a request by affinity only while its busy"
        " slots stay within this factor of the average utilisation; beyond, the least loaded"
        " worker takes it.",
    )
    scheduler_unserved_hold_s: float = Field(
        default=600.0,
        gt=0,
        description="A model (or variant) no live worker has served for this long has its"
        " waiting requests answered `overloaded` instead of held for ever: a pin to a"
        " variant no worker declares, a pool that cannot start. Above the longest cold start.",
    )
    scheduler_requeue_after_s: float = Field(
        default=30.0,
        gt=0,
        description="A request that has waited this long, more than half of"
        " scheduler_max_open_offsets behind its tier partition's reading, is written again"
        " at the partition's tail so the partition's commit moves on (requeue.py).",
    )
    scheduler_affinity_hold_ms: float = Field(
        default=DEFAULT_HOLD_S[Tier.interactive] * 1000.0,
        ge=0,
        description="prefix routing: an interactive request whose last worker (its prefix"
        " cached there) is live waits for a free slot there (past the load bound) up to"
        " this long after its arrival, never within this long of its deadline; then the"
        " bound and the least loaded worker apply. 0: never waits.",
    )
    scheduler_affinity_hold_background_ms: float = Field(
        default=DEFAULT_HOLD_S[Tier.background] * 1000.0,
        ge=0,
        description="prefix routing: the same wait for a background request.",
    )

    # adaptive policy: engine time of a batch of n = per_request * n + per_batch. Defaults:
    # least-squares fit to the llama3-8b-h100 sim profile, 100-token prompts joining 32
    # running sequences (`python -m bench.scheduler`, docs/scheduler.md).
    scheduler_adaptive_per_request_ms: float = Field(
        default=3.3, ge=0, description="adaptive: engine time each request adds to a batch."
    )
    scheduler_adaptive_per_batch_ms: float = Field(
        default=2.2, ge=0, description="adaptive: engine time of a batch beyond its requests."
    )

    scheduler_worker_missed_beats: int = Field(
        default=3, ge=1, description="Heartbeats a worker may miss before it is declared dead."
    )
    scheduler_recovery_grace_ms: float = Field(
        default=1000.0,
        ge=0,
        description="After declaring a worker dead, wait this long (so every scheduler has"
        " stopped sending to it) before handing its unfinished requests back.",
    )
    scheduler_answer_timeout_s: float = Field(
        default=3.0,
        gt=0,
        description="How long writing an error answer (deadline, budget, invalid record) may"
        " keep failing, retried with backoff, before the request is dead-lettered instead.",
    )
    scheduler_max_open_offsets: int = Field(
        default=16000,
        ge=64,
        le=20000,
        description="Per tier partition: stop reading ahead of the oldest request not yet"
        " handed on by this many offsets (bounds memory and the commit metadata).",
    )
    scheduler_commit_interval_ms: float = Field(
        default=200.0,
        gt=0,
        description="Commit tier offsets at most this often; a restart reads the batches"
        " dispatched since the last commit, so nothing is dispatched twice either way.",
    )

    scheduler_default_model: str | None = Field(
        default=None,
        min_length=1,
        description="The model a request that names none runs on; unset: any worker takes it.",
    )
    scheduler_interactive_fallback_model: str | None = Field(
        default=None,
        min_length=1,
        description="The model an interactive request that names no `fallback_model` may run"
        " on when its deadline cannot be met on its own model's backlog; unset: none.",
    )
    scheduler_background_fallback_model: str | None = Field(
        default=None,
        min_length=1,
        description="The same for background requests; unset: none.",
    )
    scheduler_unknown_model_after_ms: float = Field(
        default=3000.0,
        ge=0,
        description="A request naming a model no known worker serves is refused"
        " (`invalid_request`) only once the scheduler has read heartbeats this long.",
    )
    scheduler_model_load_s: float = Field(
        default=60.0,
        gt=0,
        description="A model's load time (worker process start to ready) until one of its"
        " workers has measured it (heartbeats carry it): a request for a model with no live"
        " worker whose deadline cannot wait this long is refused `overloaded`, with this as"
        " its `retry_after_ms`; the others are held while a worker starts.",
    )

    # Canaries (ADR 0058): each variant's window against its baseline's.
    scheduler_canary_window_s: float = Field(
        default=60.0,
        gt=0,
        description="The sliding window a canary is judged over (its workers' outcomes and"
        " its shadow scores), seconds.",
    )
    scheduler_canary_min_requests: int = Field(
        default=50,
        ge=1,
        description="Requests a variant and its baseline must each have ended in the window"
        " before their TTFT p99 and error rates are compared (and a promotion allowed).",
    )
    scheduler_canary_min_scores: int = Field(
        default=20,
        ge=1,
        description="Shadow scores a variant must have in the window before its quality is"
        " compared with the baseline's.",
    )
    scheduler_canary_ttft_p99_ratio: float = Field(
        default=1.5,
        gt=1.0,
        description="A variant regresses on latency when its TTFT p99 is above the baseline's"
        " times this (and by more than scheduler_canary_ttft_min_excess_ms).",
    )
    scheduler_canary_ttft_min_excess_ms: float = Field(
        default=100.0,
        ge=0,
        description="A variant regresses on latency only if its TTFT p99 is also this much"
        " above the baseline's (a few ms more on a fast model is noise, not a regression).",
    )
    scheduler_canary_error_rate_excess: float = Field(
        default=0.02,
        ge=0,
        le=1,
        description="A variant regresses on errors when its error rate (`internal` errors"
        " over requests ended) is above the baseline's by more than this (0.02: 2 points).",
    )
    scheduler_canary_quality_drop: float = Field(
        default=0.1,
        ge=0,
        le=1,
        description="A variant regresses on quality when its mean shadow score is below the"
        " baseline's (1 where the baseline is the gold) by more than this.",
    )
    scheduler_canary_rollback: bool = Field(
        default=True,
        description="Roll a regressed variant back (its share to 0 on the variants topic);"
        " false: judge, publish and count only.",
    )
    scheduler_canary_judge_ms: float = Field(
        default=1000.0, gt=0, description="How often the canaries are judged."
    )
    scheduler_canary_publish_s: float = Field(
        default=5.0,
        gt=0,
        description="Verdicts are written to the verdicts topic when one changes, and this"
        " often while none does (what `tokenbus models status` shows).",
    )

    @model_validator(mode="after")
    def _valid_policy(self) -> SchedulerSettings:
        self.policy_config()  # raises ValueError on inconsistent limits
        return self

    def policy_config(self) -> PolicyConfig:
        return PolicyConfig(
            tiers={
                Tier.interactive: TierLimits(
                    self.scheduler_interactive_max_batch_size,
                    self.scheduler_interactive_max_batch_tokens,
                    self.scheduler_interactive_max_wait_ms,
                ),
                Tier.background: TierLimits(
                    self.scheduler_background_max_batch_size,
                    self.scheduler_background_max_batch_tokens,
                    self.scheduler_background_max_wait_ms,
                ),
            },
            background_aging_ms=self.scheduler_background_aging_ms,
            background_min_share=self.scheduler_background_min_share,
            fill_from_other_tier=self.scheduler_fill_from_other_tier,
            batching=self.scheduler_batching,
            bucket_edges=self.scheduler_bucket_edges,
            fair_share=self.scheduler_fair_share,
            tenant_weights=dict(self.scheduler_tenant_weights),
            unserved_hold_s=self.scheduler_unserved_hold_s,
            interactive_reserve=self.scheduler_interactive_reserve,
        )

    def canary_rule(self) -> CanaryRule:
        return CanaryRule(
            window_s=self.scheduler_canary_window_s,
            min_requests=self.scheduler_canary_min_requests,
            min_scores=self.scheduler_canary_min_scores,
            ttft_p99_ratio=self.scheduler_canary_ttft_p99_ratio,
            ttft_min_excess_s=self.scheduler_canary_ttft_min_excess_ms / 1000.0,
            error_rate_excess=self.scheduler_canary_error_rate_excess,
            quality_drop=self.scheduler_canary_quality_drop,
        )

    def fallback_model(self, tier: Tier) -> str | None:
        """The tier's configured fallback model, for requests that name none."""
        if tier is Tier.interactive:
            return self.scheduler_interactive_fallback_model
        return self.scheduler_background_fallback_model

    def departure_rule(self) -> DepartureRule:
        if self.scheduler_policy == "adaptive":
            return AdaptiveRule(
                CostModel(
                    self.scheduler_adaptive_per_request_ms / 1000.0,
                    self.scheduler_adaptive_per_batch_ms / 1000.0,
                )
            )
        return FixedRule()

    def router(self) -> Router:
        return Router(
            self.scheduler_routing,
            load_factor=self.scheduler_routing_load_factor,
            hold_s={
                Tier.interactive: self.scheduler_affinity_hold_ms / 1000.0,
                Tier.background: self.scheduler_affinity_hold_background_ms / 1000.0,
            },
        )
