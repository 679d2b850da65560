"""Shadow validation on the worker (ADR 0057): a sampled request's gold run, queued once the
user's answer is stored; a gold run's score, written once its own answer is.

Caller: the runner, after a run's `done` is stored (`answered`), and at a run's start
(`keeps`: the run must keep its answer's text). Decide, then act:

1. `gold_run`: a request the scheduler marked (`shadow_gold`) and this worker answered on
   another variant than the gold gets a copy, pinned to the gold (`variant`), with
   `judged` (this answer) and a derived id, on the background tier topic; its stream goes
   to the shadow topic, which nobody reads. No deadline of the user's (its own bound,
   `GOLD_DEADLINE_MS`), no cache, never sampled again.
2. `shadow_score`: a gold run (`judged` set) scores its own answer, the reference, against
   the judged one (shared/agreement.py, in a thread) and writes a `ShadowScore` to the
   scores topic, keyed by model. Where the worker has an embedding model
   (`TOKENBUS_WORKER_EMBEDDING_URL`, shared/embeddings.py), the score has the two answers'
   embedding similarity too; an embedding that fails leaves it out (logged and counted).

Both writes go through the result outbox without waiting, after the user's final record is
stored: they never delay nor fail an answer. A write that fails is logged and counted
(`tokenbus_worker_shadow_writes_total{kind,outcome}`); a gold run or score lost so costs
one sample.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import time
from collections.abc import Callable, Sequence

import structlog
from prometheus_client import Counter

from services.worker.outbox import ResultOutbox
from services.worker.settings import WorkerSettings
from shared.agreement import score
from shared.embeddings import EmbeddingError, EmbeddingSimilarity
from shared.kafka import encode, key_of
from shared.messages import DoneResult, Judged, QueuedRequest, ReplyTo, Tier
from shared.shadows import ShadowScore
from shared.topics import Topics
from shared.variants import BASELINE

log = structlog.get_logger()

GOLD_TIER = Tier.background  # a gold run waits behind every user's request
# A gold whose workers are away does not keep its runs waiting in the backlog for ever.
GOLD_DEADLINE_MS = 300_000
GOLD_SUFFIX = ":gold"
MAX_REQUEST_ID = 128  # shared.messages.REQUEST_ID


def gold_request_id(request_id: str) -> str:
    """The id of `request_id`'s gold run: its id and `:gold`, or, where that would be too
    long, a hash of it (both within shared.messages.REQUEST_ID)."""
    if len(request_id) + len(GOLD_SUFFIX) <= MAX_REQUEST_ID:
        return request_id + GOLD_SUFFIX
    return hashlib.blake2b(request_id.encode(), digest_size=32).hexdigest() + GOLD_SUFFIX


def gold_run(
    request: QueuedRequest,
    text: str,
    *,
    model: str,
    variant: str | None,
    reply_to: ReplyTo,
    now: float,
) -> QueuedRequest | None:
    """The gold run of `request`, answered `text` by this worker (of `model`, `variant`);
    None when there is none to run."""
    gold = request.shadow_gold
    if gold is None or request.judged is not None:
        return None
    if gold == (variant or BASELINE):
        return None  # its variant had no live worker: the gold answered it itself
    if request.model is not None and request.model != model:
        return None  # it ran here as its fallback model: not the model's answer
    judged = Judged(request_id=request.request_id, model=model, variant=variant, text=text)
    return request.model_copy(
        update={
            "request_id": gold_request_id(request.request_id),
            "model": model,
            "variant": gold,
            "shadow_gold": None,
            "judged": judged,
            "tier": GOLD_TIER,
            "reply_to": reply_to,
            "deadline_ms": GOLD_DEADLINE_MS,
            "created_at": now,
            "accepted_at": now,
            "attempt": 0,
            "cache": False,
            "cache_key": None,
            "trace": {},
        }
    )


def shadow_score(
    request: QueuedRequest,
    text: str,
    *,
    variant: str | None,
    now: float,
    embedding: float | None = None,
) -> ShadowScore | None:
    """The score of a gold run that this worker (of `variant`) answered `text` (`embedding`:
    the two answers' embedding similarity, if known); None for any other request."""
    judged = request.judged
    if judged is None:
        return None
    deterministic = request.deterministic
    agreement = score(text, judged.text, deterministic=deterministic, embedding=embedding)
    return ShadowScore.of(
        agreement,
        model=judged.model,
        variant=judged.variant,
        gold=variant or BASELINE,
        request_id=judged.request_id,
        deterministic=deterministic,
        scored_at=now,
        tenant=request.tenant,
    )


@functools.cache
def writes_counter() -> Counter:
    """One per process, on the default registry (as shared/metrics.py's sets are)."""
    return Counter(
        "tokenbus_worker_shadow_writes",
        "Shadow validation's writes (kind: gold_run, a sampled request's run on its gold;"
        " score, a gold run's score) by outcome (stored, failed).",
        ["kind", "outcome"],
    )


@functools.cache
def embeddings_counter() -> Counter:
    return Counter(
        "tokenbus_worker_shadow_embeddings",
        "Shadow validation on a gold worker with an embedding model: the answers' embedding"
        " similarities asked for, by outcome (scored, failed: the score goes without it).",
        ["outcome"],
    )


class Shadows:
    """Caller: the runner (`keeps` at a run's start, `answered` once its done is stored).

    Affects: nothing of its own; it writes through the worker's result outbox.
    """

    def __init__(
        self,
        outbox: ResultOutbox,
        topics: Topics,
        model: str,
        variant: str | None,
        clock: Callable[[], float] = time.time,
        embedding: EmbeddingSimilarity | None = None,
    ) -> None:
        self._embedding = embedding  # None: scores without an embedding similarity
        self._outbox = outbox
        self._tier = ReplyTo(topic=topics.tier(GOLD_TIER))
        self._shadow = ReplyTo(topic=topics.shadow)
        self._scores = ReplyTo(topic=topics.scores)
        self._model = model
        self._variant = variant
        self._clock = clock

    @classmethod
    def of(cls, settings: WorkerSettings, outbox: ResultOutbox, topics: Topics) -> Shadows:
        """A worker's, with the embedding model its settings name (if any)."""
        s = settings
        embedding = (
            None
            if s.worker_embedding_url is None or s.worker_embedding_model is None
            else EmbeddingSimilarity(
                s.worker_embedding_url, s.worker_embedding_model, s.worker_embedding_api_key
            )
        )
        return cls(outbox, topics, s.worker_model, s.worker_variant, embedding=embedding)

    @staticmethod
    def keeps(request: QueuedRequest) -> bool:
        """Whether a run of `request` must keep its answer's text for `answered`."""
        return request.shadow_gold is not None or request.judged is not None

    async def answered(
        self, request: QueuedRequest, chunks: Sequence[str], final: DoneResult
    ) -> None:
        """`request` was answered (`final` stored, its text the `chunks`): queue its gold run
        or its score, if it has one. Scoring runs in a thread (ROUGE-L costs up to ~0.2 s
        on long answers: not on the event loop every stream of this worker shares)."""
        if final.finish_reason == "cancelled" or not self.keeps(request):
            return
        try:
            await self._answered(request, "".join(chunks))
        except Exception:
            # The user's answer is stored already: this costs a sample, never the answer.
            kind = "score" if request.judged is not None else "gold_run"
            writes_counter().labels(kind, "failed").inc()
            log.exception("shadow.failed", kind=kind, request_id=request.request_id)

    async def _answered(self, request: QueuedRequest, text: str) -> None:
        now = self._clock()
        # 1) Decide.
        run = gold_run(
            request,
            text,
            model=self._model,
            variant=self._variant,
            reply_to=self._shadow,
            now=now,
        )
        scored = None
        if request.judged is not None:
            embedding = await self._similarity(request.request_id, text, request.judged.text)
            scored = await asyncio.to_thread(
                shadow_score, request, text, variant=self._variant, now=now, embedding=embedding
            )
        # 2) Act.
        if run is not None:
            ticket = _Counted("gold_run", request.request_id)
            self._outbox.put(self._tier, key_of(run.request_id), encode(run), None, ticket)
        if scored is not None:
            ticket = _Counted("score", scored.request_id)
            self._outbox.put(self._scores, scored.model.encode(), encode(scored), None, ticket)
            log.info(
                "shadow.scored",
                request_id=scored.request_id,
                model=scored.model,
                variant=scored.variant,
                gold=scored.gold,
                quality=round(scored.quality, 4),
                embedding=None if scored.embedding is None else round(scored.embedding, 4),
            )

    async def _similarity(self, request_id: str, reference: str, judged: str) -> float | None:
        if self._embedding is None:
            return None
        try:
            similarity = await self._embedding(reference, judged)
        except EmbeddingError as exc:
            embeddings_counter().labels("failed").inc()
            log.warning("shadow.embedding_failed", request_id=request_id, error=str(exc)[:300])
            return None
        embeddings_counter().labels("scored").inc()
        return similarity


class _Counted:
    """The outbox's ticket for a shadow write: nobody waits for it; each fate is counted, a
    failure logged."""

    def __init__(self, kind: str, request_id: str) -> None:
        self._kind = kind
        self._request_id = request_id

    def stored(self) -> None:
        writes_counter().labels(self._kind, "stored").inc()

    def failed(self, error: BaseException) -> None:
        writes_counter().labels(self._kind, "failed").inc()
        log.warning(
            "shadow.write_failed",
            kind=self._kind,
            request_id=self._request_id,
            error=repr(error)[:300],
        )
