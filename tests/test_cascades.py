"""Cascades, the pure parts (ADR 0059): routes and their rules, verifiers, the escalation
decision, the scheduler's step, the sim's refusals, plans on keys, the edge's view."""

from __future__ import annotations

import asyncio
import json
import string
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from aiokafka import TopicPartition
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from services.edge import keys as keyfile
from services.edge.keys import KeyStore
from services.edge.models import ModelDirectory
from services.edge.openai.translate import Identity, SseStream
from services.edge.protocol import AcceptedFrame, DeltaFrame, DoneFrame, ResetFrame
from services.ingest.admission import Admitted, Reason, Rejected, admit
from services.ingest.apps import Apps
from services.scheduler.admission import Waiting
from services.scheduler.cascades import on_route
from services.worker.cascade import Cascade, Escalation, route_ahead
from services.worker.engines.base import EngineFinish
from services.worker.engines.sim_refusals import REFUSAL_TEXT, refusal, refuses
from services.worker.verifiers import Answer, failing, unjudged
from services.worker.verifiers import refuses as opens_with_refusal
from shared.cascades import REFUSAL_PHRASES, Route, RouteRule
from shared.messages import (
    Capabilities,
    ChatRequest,
    ErrorCode,
    ErrorResult,
    Heartbeat,
    QueuedRequest,
    ReplyTo,
    RequestLimits,
    ResetResult,
    Tier,
    Timings,
    Usage,
)
from shared.settings import TokenbusSettings
from shared.topics import Topics
from tests.chat_client import sse_events
from tokenbus.cli import main

AUTO: dict[str, Any] = {
    "cascade": ["small", "large"],
    "verifiers": [{"kind": "refusal"}],
    "rules": [
        {"start": "large", "min_prompt_tokens": 1000},
        {"start": "large", "plans": ["pro"]},
    ],
}


def routes(**named: dict[str, Any]) -> dict[str, Route]:
    return TokenbusSettings(routes=named).routes


def queued(model: str | None = "auto", step: int | None = 0, **fields: Any) -> QueuedRequest:
    return QueuedRequest(
        request_id="r1",
        prompt="why buses?",
        model=model,
        tier=Tier.interactive,
        prompt_tokens=fields.pop("prompt_tokens", 20),
        reply_to=ReplyTo(topic="tb.results", partition=0),
        cascade_step=step,
        **fields,
    )


# -- routes: configuration ----------------------------------------------------------------


