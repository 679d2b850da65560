"""The sticky weighted choice of a model's variant, the rollout record (shared/variants.py),
and the records that carry a variant (shared/messages.py)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from shared.kafka import encode
from shared.messages import DoneResult, Heartbeat, Timings, Usage
from shared.variants import BASELINE, ModelRollout, Variant, choose

NAMES = st.sampled_from(["canary", "fp8", "v2", "awq", "big-batch"])
KEYS = [f"conversation:{i:016x}" for i in range(2000)]
# Shares as integer percents, the baseline taking the rest (as a rollout has them).
SHARES = st.dictionaries(NAMES, st.integers(0, 100), min_size=1, max_size=4).filter(
    lambda d: sum(d.values()) <= 100
)


def weights_of(shares: dict[str, int]) -> dict[str | None, float]:
    return {None: 100.0 - sum(shares.values()), **{k: float(v) for k, v in shares.items()}}


def tally(weights: dict[str | None, float], keys: list[str] = KEYS) -> dict[str | None, int]:
    counts: dict[str | None, int] = {}
    for key in keys:
        chosen = choose(key, weights)
        counts[chosen] = counts.get(chosen, 0) + 1
    return counts


@settings(max_examples=25, deadline=None)
@given(SHARES)
def test_shares_converge_to_the_weights(shares: dict[str, int]) -> None:
    weights = weights_of(shares)
    counts = tally(weights)
    n = len(KEYS)
    for name, weight in weights.items():
        p = weight / 100.0
        # Binomial: within 5 standard deviations (plus one key) of the expected count.
        bound = 5 * math.sqrt(n * p * (1 - p)) + 1
        assert abs(counts.get(name, 0) - n * p) <= bound, (name, counts, weights)


@settings(max_examples=50, deadline=None)
@given(SHARES)
def test_weight_zero_gets_nothing(shares: dict[str, int]) -> None:
    weights = weights_of(shares)
    counts = tally(weights, KEYS[:500])
    for name, weight in weights.items():
        if weight == 0:
            assert counts.get(name, 0) == 0


@given(SHARES, st.text(min_size=1, max_size=40), st.randoms())
def test_the_same_key_and_weights_choose_alike_in_any_order(
    shares: dict[str, int], key: str, rnd: object
) -> None:
    weights = weights_of(shares)
    items = list(weights.items())
    rnd.shuffle(items)  # type: ignore[attr-defined]
    assert choose(key, dict(items)) == choose(key, weights) == choose(key, weights)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 99), st.integers(1, 100))
def test_a_growing_canary_keeps_its_conversations(before: int, more: int) -> None:
    """Raised from `before` to `after` %, the canary only gains keys (none move away)."""
    after = min(100, before + more)
    old = {key: choose(key, {None: 100.0 - before, "canary": float(before)}) for key in KEYS}
    new = {key: choose(key, {None: 100.0 - after, "canary": float(after)}) for key in KEYS}
    assert all(new[k] == "canary" for k in KEYS if old[k] == "canary")


def test_a_share_of_25_percent_moves_about_a_quarter() -> None:
    keys = [f"conversation:{i:016x}" for i in range(10_000)]
    counts = tally({None: 75.0, "canary": 25.0}, keys)
    assert 0.24 <= counts["canary"] / len(keys) <= 0.26


def test_without_a_positive_weight_the_baseline() -> None:
    assert choose("k", {}) is None
    assert choose("k", {None: 0.0, "canary": 0.0}) is None
    assert choose("k", {None: 0.0, "canary": 100.0}) == "canary"


# -- the record ---------------------------------------------------------------------------------


def test_the_baseline_takes_what_the_variants_leave() -> None:
    rollout = ModelRollout(
        model="m", variants=[Variant(name="a", percent=25), Variant(name="b", percent=10.5)]
    )
    assert rollout.baseline_percent == pytest.approx(64.5)
    assert rollout.weights() == {None: pytest.approx(64.5), "a": 25.0, "b": 10.5}


def test_with_variant_replaces_one_of_the_same_name() -> None:
    rollout = ModelRollout(model="m", variants=[Variant(name="a", percent=25, revision="r1")])
    raised = rollout.with_variant(Variant(name="a", percent=50), now=7.0)
    assert [(v.name, v.percent, v.revision) for v in raised.variants] == [("a", 50.0, None)]
    assert raised.updated_at == 7.0
    assert rollout.variants[0].percent == 25  # the old record is unchanged


@pytest.mark.parametrize(
    ("variants", "error"),
    [
        ([{"name": "a", "percent": 60}, {"name": "b", "percent": 41}], "above 100 %"),
        ([{"name": "a", "percent": 10}, {"name": "a", "percent": 20}], "each name once"),
        ([{"name": BASELINE, "percent": 10}], "without a variant"),
        ([{"name": "a b", "percent": 10}], "pattern"),
        ([{"name": "a", "percent": 101}], "less than or equal to 100"),
        ([{"name": "a", "percent": -1}], "greater than or equal to 0"),
        ([{"name": "a", "percent": "nan"}], "finite number"),
    ],
)
def test_bad_rollouts_are_refused_with_a_clear_error(
    variants: list[dict[str, object]], error: str
) -> None:
    with pytest.raises(ValidationError, match=error):
        ModelRollout.model_validate({"model": "m", "variants": variants})


def test_with_variant_past_100_percent_is_refused() -> None:
    rollout = ModelRollout(model="m", variants=[Variant(name="a", percent=80)])
    with pytest.raises(ValidationError, match="above 100 %"):
        rollout.with_variant(Variant(name="b", percent=30), now=1.0)


# -- the records that carry a variant -----------------------------------------------------------


def test_heartbeats_and_done_records_without_a_variant_read_and_write_as_before() -> None:
    beat = {
        "worker_id": "w",
        "model": "m",
        "total_slots": 4,
        "free_slots": 4,
        "running": 0,
        "queued_tokens": 0,
        "utilisation": 0.0,
    }
    old = Heartbeat.model_validate(beat)  # a worker from before variants
    assert old.variant is None
    assert "variant" not in json.loads(encode(old))
    canary = Heartbeat.model_validate({**beat, "variant": "canary"})
    assert json.loads(encode(canary))["variant"] == "canary"
    with pytest.raises(ValidationError, match="variant"):
        Heartbeat.model_validate({**beat, "variant": "no spaces"})
    done = DoneResult(
        request_id="r",
        seq=1,
        finish_reason="stop",
        usage=Usage(prompt_tokens=1, completion_tokens=1),
        timings=Timings(queue_ms=1, batch_size=1, ttft_ms=1, total_ms=1),
    )
    assert "variant" not in json.loads(encode(done))
    assert json.loads(encode(done.model_copy(update={"variant": "canary"})))["variant"] == "canary"
