"""max_tokens as vLLM has it (ADR 0051), decided from plain values.

Unset stays unset on the record (the engine generates to the end of the context or a
stop); budgets and quota charges use the configured output estimate instead; a max_tokens
above the model's context is refused, naming both; the quota settles an answer longer
than its charge by taking the rest.
"""

from __future__ import annotations

import json

import pytest
from aiokafka import TopicPartition
from pydantic import ValidationError

from services.edge.auth import request_tokens
from services.edge.gateway import request_record
from services.edge.models import ModelDirectory
from services.edge.protocol import ChatRequestFrame
from services.edge.quotas import Quotas, TenantLimits
from services.scheduler.admission import Admission, Queue
from services.scheduler.settings import SchedulerSettings
from services.worker.engines.base import (
    EngineDelta,
    EngineFinish,
    EngineRequest,
    MaxTokensOverContext,
    PromptTooLong,
    RequestRefused,
    tokens_to_generate,
)
from services.worker.engines.sim import SimEngine
from services.worker.engines.sim_profiles import SimProfile
from shared.context_limits import max_tokens_over_context
from shared.kafka import encode
from shared.messages import (
    MAX_TOKENS_LIMIT,
    ChatRequest,
    Heartbeat,
    QueuedRequest,
    ReplyTo,
    RequestLimits,
    RequestRecord,
    Tier,
)
from shared.settings import TokenbusSettings
from tests.factories import consumer_record

ESTIMATE = 64
LIMITS = RequestLimits(default_max_tokens=ESTIMATE)
REPLY_TO = ReplyTo(topic="t.results", partition=0)


def chat(limits: RequestLimits = LIMITS, **fields: object) -> ChatRequest:
    return ChatRequest.model_validate({"prompt": "hi", **fields}, context={"limits": limits})


# -- the record ---------------------------------------------------------------------------


def test_an_unset_max_tokens_stays_unset_on_the_wire() -> None:
    request = chat()
    assert request.max_tokens is None
    record = request_record(request, request_id="r1", tenant="t", reply_to=REPLY_TO)
    wire = json.loads(encode(record))
    assert wire["max_tokens"] is None
    # Read back anywhere (no limits): still unset, never a default number.
    assert RequestRecord.model_validate(wire).max_tokens is None


def test_the_estimate_is_the_configured_default_and_travels_with_the_request() -> None:
    request = chat()
    assert request.effective_max_tokens == ESTIMATE
    assert chat(max_tokens=7).effective_max_tokens == 7
    assert ChatRequest(prompt="hi").effective_max_tokens == 256  # no limits: the default's
    # The edge's paths build records without validating them again: the estimate goes along.
    record = request_record(request, request_id="r1", tenant="t", reply_to=REPLY_TO)
    assert record.effective_max_tokens == ESTIMATE
    # The tier record (the edge's direct path and ingest build it the same way).
    direct = QueuedRequest.from_record(record, tier=Tier.interactive, prompt_tokens=40)
    assert direct.token_cost == 40 + 64
    queued = QueuedRequest.from_record(record, tier=Tier.interactive, reply_to=REPLY_TO)
    assert queued.effective_max_tokens == ESTIMATE
    # A WebSocket frame's request.
    frame = ChatRequestFrame.model_validate(
        {"type": "chat.request", "prompt": "hi"}, context={"limits": LIMITS}
    )
    assert frame.request().effective_max_tokens == ESTIMATE
    assert request_tokens(frame) == frame.prompt_token_bound() + ESTIMATE


def test_the_scheduler_reads_records_with_its_configured_estimate() -> None:
    settings = SchedulerSettings(default_max_tokens=ESTIMATE)
    admission = Admission(settings.policy_config(), settings.default_max_tokens)
    queued = QueuedRequest(
        request_id="r1", prompt="hi", tier=Tier.interactive, prompt_tokens=40, reply_to=REPLY_TO
    )
    value = encode(queued)
    tp = TopicPartition("t.requests.interactive", 0)
    decision = admission.decide(tp, consumer_record(tp.topic, value), now=queued.created_at)
    assert isinstance(decision, Queue)
    assert decision.waiting.request.token_cost == 40 + ESTIMATE


