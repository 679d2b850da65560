"""shared/agreement.py: exact match, SQuAD token F1, ROUGE-L and the quality number."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.agreement import MAX_LCS_WORDS, Agreement, score, token_f1

_word = st.text(alphabet="abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=8).filter(
    lambda w: w not in {"a", "an", "the"}
)
_text = st.lists(_word, min_size=1, max_size=30).map(" ".join)


@given(_text, st.booleans())
def test_identical_text_agrees_fully(text: str, deterministic: bool) -> None:
    assert score(text, text, deterministic=deterministic) == Agreement(
        exact=True, f1=1.0, rouge_l=1.0, quality=1.0
    )


@given(st.lists(_word, min_size=1, max_size=20), st.lists(_word, min_size=1, max_size=20))
def test_disjoint_words_agree_not_at_all(left: list[str], right: list[str]) -> None:
    right = [w + "x" for w in right if w + "x" not in left] or ["zzzzzzzzzz"]
    left = [w for w in left if w not in right] or ["yyyyyyyyy"]
    got = score(" ".join(left), " ".join(right), deterministic=False)
    assert (got.exact, got.f1, got.rouge_l, got.quality) == (False, 0.0, 0.0, 0.0)


@given(_text, _text)
def test_f1_and_rouge_l_are_symmetric_and_bounded(a: str, b: str) -> None:
    ab, ba = score(a, b, deterministic=False), score(b, a, deterministic=False)
    assert ab.f1 == pytest.approx(ba.f1)
    assert ab.rouge_l == pytest.approx(ba.rouge_l)
    assert 0.0 <= ab.f1 <= 1.0
    assert 0.0 <= ab.rouge_l <= 1.0


@given(_text, _text)
def test_quality_is_exact_match_when_deterministic_else_rouge_l(a: str, b: str) -> None:
    det, sampled = score(a, b, deterministic=True), score(a, b, deterministic=False)
    assert det.quality == (1.0 if det.exact else 0.0)
    assert sampled.quality == sampled.rouge_l


def test_whitespace_alone_does_not_break_an_exact_match() -> None:
    got = score("The bus  leaves\nnow.", " The bus leaves now. ", deterministic=True)
    assert got.exact
    assert got.quality == 1.0


def test_a_changed_word_fails_exact_match_but_keeps_most_overlap() -> None:
    got = score(
        "the bus leaves when it is full", "the bus waits when it is full", deterministic=True
    )
    assert not got.exact
    assert got.quality == 0.0
    # SQuAD drops "the": 6 tokens each, 5 shared.
    assert got.f1 == pytest.approx(5 / 6)
    # LCS 6 of 7 words each way.
    assert got.rouge_l == pytest.approx(6 / 7)
    assert score("x y", "x z", deterministic=False).quality == pytest.approx(0.5)


def test_squad_normalisation_ignores_case_punctuation_and_articles() -> None:
    assert token_f1("The Bus, leaves!", "bus leaves") == 1.0
    assert token_f1("x b c", "b c d") == pytest.approx(2 / 3)
    assert token_f1("a b c", "b c d") == pytest.approx(0.8)  # "a" is an article


def test_empty_answers() -> None:
    assert score("", "  ", deterministic=False).rouge_l == 1.0
    assert score("", "", deterministic=True).quality == 1.0
    got = score("", "words", deterministic=False)
    assert (got.f1, got.rouge_l) == (0.0, 0.0)


def test_words_of_other_scripts_are_scored() -> None:
    # rouge-score's default tokenizer would drop these and score 0.
    got = score("автобус уходит сейчас", "автобус уходит позже", deterministic=False)
    assert got.rouge_l == pytest.approx(2 / 3)


def test_rouge_l_reads_a_bounded_prefix_so_long_answers_cost_little() -> None:
    words = [f"w{i % 97}" for i in range(MAX_LCS_WORDS)]
    tail_a, tail_b = " x" * 2000, " y" * 2000
    got = score(" ".join(words) + tail_a, " ".join(words) + tail_b, deterministic=False)
    assert got.rouge_l == 1.0  # what differs lies past the words read (~2.7 s to read all)
    assert not got.exact
    assert got.f1 < 1.0  # F1 (linear) reads everything
