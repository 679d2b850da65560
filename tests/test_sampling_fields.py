"""vLLM's sampling fields: what each engine honours, the edge's decision, the worker's refusal.

Pure parts with plain values; the sim engine runs for real (its own step clock). The whole
path over a real broker is in tests/test_sampling_stack.py.
"""

from __future__ import annotations

import pytest

from services.edge.capabilities import unhonoured
from services.edge.models import ModelDirectory
from services.worker.engines.base import (
    EngineDelta,
    EngineFinish,
    EngineOutput,
    EngineRequest,
    FieldNotHonoured,
)
from services.worker.engines.sim import SimEngine
from services.worker.engines.sim_profiles import SimProfile
from services.worker.engines.sim_text import complete
from services.worker.runner import engine_request
from shared.messages import (
    BASE_SAMPLING,
    SAMPLING_FIELDS,
    Capabilities,
    ChatRequest,
    Heartbeat,
    QueuedRequest,
)

SIM = Capabilities(engine="sim", sampling=SimEngine.sampling_fields)
VLLM = Capabilities(engine="vllm", sampling=SAMPLING_FIELDS)


def chat(**fields: object) -> ChatRequest:
    return ChatRequest.model_validate({"prompt": "hi", "model": "m", **fields})


# -- the request record ---------------------------------------------------------------------


def test_old_records_without_the_fields_still_parse() -> None:
    old = '{"prompt": "hi", "max_tokens": 5, "temperature": 1.0, "top_p": 1.0, "stop": []}'
    request = ChatRequest.model_validate_json(old)
    assert request.sampling_needs() == frozenset()
    assert request.top_k is None
    assert request.logit_bias is None


def test_unset_fields_stay_unset_on_the_wire() -> None:
    wire = chat().model_dump(mode="json")
    assert all(wire[name] is None for name in [*SAMPLING_FIELDS, "temperature", "top_p"])


def test_neutral_values_ask_nothing_of_the_engine() -> None:
    neutral = chat(
        top_k=0,
        min_p=0,
        repetition_penalty=1,
        presence_penalty=0,
        frequency_penalty=0,
        logit_bias={},
        min_tokens=0,
        ignore_eos=False,
        stop_token_ids=[],
    )
    assert neutral.sampling_needs() == frozenset()
    assert chat(top_k=-1).sampling_needs() == frozenset()
    assert chat(top_k=1, seed=0).sampling_needs() == {"top_k", "seed"}


def test_a_queued_request_carries_every_field_to_the_engine_request() -> None:
    fields = dict(
        top_k=5,
        min_p=0.1,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={3: 1.5},
        min_tokens=2,
        ignore_eos=True,
        stop_token_ids=[4],
        seed=7,
    )
    queued = QueuedRequest.model_validate(
        {
            "prompt": "hi",
            "request_id": "r1",
            "tier": "interactive",
            "prompt_tokens": 1,
            "reply_to": {"topic": "t"},
            **fields,
        }
    )
    engine = engine_request(queued)
    assert {k: getattr(engine, k) for k in fields} == {**fields, "stop_token_ids": (4,)}
    assert (engine.temperature, engine.top_p) == (None, None)


# -- the edge's decision ----------------------------------------------------------------------


def test_a_field_no_live_worker_honours_is_refused_naming_it_and_the_engine() -> None:
    message = unhonoured(chat(top_k=5), [SIM])
    assert message is not None
    assert message.startswith("top_k: not supported by the engine serving model 'm' (sim)")


def test_what_some_live_worker_honours_passes() -> None:
    assert unhonoured(chat(seed=3, ignore_eos=True), [SIM]) is None
    assert unhonoured(chat(top_k=5), [SIM, VLLM]) is None
    assert unhonoured(chat(), [SIM]) is None


def test_with_no_live_worker_known_the_worker_decides() -> None:
    assert unhonoured(chat(top_k=5), []) is None