def test_min_tokens_is_checked_against_max_tokens_only_where_it_is_set() -> None:
    # Unset: the rest of the context, which the engine checks (as vLLM does).
    assert chat(min_tokens=300).min_tokens == 300
    with pytest.raises(ValidationError, match="min_tokens: 300 is above max_tokens \\(200\\)"):
        chat(min_tokens=300, max_tokens=200)


def test_no_cap_by_default_and_the_operators_cap_where_set() -> None:
    assert TokenbusSettings().max_tokens_cap is None
    assert chat(max_tokens=1_000_000).max_tokens == 1_000_000  # the context caps it, later
    with pytest.raises(ValidationError, match=f"at most {MAX_TOKENS_LIMIT}"):
        chat(max_tokens=MAX_TOKENS_LIMIT + 1)
    capped = RequestLimits(max_tokens_cap=100)
    assert chat(capped, max_tokens=100).max_tokens == 100
    with pytest.raises(ValidationError, match="at most 100 \\(the configured cap\\)"):
        chat(capped, max_tokens=101)
    assert chat(capped).max_tokens is None  # unset: no number to cap
    with pytest.raises(ValidationError, match="at least 1"):
        chat(max_tokens=0)


# -- the cap: the model's context ---------------------------------------------------------


def test_max_tokens_above_the_context_is_refused_naming_both() -> None:
    assert max_tokens_over_context(2048, 2048) is None  # the whole context: vLLM takes it
    assert max_tokens_over_context(None, 2048) is None  # unset: the rest of the context
    assert max_tokens_over_context(10**6, None) is None  # no context known: no cap
    why = max_tokens_over_context(2049, 2048)
    assert why is not None
    assert why.startswith("max_tokens: This model's maximum context length is 2048 tokens.")
    assert "you requested 2049 output tokens" in why


def beat(worker: str, model: str, at: float, context: int | None) -> Heartbeat:
    return Heartbeat(
        worker_id=worker,
        model=model,
        sent_at=at,
        max_model_len=context,
        total_slots=4,
        free_slots=4,
        running=0,
        queued_tokens=0,
        utilisation=0.0,
    )


def test_the_context_of_a_request_is_the_smallest_of_the_live_workers_that_may_run_it() -> None:
    models = ModelDirectory(stale_s=10)
    assert models.context_length("a", now=100) is None  # none known: no cap
    models.observe(beat("w1", "a", 100, 4096), 100)
    models.observe(beat("w2", "a", 100, 2048), 100)
    models.observe(beat("w3", "b", 100, 1024), 100)
    models.observe(beat("w4", "b", 100, None), 100)  # an old worker: it does not say
    assert models.context_length("a", now=101) == 2048
    assert models.context_length("b", now=101) == 1024
    assert models.context_length(None, now=101) == 1024  # any live worker may run it
    assert models.context_length("c", now=101) is None
    models.observe(beat("w1", "a", 108, 4096), 108)
    assert models.context_length("a", now=111) == 4096  # w2 went quiet


# -- the worker: how many tokens a request may generate -----------------------------------


def test_tokens_to_generate_is_the_rest_of_the_context_unless_max_tokens_is_less() -> None:
    assert tokens_to_generate(100, None, 2048) == 1948
    assert tokens_to_generate(100, 50, 2048) == 50
    assert tokens_to_generate(2000, 100, 2048) == 48  # stops at the context, as vLLM does
    assert tokens_to_generate(100, 64, None) == 64
    assert tokens_to_generate(2047, None, 2048) == 1


