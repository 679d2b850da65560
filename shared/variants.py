"""Model variants: a model's rollout (its variants and their traffic shares) and the sticky
weighted choice of a variant for a conversation.

A served model name has a baseline (its workers that declare no variant) and may have
variants (workers that declare one with TOKENBUS_WORKER_VARIANT: another revision, engine,
quantization or worker group). A `ModelRollout` gives each variant a percentage of the
model's conversations; the baseline takes the rest. Rollouts live on the compacted variants
topic, keyed by model name (`tokenbus models rollout` writes them, every scheduler follows
them: services/scheduler/variants.py).

`choose` is weighted rendezvous hashing (Schindelhauer and Schomaker, "Weighted distributed
hash tables", SPAA 2005): each variant draws an exponential score `-ln(u) / weight` from a
hash of (key, variant) and the lowest score wins, which a variant does with probability
weight / total. The same key and weights always give the same variant on every scheduler,
and when a variant's weight grows (the others' shrink), only keys move to it, none away
from it: a canary raised from 5 % to 25 % keeps its conversations. ADR 0054.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Mapping

from pydantic import Field, field_validator, model_validator

from shared.messages import VARIANT_NAME, Model
from shared.verdicts import RolledBack

# What the model's workers without a variant are called where a name is needed (status,
# metrics, the hash); no variant may take it.
BASELINE = "baseline"
MAX_VARIANTS = 16
_SCALE = 2.0**64


class Variant(Model):
    """One variant of a model: its name, its share of the model's conversations, and what
    sets it apart from the baseline (for whoever reads `tokenbus models status`)."""

    name: str = Field(pattern=VARIANT_NAME, description="As its workers' TOKENBUS_WORKER_VARIANT.")
    percent: float = Field(
        ge=0.0, le=100.0, allow_inf_nan=False, description="Share of conversations, 0-100."
    )
    revision: str | None = Field(default=None, max_length=200)
    engine: str | None = Field(default=None, max_length=64)
    quantization: str | None = Field(default=None, max_length=64)
    worker_group: str | None = Field(default=None, max_length=200)
    rolled_back: RolledBack | None = Field(
        default=None,
        description="Set by the scheduler that rolled the variant back (its share to 0) on a"
        " regression: why and when (ADR 0058); cleared by the next `models rollout` of it.",
    )

    @field_validator("name")
    @classmethod
    def _not_the_baseline(cls, name: str) -> str:
        if name == BASELINE:
            raise ValueError(f"{BASELINE!r} names the model's workers without a variant")
        return name


class Shadow(Model):
    """A model's shadow validation (ADR 0057): `percent` of its requests that run on another
    variant than `gold` are also run on `gold`, and the two answers scored."""

    gold: str = Field(
        pattern=VARIANT_NAME,
        description=f"The variant whose answers are the reference; {BASELINE!r}: the baseline.",
    )
    percent: float = Field(
        ge=0.0,
        le=100.0,
        allow_inf_nan=False,
        description="Share of the model's requests not on the gold also run on it, 0-100.",
    )


class ModelRollout(Model):
    """On the variants topic (compacted, keyed by `model`): one model's variants and shares.

    The baseline's share is what the variants leave (`baseline_percent`).
    """

    model: str = Field(min_length=1, max_length=200)
    variants: list[Variant] = Field(default_factory=list, max_length=MAX_VARIANTS)
    updated_at: float = Field(default_factory=time.time, description="Unix time, seconds.")
    shadow: Shadow | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="Shadow validation (`tokenbus models shadow`); None: off.",
    )

    @model_validator(mode="after")
    def _shares_add_up(self) -> ModelRollout:
        names = [v.name for v in self.variants]
        if len(set(names)) != len(names):
            raise ValueError(f"variants: each name once, not {names}")
        total = sum(v.percent for v in self.variants)
        if total > 100.0 + 1e-9:
            raise ValueError(f"variants: shares add up to {total:g} %, above 100 %")
        return self

    @property
    def baseline_percent(self) -> float:
        return max(0.0, 100.0 - sum(v.percent for v in self.variants))

    def weights(self) -> dict[str | None, float]:
        """Each variant's share by name, the baseline's under None."""
        return {None: self.baseline_percent, **{v.name: v.percent for v in self.variants}}

    def with_variant(self, variant: Variant, now: float) -> ModelRollout:
        """This rollout with `variant` added or replaced (a share of 0 keeps it listed);
        raises ValueError (pydantic's) when the shares would exceed 100 %."""
        rest = [v for v in self.variants if v.name != variant.name]
        variants = [*rest, variant]
        return ModelRollout(model=self.model, variants=variants, updated_at=now, shadow=self.shadow)

    def with_shadow(self, shadow: Shadow | None, now: float) -> ModelRollout:
        """This rollout with its shadow validation set (None: off)."""
        return self.model_copy(update={"shadow": shadow, "updated_at": now})


def choose(key: str, weights: Mapping[str | None, float]) -> str | None:
    """The variant `key` (a conversation's: shared/prefixes.py) goes to: None for the
    baseline. Variants of weight 0 get nothing; without any positive weight, the baseline."""
    best: tuple[float, str] | None = None
    chosen: str | None = None
    for name, weight in weights.items():
        if weight <= 0:
            continue
        label = BASELINE if name is None else name
        digest = hashlib.blake2b(f"{key}\x00{label}".encode(), digest_size=8).digest()
        u = (int.from_bytes(digest, "big") + 0.5) / _SCALE  # in (0, 1)
        score = (-math.log(u) / weight, label)
        if best is None or score < best:
            best, chosen = score, name
    return chosen