def test_one_worker_must_honour_all_the_fields() -> None:
    only_top_k = Capabilities(engine="other", sampling=frozenset({"top_k"}))
    # Each field has a worker, no worker has both: one the first worker lacks is named.
    message = unhonoured(chat(top_k=5, min_tokens=2), [SIM, only_top_k])
    assert message is not None
    assert message.startswith("top_k:")
    assert "(sim)" in message
    # A field that no worker honours is named before one some worker does.
    message = unhonoured(chat(top_k=5, min_p=0.1), [SIM, only_top_k])
    assert message is not None
    assert message.startswith("min_p:")
    assert "(other, sim)" in message


def test_the_directory_keeps_each_live_workers_capabilities() -> None:
    models = ModelDirectory(stale_s=10.0, listening_since=0.0)
    beat = dict(total_slots=1, free_slots=1, running=0, queued_tokens=0, utilisation=0.0)
    models.observe(
        Heartbeat(worker_id="w1", model="m", sent_at=100.0, capabilities=SIM, **beat), 100.0
    )
    models.observe(
        Heartbeat(worker_id="w2", model="m2", sent_at=100.0, capabilities=VLLM, **beat), 100.0
    )
    # A worker from before capabilities were advertised: the base set, engine unknown.
    models.observe(Heartbeat(worker_id="w3", model="m3", sent_at=100.0, **beat), 100.0)
    assert models.capabilities("m", 101.0) == [SIM]
    assert models.capabilities(None, 101.0) == [SIM, VLLM, models.capabilities("m3", 101.0)[0]]
    (old,) = models.capabilities("m3", 101.0)
    assert (old.engine, old.sampling) == ("unknown", BASE_SAMPLING)
    assert models.capabilities("m", 200.0) == []  # gone quiet: nothing known


def test_an_old_heartbeat_without_capabilities_parses() -> None:
    old = (
        '{"worker_id": "w", "model": "m", "total_slots": 1, "free_slots": 1, "running": 0,'
        ' "queued_tokens": 0, "utilisation": 0.0}'
    )
    assert Heartbeat.model_validate_json(old).capabilities is None


# -- the sim engine ----------------------------------------------------------------------------


def test_the_sim_honours_seed_min_tokens_and_ignore_eos() -> None:
    natural = complete("why", 500)
    assert natural.finish_reason == "stop"
    assert complete("why", 500, seed=1).text != complete("why", 500, seed=2).text
    assert complete("why", 500, seed=1).text == complete("why", 500, seed=1).text
    assert complete("why", 500).text == complete("why", 500, seed=None).text
    longer = complete("why", 500, min_tokens=natural.completion_tokens + 10)
    assert longer.completion_tokens >= natural.completion_tokens + 10
    to_the_end = complete("why", 500, ignore_eos=True)
    assert (to_the_end.completion_tokens, to_the_end.finish_reason) == (500, "length")


def test_min_tokens_holds_off_a_stop_string() -> None:
    words = complete("why", 500).pieces
    stop = words[2].strip()
    assert complete("why", 500, (stop,)).completion_tokens <= 3
    held = complete("why", 500, (stop,), min_tokens=5)
    assert held.completion_tokens >= 5


async def collect(engine: SimEngine, request: EngineRequest) -> list[EngineOutput]:
    return [out async for out in engine.generate(request)]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", 5),
        ("min_p", 0.1),
        ("repetition_penalty", 1.1),
        ("presence_penalty", 0.5),
        ("frequency_penalty", 0.5),
        ("logit_bias", {1: 2.0}),
        ("stop_token_ids", (2,)),
    ],
)
async def test_the_sim_refuses_what_it_cannot_honour(field: str, value: object) -> None:
    engine = SimEngine(SimProfile(token_rate=10_000.0))
    await engine.start()
    try:
        with pytest.raises(FieldNotHonoured) as refused:
            await collect(engine, EngineRequest("r", "hi", 4, **{field: value}))  # type: ignore[arg-type]
        assert str(refused.value).startswith(f"{field}: not supported by the engine")
        assert "(sim)" in str(refused.value)
        # Neutral, it is no refusal: the request runs.
        outputs = await collect(engine, EngineRequest("r2", "hi", 4, seed=3, ignore_eos=True))
        assert isinstance(outputs[-1], EngineFinish)
        assert outputs[-1].completion_tokens == 4
        assert all(isinstance(o, EngineDelta) for o in outputs[:-1])
    finally:
        await engine.stop()