def test_what_the_context_cannot_hold_is_refused_as_the_clients_error() -> None:
    with pytest.raises(MaxTokensOverContext, match="maximum context length is 2048"):
        tokens_to_generate(10, 2049, 2048)
    with pytest.raises(PromptTooLong, match="2048 tokens, all of the model's context"):
        tokens_to_generate(2048, None, 2048)
    with pytest.raises(PromptTooLong, match="longer than the model's context length of 2048"):
        tokens_to_generate(3000, 10, 2048)
    with pytest.raises(RequestRefused, match="max_tokens: required here"):
        tokens_to_generate(10, None, None)


# -- quotas: an answer longer than its charge pays the rest -------------------------------


def test_an_answer_longer_than_the_estimate_is_charged_at_the_settle() -> None:
    now = [0.0]
    quotas = Quotas(clock=lambda: now[0])
    limits = TenantLimits(tokens_per_min=1_200)  # 20 a second
    frame = ChatRequestFrame.model_validate(
        {"type": "chat.request", "prompt": "write a long story"}, context={"limits": LIMITS}
    )
    charged = request_tokens(frame)
    assert charged == frame.prompt_token_bound() + ESTIMATE
    assert quotas.admit("t", limits, "r1", charged) is None
    # The answer ran to 1,000 tokens, far past the estimate: the tenant pays the rest.
    quotas.settle("r1", 1_000 + 30)
    quotas.release("r1")
    # The bucket is 1,200 - 1,030 = 170: a second request of the same charge still fits...
    assert quotas.admit("t", limits, "r2", charged) is None
    quotas.settle("r2", 1_030)
    quotas.release("r2")
    # ...and then the tenant is in debt (-860): the next waits until it is paid back.
    refused = quotas.admit("t", limits, "r3", charged)
    assert refused is not None
    assert refused.limit == "tokens_per_min"
    assert refused.retry_after_ms is not None
    assert refused.retry_after_ms >= (860 + charged) / 20 * 1000 - 1
    now[0] += (860 + charged) / 20 + 0.1
    assert quotas.admit("t", limits, "r3", charged) is None


def test_an_answer_shorter_than_its_charge_gets_the_rest_back() -> None:
    quotas = Quotas(clock=lambda: 0.0)
    limits = TenantLimits(tokens_per_min=1_000)
    assert quotas.admit("t", limits, "r1", 900) is None
    assert quotas.admit("t", limits, "r2", 200) is not None  # 100 left
    quotas.settle("r1", 50)  # 850 back
    quotas.release("r1")
    assert quotas.admit("t", limits, "r2", 950) is None


# -- the sim engine: an unset max_tokens runs to its natural end, or the context's ---------


async def finish_of(engine: SimEngine, request: EngineRequest) -> EngineFinish:
    outputs = [out async for out in engine.generate(request)]
    last = outputs[-1]
    assert isinstance(last, EngineFinish)
    assert sum(o.tokens for o in outputs if isinstance(o, EngineDelta)) == last.completion_tokens
    return last


async def test_the_sim_runs_an_unset_max_tokens_to_the_end_of_its_answer_or_context() -> None:
    engine = SimEngine(SimProfile(token_rate=100_000.0, max_num_seqs=4, context_length=600))
    await engine.start()
    try:
        prompt = "write a long story about a bus"
        # Its answer goes on to 300 tokens (min_tokens), past the old default of 256.
        long = await finish_of(engine, EngineRequest("r1", prompt, None, min_tokens=300))
        assert long.finish_reason == "stop"
        assert long.completion_tokens > 256
        # With no end of its own, it stops at the end of the context.
        endless = await finish_of(engine, EngineRequest("r2", prompt, None, ignore_eos=True))
        assert endless.finish_reason == "length"
        assert endless.prompt_tokens + endless.completion_tokens == 600
        # A max_tokens above the rest of the context stops there too, as vLLM does.
        capped = await finish_of(engine, EngineRequest("r3", prompt, 599, ignore_eos=True))
        assert capped.completion_tokens == endless.completion_tokens
        with pytest.raises(MaxTokensOverContext):
            await finish_of(engine, EngineRequest("r4", prompt, 601))
    finally:
        await engine.stop()
