"""Shadow validation's embedding similarity (shared/embeddings.py): the cosine, how it enters
an agreement's quality, the score record, the settings and the errors. Against a real
embedding model: tests/real_engine/test_embedding_shadow.py."""

from __future__ import annotations

import socket

import pytest
from pydantic import ValidationError

from services.worker.settings import WorkerSettings
from shared.agreement import score
from shared.embeddings import EmbeddingError, EmbeddingSimilarity, cosine
from shared.shadows import ShadowScore


def test_cosine_is_the_angle_between_two_vectors() -> None:
    assert cosine([1.0, 0.0], [2.0, 0.0]) == pytest.approx(1.0)
    assert cosine([1.0, 0.0], [0.0, 3.0]) == pytest.approx(0.0)
    assert cosine([1.0, 1.0], [-1.0, -1.0]) == pytest.approx(-1.0)
    assert cosine([0.0, 0.0], [1.0, 0.0]) == 0.0  # no length: no direction
    with pytest.raises(EmbeddingError, match="different lengths"):
        cosine([1.0], [1.0, 2.0])


def test_a_sampled_answers_quality_is_its_embedding_similarity_where_there_is_one() -> None:
    reference, paraphrase = "The capital of France is Paris.", "Paris is France's capital."
    without = score(reference, paraphrase, deterministic=False)
    assert without.embedding is None
    assert without.quality == without.rouge_l
    with_embedding = score(reference, paraphrase, deterministic=False, embedding=0.93)
    assert with_embedding.quality == 0.93
    assert (with_embedding.f1, with_embedding.rouge_l) == (without.f1, without.rouge_l)
    # Below 0 counts as 0 (quality is 0-1); the similarity itself is kept as it was.
    opposite = score(reference, paraphrase, deterministic=False, embedding=-0.2)
    assert (opposite.quality, opposite.embedding) == (0.0, -0.2)
    # A deterministic request's quality stays exact match: a faithful variant repeats it.
    greedy = score(reference, paraphrase, deterministic=True, embedding=0.93)
    assert greedy.quality == 0.0


def test_a_score_without_an_embedding_leaves_the_field_out() -> None:
    """Schedulers from before the field (their models forbid unknown fields) still read it."""
    agreement = score("a b", "a b", deterministic=True)
    fields = {"model": "m", "variant": "v", "gold": "baseline", "request_id": "r1"}
    plain = ShadowScore.of(agreement, **fields, deterministic=True, scored_at=1.0)
    assert "embedding" not in plain.model_dump_json()
    embedded = ShadowScore.of(
        score("a b", "a c", deterministic=False, embedding=0.5),
        **fields,
        deterministic=False,
        scored_at=1.0,
    )
    again = ShadowScore.model_validate_json(embedded.model_dump_json())
    assert (again.embedding, again.quality) == (0.5, 0.5)


def test_the_embedding_url_and_model_go_together(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENBUS_WORKER_EMBEDDING_URL", "http://127.0.0.1:1/v1")
    with pytest.raises(ValidationError, match="go together"):
        WorkerSettings()
    monkeypatch.setenv("TOKENBUS_WORKER_EMBEDDING_MODEL", "embedder")
    assert WorkerSettings().worker_embedding_model == "embedder"
    monkeypatch.setenv("TOKENBUS_WORKER_EMBEDDING_URL", "127.0.0.1:1")
    with pytest.raises(ValidationError, match="http"):
        WorkerSettings()


async def test_texts_without_words_are_not_sent() -> None:
    nowhere = EmbeddingSimilarity("http://127.0.0.1:1/v1", "embedder")
    assert await nowhere("", "  ") == 1.0
    assert await nowhere("...", "an answer") == 0.0


async def test_an_endpoint_that_is_away_is_a_typed_error() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nowhere = EmbeddingSimilarity(f"http://127.0.0.1:{port}/v1", "embedder", timeout_s=2.0)
    with pytest.raises(EmbeddingError, match=f"127.0.0.1:{port}/v1/embeddings"):
        await nowhere("an answer", "another answer")