def test_a_route_is_read_from_json_as_every_service_reads_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TOKENBUS_ROUTES", json.dumps({"auto": AUTO}))
    route = TokenbusSettings().routes["auto"]
    assert route.cascade == ("small", "large")
    assert route.verifiers[0].kind == "refusal"
    assert route.verifiers[0].phrases == REFUSAL_PHRASES  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("route", "says"),
    [
        ({"cascade": ["small"], "verifiers": [{"kind": "refusal"}]}, "at least 2"),
        ({"cascade": ["a", "a"], "verifiers": [{"kind": "refusal"}]}, "names a model twice"),
        ({"cascade": ["a", "b"], "verifiers": []}, "at least 1"),
        ({"cascade": ["a", "b"], "verifiers": [{"kind": "regex", "pattern": "("}]}, "regular"),
        (
            {"cascade": ["a", "b"], "verifiers": [{"kind": "json_schema", "schema": {"type": 3}}]},
            "not a valid JSON Schema",
        ),
        ({"cascade": ["a", "b"], "verifiers": [{"kind": "length"}]}, "needs min, max"),
        (
            {"cascade": ["a", "b"], "verifiers": [{"kind": "length", "min": 5, "max": 2}]},
            "above max",
        ),
        ({"cascade": ["a", "b"], "verifiers": [{"kind": "logprob", "min_mean": 1}]}, "less than"),
        ({"cascade": ["a", "b"], "verifiers": [{"kind": "vibes"}]}, "does not match any"),
        (
            {"cascade": ["a", "b"], "verifiers": [{"kind": "refusal"}], "rules": [{"start": "c"}]},
            "not in the cascade",
        ),
        (
            {
                "cascade": ["a", "b"],
                "verifiers": [{"kind": "refusal"}],
                "rules": [{"start": "b", "plans": ["no spaces"]}],
            },
            "not a plan name",
        ),
    ],
)
def test_a_bad_route_is_refused_at_start_saying_why(route: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        routes(auto=route)


def test_a_route_may_not_shadow_a_served_model_nor_cascade_over_routes() -> None:
    with pytest.raises(ValidationError, match="also a served model"):
        TokenbusSettings(routes={"small": AUTO}, served_models=("small",))
    nested = {"cascade": ["auto", "large"], "verifiers": [{"kind": "refusal"}]}
    with pytest.raises(ValidationError, match="names routes"):
        routes(auto=AUTO, outer=nested)


def test_rules_pick_the_first_model_by_prompt_length_and_plan() -> None:
    route = routes(auto=AUTO)["auto"]
    assert route.start_step(20, None) == 0
    assert route.start_step(999, "free") == 0
    assert route.start_step(1000, None) == 1  # long prompts go straight to the large model
    assert route.start_step(20, "pro") == 1  # so does the pro plan
    no_plan = RouteRule(start="large", plans=(None,))
    assert no_plan.matches(5, None)
    assert not no_plan.matches(5, "pro")
    bounded = RouteRule(start="large", min_prompt_tokens=10, max_prompt_tokens=20)
    assert [bounded.matches(n, None) for n in (9, 10, 20, 21)] == [False, True, True, False]


# -- the scheduler: which model a route's request runs on -----------------------------------


def waiting(request: QueuedRequest) -> Waiting:
    return Waiting(request, TopicPartition("tb.tier.interactive", 0), 7)


def test_the_scheduler_sets_a_new_requests_step_by_the_rules_and_keeps_a_raised_one() -> None:
    table = routes(auto=AUTO)
    w, model = on_route(waiting(queued(step=None)), "auto", table)
    assert (model, w.request.cascade_step, w.offset) == ("small", 0, 7)
    w, model = on_route(waiting(queued(step=None, plan="pro")), "auto", table)
    assert (model, w.request.cascade_step) == ("large", 1)
    w, model = on_route(waiting(queued(step=None, prompt_tokens=5000)), "auto", table)
    assert (model, w.request.cascade_step) == ("large", 1)
    raised = waiting(queued(step=1))  # escalated by a worker: whatever the rules say
    w, model = on_route(raised, "auto", table)
    assert (model, w) == ("large", raised)


def test_a_request_for_the_default_model_a_route_is_given_its_name() -> None:
    w, model = on_route(waiting(queued(model=None, step=None)), "auto", routes(auto=AUTO))
    assert (model, w.request.model, w.request.cascade_step) == ("small", "auto", 0)


def test_a_model_that_is_no_route_runs_as_named() -> None:
    plain = waiting(queued(model="small", step=None))
    assert on_route(plain, "small", routes(auto=AUTO)) == (plain, "small")
    assert on_route(plain, None, routes(auto=AUTO)) == (plain, None)


# -- verifiers ----------------------------------------------------------------------------


def answer(text: str, tokens: int = 3, logprobs: list[float] | None = None) -> Answer:
    return Answer(text, tokens, logprobs)


def verifiers(*kinds: dict[str, Any]) -> Route:
    return Route.model_validate({"cascade": ["a", "b"], "verifiers": list(kinds)})


def test_json_schema_verifier() -> None:
    schema = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}
    route = verifiers({"kind": "json_schema", "schema": schema})
    assert failing(route.verifiers, answer('{"city": "Oslo"}')) is None
    assert failing(route.verifiers, answer('{"town": "Oslo"}')) == "json_schema"
    assert failing(route.verifiers, answer("Oslo")) == "json_schema"  # not JSON at all


