"""What the batching policy is configured with: per-tier limits and the cross-tier rules."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from shared.messages import Tier

Batching = Literal["pack", "buckets"]


@dataclass(frozen=True)
class TierLimits:
    """One tier's bus rule: a batch leaves when it is full, or its oldest waited enough.

    `max_batch_tokens` bounds the sum of `QueuedRequest.token_cost` (prompt tokens plus
    `max_tokens`): what the batch may occupy in the engine's KV cache at its largest.
    """

    max_batch_size: int
    max_batch_tokens: int
    max_wait_ms: float

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_batch_tokens < 1 or self.max_wait_ms < 0:
            raise ValueError(f"invalid tier limits: {self}")


@dataclass(frozen=True)
class PolicyConfig:
    """Everything the pure policy needs to decide; built from `SchedulerSettings`.

    - `background_aging_ms`: a background request that has waited this long outranks
      interactive ones, so background never starves (its wait bound under saturation)...
    - `background_min_share`: ...as long as background has had less than this share of the
      recently dispatched requests. Under sustained overload someone must wait without
      bound; this keeps it background, while background still gets this share at least.
    - `fill_from_other_tier`: free room in a leaving batch (and on its worker) is filled
      with the other tier's waiting requests, oldest first.
    - `batching`: `pack` keeps one queue per tier (continuous-batching engines such as
      vLLM gain nothing from equal lengths); `buckets` keeps one queue per tier and prompt
      length bucket, so a static-batching engine never pads a short prompt to a long one.
    - `bucket_edges`: upper bounds (prompt tokens, inclusive) of every bucket but the last.
    - `fair_share`: inside a lane, tenants share it by weighted fair queuing on tokens
      (fairness.py); off, requests ride in arrival order.
    - `tenant_weights`: a tenant's share relative to others; unnamed tenants weigh 1.
    - `interactive_reserve`: the share of each worker's slots background requests that have
      not aged may not take: kept free for interactive arrivals, so a batch filling the
      capacity chat leaves does not make chat wait for a slot (issue 39). 0: none.
    - `unserved_hold_s`: a lane (a model, a variant) that no live worker has served for
      this long has its waiting requests answered (`overloaded`) rather than held for ever:
      a pin to a variant no worker declares, a model whose pool cannot start (issue 37, N3).
    """

    tiers: Mapping[Tier, TierLimits]
    background_aging_ms: float = 2000.0
    background_min_share: float = 0.1
    fill_from_other_tier: bool = True
    batching: Batching = "pack"
    bucket_edges: tuple[int, ...] = (256, 1024, 4096)
    fair_share: bool = True
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    unserved_hold_s: float = 600.0
    interactive_reserve: float = 0.0

    def __post_init__(self) -> None:
        missing = [t for t in Tier if t not in self.tiers]
        if missing:
            raise ValueError(f"no limits for tiers {missing}")
        if self.background_aging_ms < self.tiers[Tier.background].max_wait_ms:
            raise ValueError("background_aging_ms must be at least the background max_wait_ms")
        if not 0.0 <= self.background_min_share <= 1.0:
            raise ValueError("background_min_share must lie in [0, 1]")
        if not 0.0 <= self.interactive_reserve < 1.0:
            raise ValueError("interactive_reserve must lie in [0, 1)")
        if list(self.bucket_edges) != sorted(set(self.bucket_edges)):
            raise ValueError("bucket_edges must be strictly increasing")
        if any(not 0 < w < float("inf") for w in self.tenant_weights.values()):
            raise ValueError("tenant weights must be positive and finite")

    @property
    def largest_token_budget(self) -> int:
        return max(limits.max_batch_tokens for limits in self.tiers.values())
