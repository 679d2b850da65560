"""The record of shadow validation: how a variant's answer agreed with its gold's (ADR 0057).

A request sampled for shadow validation (services/scheduler/shadows.py) is answered as
usual; the worker that answered it then queues a copy pinned to the model's gold variant,
carrying the answer (`QueuedRequest.judged`: services/worker/shadow.py). The gold worker
scores the two (shared/agreement.py, its own answer the reference) and writes a
`ShadowScore` to the scores topic, keyed by model; every scheduler reads them into
per-variant quality metrics and its canary windows (services/scheduler/scores.py).
"""

from __future__ import annotations

import time

from pydantic import Field

from shared.agreement import Agreement
from shared.messages import REQUEST_ID, VARIANT_NAME, Model


class ShadowScore(Model):
    """On the scores topic (keyed by `model`): one answer of a variant scored against its
    gold's answer to the same request."""

    model: str = Field(min_length=1, max_length=200)
    variant: str | None = Field(
        default=None,
        pattern=VARIANT_NAME,
        description="The variant whose answer was judged; None: the baseline.",
    )
    gold: str = Field(
        pattern=VARIANT_NAME, description="The gold variant that answered it again; 'baseline'."
    )
    request_id: str = Field(pattern=REQUEST_ID, description="The judged (original) request.")
    exact: bool
    f1: float = Field(ge=0.0, le=1.0)
    rouge_l: float = Field(ge=0.0, le=1.0)
    embedding: float | None = Field(
        default=None,
        ge=-1.0,
        le=1.0,
        exclude_if=lambda v: v is None,  # readers from before it still read the record
        description="Cosine similarity of the two answers' embeddings, where the gold worker"
        " has an embedding model (shared/embeddings.py); absent otherwise.",
    )
    quality: float = Field(
        ge=0.0,
        le=1.0,
        description="Exact match (1 or 0) if deterministic, else the embedding similarity"
        " (at least 0) where there is one, else rouge_l.",
    )
    deterministic: bool = Field(description="The request was greedy or seeded.")
    scored_at: float = Field(default_factory=time.time, description="Unix time, seconds.")
    tenant: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        exclude_if=lambda v: v is None,  # readers from before it still read the record
        description="Whose request it was: no tenant is more than `canary_tenant_share` of a"
        " window's scores (shared/tenant_share.py); absent: counted as one unnamed tenant.",
    )

    @classmethod
    def of(
        cls,
        agreement: Agreement,
        *,
        model: str,
        variant: str | None,
        gold: str,
        request_id: str,
        deterministic: bool,
        scored_at: float,
        tenant: str | None = None,
    ) -> ShadowScore:
        return cls(
            model=model,
            variant=variant,
            gold=gold,
            request_id=request_id,
            deterministic=deterministic,
            scored_at=scored_at,
            tenant=tenant,
            **agreement.model_dump(),
        )