def test_regex_and_length_verifiers() -> None:
    route = verifiers({"kind": "regex", "pattern": r"^\d{4}-\d{2}-\d{2}$"})
    assert failing(route.verifiers, answer("2026-12-02")) is None
    assert failing(route.verifiers, answer("December")) == "regex"
    chars = verifiers({"kind": "length", "min": 3, "max": 5})
    assert [failing(chars.verifiers, answer("x" * n)) for n in (2, 3, 5, 6)] == [
        "length",
        None,
        None,
        "length",
    ]
    tokens = verifiers({"kind": "length", "unit": "tokens", "max": 10})
    assert failing(tokens.verifiers, answer("x" * 100, tokens=10)) is None
    assert failing(tokens.verifiers, answer("x", tokens=11)) == "length"


def test_the_first_failing_verifier_is_the_reason() -> None:
    route = verifiers({"kind": "refusal"}, {"kind": "length", "min": 100})
    assert failing(route.verifiers, answer("I'm sorry, no.")) == "refusal"
    assert failing(route.verifiers, answer("Sure: buses.")) == "length"


@given(
    phrase=st.sampled_from(REFUSAL_PHRASES),
    lead=st.text(alphabet=" \n\t\"'*_>", max_size=4),
    rest=st.text(max_size=40),
    upper=st.booleans(),
)
def test_a_refusal_is_caught_whatever_its_case_and_leading_marks(
    phrase: str, lead: str, rest: str, upper: bool
) -> None:
    opening = phrase.upper() if upper else phrase
    assert opens_with_refusal(lead + opening + rest, REFUSAL_PHRASES)


@given(rest=st.text(alphabet=string.ascii_letters + " ,.", max_size=60))
def test_an_answer_is_no_refusal_unless_it_opens_with_one(rest: str) -> None:
    text = "Buses " + rest
    assert not opens_with_refusal(text, REFUSAL_PHRASES)
    assert opens_with_refusal("I\u2019m sorry, " + rest, REFUSAL_PHRASES)  # a curly apostrophe
    # A refusal phrase later in the answer is no refusal.
    assert not opens_with_refusal(text + " I'm sorry", REFUSAL_PHRASES)


@given(st.lists(st.floats(min_value=-20, max_value=0), min_size=1, max_size=50))
def test_the_logprob_verifier_compares_the_mean(logprobs: list[float]) -> None:
    route = verifiers({"kind": "logprob", "min_mean": -1.5})
    mean = sum(logprobs) / len(logprobs)
    verdict = failing(route.verifiers, answer("text", logprobs=logprobs))
    assert verdict == (None if mean >= -1.5 else "logprob")


def test_an_answer_without_logprobs_is_not_judged_by_the_logprob_verifier() -> None:
    route = verifiers({"kind": "logprob", "min_mean": -0.1})
    assert failing(route.verifiers, answer("sim text")) is None
    assert unjudged(route.verifiers, answer("sim text"))
    assert not unjudged(route.verifiers, answer("text", logprobs=[-0.01]))


# -- the worker's decision ----------------------------------------------------------------


def escalation(table: dict[str, Route], request: QueuedRequest, text: str) -> Escalation | None:
    """What the worker's cascade decides of a finished answer `text` to `request`."""
    cascade = Cascade(table, Topics("t"), cast(Any, None), lambda: 0, 1.0)
    state = SimpleNamespace(
        request=request,
        request_id=request.request_id,
        keep_answer=True,
        chunks=[text],
        logprobs=[],
    )
    finish = EngineFinish(finish_reason="stop", prompt_tokens=3, completion_tokens=3)
    return asyncio.run(cascade.decide(cast(Any, state), finish))


