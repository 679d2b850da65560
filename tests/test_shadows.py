"""Shadow validation's decisions (ADR 0057): the scheduler's sampling, the worker's gold run
and score, the sim's wrong share, the rollout's shadow config and `tokenbus models shadow`'s
bad input. The whole path over a real broker: tests/test_shadow_stack.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from aiokafka import TopicPartition
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import REGISTRY, CollectorRegistry
from pydantic import ValidationError

from services.scheduler.admission import Waiting
from services.scheduler.scores import ScoreMetrics, parse
from services.scheduler.shadows import gold_for, sampled, shadowed
from services.scheduler.variants import Rollouts
from services.worker import shadow as shadow_module
from services.worker.engines.base import EngineFinish, EngineRequest
from services.worker.engines.sim import SimEngine
from services.worker.engines.sim_wrong import answers_wrong
from services.worker.outbox import Ticket
from services.worker.shadow import (
    GOLD_DEADLINE_MS,
    GOLD_TIER,
    Shadows,
    gold_request_id,
    gold_run,
    shadow_score,
    writes_counter,
)
from shared.messages import (
    REQUEST_ID,
    DoneResult,
    Judged,
    QueuedRequest,
    ReplyTo,
    Timings,
    Usage,
)
from shared.shadows import ShadowScore
from shared.topics import Topics
from shared.variants import ModelRollout, Shadow, Variant
from tests.factories import queued_request
from tokenbus.cli import main as tokenbus_main
from tokenbus.models_cli import _print as print_statuses
from tokenbus.models_cli import shadow_line, statuses

TOPICS = Topics("t")
SHADOW_TO = ReplyTo(topic=TOPICS.shadow)


def rollout(percent: float = 100.0, gold: str = "baseline") -> Rollouts:
    rollouts = Rollouts()
    rollouts.apply(
        "m",
        ModelRollout(
            model="m",
            variants=[Variant(name="fp8", percent=50.0)],
            shadow=Shadow(gold=gold, percent=percent),
        ),
    )
    return rollouts


def waiting(request: QueuedRequest) -> Waiting:
    return Waiting(request, TopicPartition("t.requests.interactive", 0), 0)


def done(finish_reason: str = "stop") -> DoneResult:
    return DoneResult.model_validate(
        {
            "request_id": "r1",
            "seq": 2,
            "finish_reason": finish_reason,
            "usage": Usage(prompt_tokens=1, completion_tokens=2),
            "timings": Timings(queue_ms=0, batch_size=1, ttft_ms=1, total_ms=2),
        }
    )


# -- the scheduler's sampling ---------------------------------------------------------------


def test_sampled_share_follows_the_percent_and_is_stable_per_request() -> None:
    ids = [f"req-{i}" for i in range(4000)]
    share = sum(sampled(i, 25.0) for i in ids) / len(ids)
    assert 0.22 < share < 0.28
    assert [sampled(i, 25.0) for i in ids] == [sampled(i, 25.0) for i in ids]
    assert not any(sampled(i, 0.0) for i in ids)
    assert all(sampled(i, 100.0) for i in ids)


@given(st.text(alphabet="abcdef0123456789-", min_size=1, max_size=40), st.floats(0, 100))
def test_a_larger_percent_keeps_every_request_a_smaller_one_sampled(rid: str, p: float) -> None:
    if sampled(rid, p):
        assert sampled(rid, min(100.0, p + 10.0))


def test_a_request_on_another_variant_than_the_gold_is_marked() -> None:
    w = shadowed(waiting(queued_request(model="m")), rollout(), "m", "fp8")
    assert w.request.shadow_gold == "baseline"
    on_gold = shadowed(waiting(queued_request(model="m")), rollout(gold="fp8"), "m", "fp8")
    assert on_gold.request.shadow_gold is None  # its answer is the gold's own
    on_baseline = shadowed(waiting(queued_request(model="m")), rollout(gold="fp8"), "m", None)
    assert on_baseline.request.shadow_gold == "fp8"


def test_what_is_never_sampled() -> None:
    shadow = Shadow(gold="baseline", percent=100.0)
    assert gold_for(queued_request(), shadow, "fp8") == "baseline"
    assert gold_for(queued_request(), None, "fp8") is None  # no shadow configured
    assert gold_for(queued_request(variant="fp8"), shadow, "fp8") is None  # pinned (eval, gold)
    assert gold_for(queued_request(cascade_step=0), shadow, "fp8") is None  # a route's
    assert gold_for(queued_request(), Shadow(gold="baseline", percent=0.0), "fp8") is None
    w = waiting(queued_request())
    assert shadowed(w, rollout(), None, "fp8") is w  # no model
    assert shadowed(w, Rollouts(), "m", "fp8") is w  # no rollout


# -- the worker's gold run and score ----------------------------------------------------------


def test_gold_run_is_a_pinned_background_copy_that_carries_the_answer() -> None:
    request = queued_request(
        "abc",
        model="m",
        shadow_gold="baseline",
        deadline_ms=500,
        attempt=2,
        cache_key="0" * 64,
        trace={"traceparent": "x"},
        temperature=0.0,
    )
    run = gold_run(request, "the answer", model="m", variant="fp8", reply_to=SHADOW_TO, now=7.0)
    assert run is not None
    assert run.request_id == "abc:gold"
    assert (run.variant, run.shadow_gold, run.tier, run.reply_to) == (
        "baseline",
        None,
        GOLD_TIER,
        SHADOW_TO,
    )
    assert run.judged == Judged(request_id="abc", model="m", variant="fp8", text="the answer")
    assert (run.deadline_ms, run.attempt, run.cache, run.cache_key, run.trace) == (
        GOLD_DEADLINE_MS,
        0,
        False,
        None,
        {},
    )
    assert (run.created_at, run.prompt, run.temperature) == (7.0, "hi", 0.0)
    # What it is on the wire reads back whole, as the scheduler's admission reads it.
    again = QueuedRequest.model_validate_json(run.model_dump_json())
    assert again.judged == run.judged
    assert not again.cacheable


def test_no_gold_run_where_none_is_due() -> None:
    def run(request: QueuedRequest, variant: str | None) -> QueuedRequest | None:
        return gold_run(request, "x", model="m", variant=variant, reply_to=SHADOW_TO, now=1.0)

    marked = queued_request(model="m", shadow_gold="baseline")
    assert run(marked, "fp8") is not None
    assert run(queued_request(model="m"), "fp8") is None  # not marked
    assert run(marked, None) is None  # its variant fell back: the gold answered it itself
    assert run(queued_request(model="other", shadow_gold="baseline"), "fp8") is None  # fallback
    judged = Judged(request_id="r", model="m", text="x")
    gold = queued_request(model="m", shadow_gold="baseline", judged=judged)
    assert run(gold, "fp8") is None  # a gold run is not sampled again


@given(st.from_regex(REQUEST_ID, fullmatch=True))
def test_gold_request_ids_are_request_ids(rid: str) -> None:
    gold = gold_request_id(rid)
    assert queued_request(gold).request_id == gold  # valid under REQUEST_ID
    assert gold != rid
    assert gold_request_id(rid) == gold


def test_a_gold_run_scores_its_own_answer_against_the_judged_one() -> None:
    judged = Judged(request_id="abc", model="m", variant="fp8", text="a b c d")
    gold = queued_request("abc:gold", variant="baseline", judged=judged, temperature=0.0)
    scored = shadow_score(gold, "a b c e", variant=None, now=9.0)
    assert scored is not None
    assert (scored.model, scored.variant, scored.gold, scored.request_id) == (
        "m",
        "fp8",
        "baseline",
        "abc",
    )
    assert (scored.exact, scored.quality, scored.deterministic, scored.scored_at) == (
        False,
        0.0,
        True,
        9.0,
    )
    assert scored.rouge_l == pytest.approx(0.75)
    sampled_gold = gold.model_copy(update={"temperature": 0.7})
    loose = shadow_score(sampled_gold, "a b c e", variant=None, now=9.0)
    assert loose is not None
    assert loose.quality == pytest.approx(0.75)  # ROUGE-L where it is not deterministic
    assert shadow_score(queued_request(), "x", variant=None, now=9.0) is None


@dataclass
class FakeOutbox:
    """Records what is put, as the result outbox would queue it (a fake: no Kafka)."""

    put_records: list[tuple[ReplyTo, bytes, bytes]] = field(default_factory=list)
    tickets: list[Ticket] = field(default_factory=list)

    def put(
        self, reply_to: ReplyTo, key: bytes, value: bytes, headers: object, ticket: Ticket
    ) -> None:
        self.put_records.append((reply_to, key, value))
        self.tickets.append(ticket)


def shadows(outbox: FakeOutbox, variant: str | None) -> Shadows:
    return Shadows(outbox, TOPICS, "m", variant, clock=lambda: 5.0)  # type: ignore[arg-type]


async def test_shadows_writes_a_gold_run_after_a_marked_answer() -> None:
    outbox = FakeOutbox()
    marked = queued_request("abc", model="m", shadow_gold="baseline")
    assert Shadows.keeps(marked)
    await shadows(outbox, "fp8").answered(marked, ["the ", "answer"], done())
    [(to, key, value)] = outbox.put_records
    assert (to, key) == (ReplyTo(topic=TOPICS.tier(GOLD_TIER)), b"abc:gold")
    run = QueuedRequest.model_validate_json(value)
    assert run.judged is not None
    assert run.judged.text == "the answer"
    outbox.tickets[0].failed(RuntimeError("broker away"))  # logged and counted, nothing raised


async def test_shadows_writes_a_score_after_a_gold_run_and_nothing_for_others() -> None:
    outbox = FakeOutbox()
    judged = Judged(request_id="abc", model="m", variant="fp8", text="same")
    gold = queued_request("abc:gold", variant="baseline", judged=judged, seed=3)
    await shadows(outbox, None).answered(gold, ["same"], done())
    [(to, key, value)] = outbox.put_records
    assert (to, key) == (ReplyTo(topic=TOPICS.scores), b"m")
    score = ShadowScore.model_validate_json(value)
    assert (score.quality, score.exact, score.gold, score.variant) == (1.0, True, "baseline", "fp8")
    plain = queued_request(model="m")
    assert not Shadows.keeps(plain)
    await shadows(outbox, None).answered(plain, ["x"], done())
    await shadows(outbox, None).answered(gold, ["x"], done("cancelled"))
    assert len(outbox.put_records) == 1


async def test_a_shadow_failure_never_reaches_the_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("scorer broke")

    monkeypatch.setattr(shadow_module, "shadow_score", broken)
    writes_counter()  # registered before the first sample is read
    labels = {"kind": "score", "outcome": "failed"}
    before = REGISTRY.get_sample_value("tokenbus_worker_shadow_writes_total", labels) or 0.0
    judged = Judged(request_id="abc", model="m", variant="fp8", text="same")
    gold = queued_request("abc:gold", variant="baseline", judged=judged)
    outbox = FakeOutbox()
    await shadows(outbox, None).answered(gold, ["same"], done())  # returns, raises nothing
    assert outbox.put_records == []
    assert REGISTRY.get_sample_value("tokenbus_worker_shadow_writes_total", labels) == before + 1


# -- the scheduler's scores reader ---------------------------------------------------------


def test_score_records_parse_or_say_why() -> None:
    score = ShadowScore(
        model="m",
        variant=None,
        gold="fp16",
        request_id="r",
        exact=True,
        f1=1.0,
        rouge_l=1.0,
        quality=1.0,
        deterministic=True,
    )
    assert parse(score.model_dump_json().encode()) == score
    assert isinstance(parse(b"{}"), str)
    assert isinstance(parse(None), str)


def test_score_metrics_count_per_variant() -> None:
    registry = CollectorRegistry()
    metrics = ScoreMetrics.build(registry)
    base = {"model": "m", "gold": "baseline", "request_id": "r", "f1": 0.5, "rouge_l": 0.5}
    for quality in (1.0, 0.0, 1.0):
        metrics.observe(
            ShadowScore.model_validate(
                {
                    **base,
                    "variant": "fp8",
                    "exact": quality == 1.0,
                    "quality": quality,
                    "deterministic": True,
                }
            )
        )
    labels = {"model": "m", "variant": "fp8"}
    assert registry.get_sample_value("tokenbus_scheduler_shadow_quality_count", labels) == 3
    assert registry.get_sample_value("tokenbus_scheduler_shadow_quality_sum", labels) == 2.0
    exact = {**labels, "gold": "baseline", "exact": "true"}
    assert registry.get_sample_value("tokenbus_scheduler_shadow_scores_total", exact) == 2


# -- the sim's wrong share ---------------------------------------------------------------


async def answer(engine: SimEngine, prompt: str) -> str:
    text = ""
    request = EngineRequest(request_id=prompt, prompt=prompt, max_tokens=40, temperature=0.0)
    async for out in engine.generate(request):
        if isinstance(out, EngineFinish):
            break
        text += out.text
    return text


async def test_sim_wrong_share_answers_exactly_the_hashed_prompts_otherwise() -> None:
    faithful, wrong = SimEngine(), SimEngine(wrong_share=0.5)
    await faithful.start()
    await wrong.start()
    try:
        prompts = [f"question {i}" for i in range(40)]
        got = await asyncio.gather(*(answer(e, p) for p in prompts for e in (faithful, wrong)))
        differs = {p for i, p in enumerate(prompts) if got[2 * i] != got[2 * i + 1]}
        expected = {p for p in prompts if answers_wrong(p, 0.5)}
        assert differs == expected
        assert 10 < len(expected) < 30
        assert all(got)  # a wrong answer is still an answer
    finally:
        await faithful.stop()
        await wrong.stop()


def test_wrong_share_zero_is_never_wrong() -> None:
    assert not any(answers_wrong(f"p{i}", 0.0) for i in range(100))
    assert all(answers_wrong(f"p{i}", 1.0) for i in range(100))


# -- the rollout's shadow, and the CLI's bad input -----------------------------------------


def test_rollout_keeps_its_shadow_through_a_variant_change_and_omits_none() -> None:
    with_shadow = ModelRollout(model="m", shadow=Shadow(gold="baseline", percent=10))
    changed = with_shadow.with_variant(Variant(name="fp8", percent=5), now=1.0)
    assert changed.shadow == with_shadow.shadow
    assert "shadow" not in json.loads(ModelRollout(model="m").model_dump_json())
    assert changed.with_shadow(None, now=2.0).shadow is None
    with pytest.raises(ValidationError):
        Shadow(gold="baseline", percent=101)
    with pytest.raises(ValidationError):
        Shadow(gold="no spaces", percent=1)


@pytest.mark.parametrize(
    "argv",
    [
        ["models", "shadow", "m", "--gold", "baseline", "--percent", "150"],
        ["models", "shadow", "m", "--gold", "bad name", "--percent", "5"],
        ["models", "shadow", "m", "--gold", "baseline", "--percent", "nan"],
    ],
)
def test_models_shadow_refuses_bad_input_with_exit_2(
    argv: Sequence[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert tokenbus_main(list(argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("tokenbus models shadow: ")


def test_models_status_shows_the_shadow(capsys: pytest.CaptureFixture[str]) -> None:
    rollouts = rollout(percent=12.5, gold="baseline")
    [found] = statuses(rollouts, [])
    assert found.as_json()["shadow"] == {"gold": "baseline", "percent": 12.5}
    print_statuses([found])
    assert (
        "  shadow: 12.5 % of requests not on baseline also run on it\n" in capsys.readouterr().out
    )
    assert shadow_line(None) == "shadow validation off"
