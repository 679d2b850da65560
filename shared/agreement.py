"""How far two answers to the same request agree: exact match, token F1 and ROUGE-L.

Used where one answer is the reference (the gold variant's in shadow validation, the
reference variant's in `tokenbus eval`) and the other is judged against it:

- `exact`: the texts are equal once runs of whitespace are made one space and the ends
  trimmed (a model's answers differ in nothing else when it is deterministic).
- `f1`: token-level F1 as SQuAD scores it (Rajpurkar et al. 2016, the official v1.1 script):
  lower-cased, punctuation and the articles a/an/the dropped, the tokens' multiset overlap.
- `rouge_l`: the ROUGE-L F-measure (Lin 2004: the longest common subsequence of tokens), by
  Google's `rouge-score` package, on lower-cased word tokens (any script's: its default
  tokenizer keeps only ASCII letters and digits, which would score other languages 0).
- `embedding`: where an embedding model is configured (shared/embeddings.py), the cosine
  similarity of the two texts' embeddings, -1 to 1; None otherwise.
- `quality`: the one number rollbacks and metrics compare: `exact` as 1.0 or 0.0 for a
  deterministic request (greedy or seeded: a faithful variant gives the same text), else
  `embedding` (below 0 counted as 0) where there is one, else `rouge_l` (sampled answers
  differ in wording even when both are right; an embedding tells a paraphrase from a
  wrong answer better than shared words do).

Two texts that both have no tokens agree (1.0); one empty against one not scores 0.0.
ROUGE-L reads the first `MAX_LCS_WORDS` words of each text: its longest common subsequence
costs the product of the two lengths (about 0.2 s at 1,000 words each, 1.2 s at 2,000).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from functools import cache

from pydantic import Field
from rouge_score import rouge_scorer

from shared.messages import Model

MAX_LCS_WORDS = 1000
_WORD = re.compile(r"\w+")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


class Agreement(Model):
    """How a candidate answer agrees with the reference answer to the same request."""

    exact: bool = Field(description="Equal text, whitespace aside.")
    f1: float = Field(ge=0.0, le=1.0, description="Token-level F1, SQuAD style.")
    rouge_l: float = Field(ge=0.0, le=1.0, description="ROUGE-L F-measure.")
    embedding: float | None = Field(
        default=None,
        ge=-1.0,
        le=1.0,
        description="Cosine similarity of the texts' embeddings; None: no embedding model.",
    )
    quality: float = Field(
        ge=0.0,
        le=1.0,
        description="Exact match (1 or 0) if deterministic, else the embedding similarity"
        " (at least 0) where there is one, else rouge_l.",
    )


def score(
    reference: str, candidate: str, *, deterministic: bool, embedding: float | None = None
) -> Agreement:
    """`candidate` judged against `reference`; `deterministic`: the request was greedy
    (temperature 0) or seeded, so a faithful model repeats the reference exactly;
    `embedding`: the texts' embedding similarity, where an embedding model gave one."""
    exact = _squash(reference) == _squash(candidate)
    rouge_l = _rouge_l(reference, candidate)
    if deterministic:
        quality = 1.0 if exact else 0.0
    else:
        quality = rouge_l if embedding is None else max(0.0, embedding)
    return Agreement(
        exact=exact,
        f1=token_f1(reference, candidate),
        rouge_l=rouge_l,
        embedding=embedding,
        quality=quality,
    )


def token_f1(reference: str, candidate: str) -> float:
    """SQuAD's token F1: symmetric in its two texts."""
    ref, cand = _squad_tokens(reference), _squad_tokens(candidate)
    if not ref or not cand:
        return 1.0 if ref == cand else 0.0
    common = sum((Counter(ref) & Counter(cand)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(cand), common / len(ref)
    return 2 * precision * recall / (precision + recall)


class _WordTokenizer:
    """rouge-score's tokenizer interface (`tokenize`), on words of any script."""

    def tokenize(self, text: str) -> list[str]:
        return _words(text)[:MAX_LCS_WORDS]


@cache
def _scorer() -> rouge_scorer.RougeScorer:
    return rouge_scorer.RougeScorer(["rougeL"], tokenizer=_WordTokenizer())


def _rouge_l(reference: str, candidate: str) -> float:
    if not _words(reference) or not _words(candidate):
        return 1.0 if _words(reference) == _words(candidate) else 0.0
    measure = float(_scorer().score(reference, candidate)["rougeL"].fmeasure)
    return min(1.0, max(0.0, measure))


def _squash(text: str) -> str:
    return " ".join(text.split())


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _squad_tokens(text: str) -> list[str]:
    text = _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION))
    return text.split()