def test_a_failing_answer_goes_on_to_the_next_model_as_the_next_attempt() -> None:
    table = routes(auto=AUTO)
    request = queued(step=0)
    up = escalation(table, request, "I'm sorry, but I can't.")
    assert up is not None
    assert (up.route, up.from_model, up.to_model, up.reason) == (
        "auto",
        "small",
        "large",
        "refusal",
    )
    assert (up.next_attempt.attempt, up.next_attempt.cascade_step) == (1, 1)
    assert up.next_attempt.request_id == request.request_id
    # What the declined answer used goes with it: the tenant spent it (issue 37, N5).
    assert up.used == Usage(prompt_tokens=3, completion_tokens=3)
    reset = ResetResult.before_retry(request, "escalated: refusal", up.used)
    assert (reset.attempt, reset.usage) == (1, up.used)
    assert escalation(table, request, "Buses carry people.") is None


def test_the_last_model_and_requests_of_no_route_always_answer() -> None:
    table = routes(auto=AUTO)
    refusal_text = "I'm sorry."
    assert route_ahead(table, queued(step=1)) is None
    assert escalation(table, queued(step=1), refusal_text) is None
    assert escalation(table, queued(model="small", step=None), refusal_text) is None
    assert escalation(table, queued(step=None), refusal_text) is None  # never queued by a route


def test_a_run_the_engine_failed_goes_on_but_a_request_refused_ends() -> None:
    cascade = Cascade(routes(auto=AUTO), Topics("t"), cast(Any, None), lambda: 0, 1.0)
    state = cast(Any, SimpleNamespace(request=queued(step=0)))
    made = Usage(prompt_tokens=0, completion_tokens=7)  # what the failed run made
    broke = ErrorResult.for_request(
        state.request, ErrorCode.internal, "the engine failed", usage=made
    )
    up = cascade.failed(state, broke)
    assert up is not None
    assert (up.from_model, up.to_model, up.reason) == ("small", "large", "engine_error")
    assert up.used == made
    assert up.next_attempt.cascade_step == 1
    # A request refused (too long, a field not honoured): not an engine failure.
    refused = ErrorResult.for_request(state.request, ErrorCode.invalid_request, "too long")
    assert cascade.failed(state, refused) is None
    last = cast(Any, SimpleNamespace(request=queued(step=1)))  # the cascade's last model
    assert cascade.failed(last, broke) is None


# -- the sim's refusals -------------------------------------------------------------------


def test_the_sim_refuses_a_share_of_prompts_by_their_hash() -> None:
    prompts = [f"prompt {i}" for i in range(2000)]
    assert not any(refuses(p, 0.0) for p in prompts)
    assert all(refuses(p, 1.0) for p in prompts)
    share = sum(refuses(p, 0.3) for p in prompts) / len(prompts)
    assert 0.25 < share < 0.35
    assert [refuses(p, 0.3) for p in prompts] == [refuses(p, 0.3) for p in prompts]
    whole = refusal(100)
    assert (whole.text, whole.finish_reason) == (REFUSAL_TEXT, "stop")
    assert opens_with_refusal(whole.text, REFUSAL_PHRASES)
    assert refusal(3).finish_reason == "length"
    assert refusal(3).completion_tokens == 3


# -- plans: keys, the edge, ingest --------------------------------------------------------


def test_a_keys_plan_is_stored_and_given_to_its_principal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "keys.json"
    assert main(["keys", "--file", str(path), "create", "--tenant", "acme", "--plan", "pro"]) == 0
    key = capsys.readouterr().out.strip().splitlines()[-1]
    principal = KeyStore(path).lookup(key)
    assert principal is not None
    assert principal.plan == "pro"
    assert main(["keys", "--file", str(path), "list"]) == 0
    assert "plan=pro" in capsys.readouterr().out
    keys, plain, _ = keyfile.add_key(keyfile.load(path), "acme", {}, 0.0)
    keyfile.save(path, keys)
    assert (found := KeyStore(path).lookup(plain)) is not None
    assert found.plan is None


def test_a_bad_plan_is_refused_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "keys.json"
    code = main(["keys", "--file", str(path), "create", "--tenant", "a", "--plan", "two words"])
    assert code == 2
    assert "tokenbus keys create:" in capsys.readouterr().err
    assert not path.exists()


TOPICS = Topics("tb")


def test_ingest_keeps_a_trusted_writers_plan_and_refuses_an_apps_claim() -> None:
    raw = b'{"request_id": "r1", "prompt": "hi", "model": "auto", "plan": "pro"}'
    trusted = admit(raw, None, TOPICS, RequestLimits(), set())
    assert isinstance(trusted, Admitted)
    assert trusted.request.plan == "pro"
    app = Apps(TOPICS, ["b"]).of_topic(TOPICS.app_requests("b"))
    claimed = admit(raw, None, TOPICS, RequestLimits(), set(), app=app)
    assert isinstance(claimed, Rejected)
    assert claimed.reason is Reason.plan_forbidden
    unclaimed = admit(
        b'{"request_id": "r1", "prompt": "hi"}', None, TOPICS, RequestLimits(), set(), app=app
    )
    assert isinstance(unclaimed, Admitted)
    assert unclaimed.request.plan is None


def beat(worker: str, model: str, sent_at: float, max_model_len: int) -> Heartbeat:
    return Heartbeat(
        worker_id=worker,
        model=model,
        free_slots=1,
        total_slots=1,
        running=0,
        queued_tokens=0,
        utilisation=0.0,
        sent_at=sent_at,
        max_model_len=max_model_len,
        capabilities=Capabilities(engine=f"engine-{model}", sampling=frozenset({"seed"})),
    )


def test_the_edge_takes_a_route_as_a_model_listed_while_its_cascade_is_served() -> None:
    directory = ModelDirectory(10.0, listening_since=0.0, grace_s=0.0, routes=routes(auto=AUTO))
    asks_auto = ChatRequest(prompt="hi", model="auto")
    assert directory.unknown(asks_auto, 100.0) is None  # no worker yet: still a model
    assert "auto" not in directory.served(100.0)
    directory.observe(beat("w1", "small", 100.0, 4096), 100.0)
    directory.observe(beat("w2", "large", 101.0, 8192), 101.0)
    directory.observe(beat("w3", "other", 99.0, 2048), 99.0)
    assert directory.served(102.0) == {"auto": 100, "large": 101, "other": 99, "small": 100}
    # Either model of its cascade may run it: the smaller context and both engines count.
    assert directory.context_length("auto", 102.0) == 4096
    assert directory.max_model_len(102.0)["auto"] == 4096
    engines = {c.engine for c in directory.capabilities("auto", 102.0)}
    assert engines == {"engine-small", "engine-large"}


def test_the_openai_stream_of_a_route_holds_its_text_until_the_answer_that_stands() -> None:
    stream = SseStream(Identity("chat", "r1", "auto", 1), include_usage=False, hold=True)
    out = stream.take(AcceptedFrame(request_id="r1", resume_token="t", tier=Tier.interactive))
    out += stream.take(DeltaFrame(request_id="r1", seq=0, text="I'm sorry"))
    out += stream.take(ResetFrame(request_id="r1", attempt=1))  # the small answer failed
    assert not stream.cancel
    out += stream.take(DeltaFrame(request_id="r1", seq=0, text="Buses "))
    out += stream.take(DeltaFrame(request_id="r1", seq=1, text="run."))
    out += stream.take(
        DoneFrame(
            request_id="r1",
            finish_reason="stop",
            model="large",
            usage=Usage(prompt_tokens=3, completion_tokens=2),
            timings=Timings(queue_ms=1, batch_size=1, ttft_ms=2, total_ms=3),
        )
    )
    events = [d for _, d in sse_events(out) if isinstance(d, dict)]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text == "Buses run."
    assert {e["model"] for e in events} >= {"large"}
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_tokenbus_up_refuses_a_bad_route_with_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TOKENBUS_ROUTES", json.dumps({"auto": {"cascade": ["a"]}}))
    assert main(["up"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tokenbus up: error: routes.auto.cascade:")
    assert len(err.splitlines()) == 1
