"""The OpenAI API's pure parts: request mapping, SSE framing, errors, the model directory."""

from __future__ import annotations

import pytest

from services.edge.models import ModelDirectory
from services.edge.openai.errors import HttpError, http_error, unknown_model
from services.edge.openai.schema import ChatCompletionRequest, CompletionRequest
from services.edge.openai.sse import DONE, EventId, parse_event_id
from services.edge.openai.translate import Answer, Identity, SseStream
from services.edge.protocol import (
    AcceptedFrame,
    DeltaFrame,
    DoneFrame,
    ErrorFrame,
    ResetFrame,
)
from shared.messages import (
    ChatRequest,
    ErrorCode,
    Heartbeat,
    Tier,
    Timings,
    Usage,
    unknown_model_message,
)
from tests.chat_client import sse_events
from tests.factories import OPENAI_LIMITS, openai_chat, openai_completion, translated

CHAT = Identity("chat", "r1", "sim-8b", 1700000000)
TEXT = Identity("text", "r1", "sim-8b", 1700000000)


def refused(result: ChatRequest | HttpError, param: str | None = None) -> HttpError:
    assert isinstance(result, HttpError), result
    assert result.status == 400
    assert result.body.error.type == "invalid_request_error"
    if param is not None:
        assert result.body.error.param == param
    return result


# -- requests -----------------------------------------------------------------------------------


def test_chat_maps_sampling_fields_and_extensions() -> None:
    req = translated(
        openai_chat(
            max_tokens=7,
            temperature=0.0,
            top_p=0.5,
            stop="END",
            seed=42,
            priority="background",
            deadline_ms=5000,
        )
    )
    assert req.messages is not None
    assert [(m.role, m.content) for m in req.messages] == [("user", "hi")]
    assert (req.max_tokens, req.temperature, req.top_p) == (7, 0.0, 0.5)
    assert (req.stop, req.seed, req.priority, req.deadline_ms) == (
        ["END"],
        42,
        Tier.background,
        5000,
    )


def test_max_completion_tokens_wins_and_unset_stays_unset() -> None:
    assert translated(openai_chat(max_tokens=7, max_completion_tokens=9)).max_tokens == 9
    assert translated(openai_completion(max_tokens=3)).max_tokens == 3
    # Unset: the rest of the context at the engine; budgets charge the configured estimate.
    unset = translated(openai_chat())
    assert unset.max_tokens is None
    assert unset.effective_max_tokens == OPENAI_LIMITS.default_max_tokens == 16
    assert translated(openai_completion()).max_tokens is None


@pytest.mark.parametrize(
    ("priority", "tier"),
    [(0, Tier.interactive), (-5, Tier.interactive), (1, Tier.background), (None, None)],
)
def test_vllm_integer_priority_maps_to_a_tier(priority: int | None, tier: Tier | None) -> None:
    assert translated(openai_chat(priority=priority)).priority == tier


def test_content_parts_developer_role_and_null_content() -> None:
    req = translated(
        openai_chat(
            messages=[
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": None},
            ]
        )
    )
    assert req.messages is not None
    assert [(m.role, m.content) for m in req.messages] == [
        ("system", "be brief"),
        ("user", "ab"),
        ("assistant", ""),
    ]


def test_explicit_nulls_are_unset() -> None:
    """As vLLM's server reads them: a null field takes its default."""
    nulls: dict[str, object] = {
        "n": None,
        "stream": None,
        "temperature": None,
        "stop": None,
        "seed": None,
        "max_completion_tokens": None,
    }
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": None, "name": None}],
            "stream_options": {"include_usage": None, "continuous_usage_stats": None},
            **nulls,
        }
    )
    assert (body.n, body.stream, body.temperature) == (1, False, None)
    assert body.stream_options is not None
    assert not body.stream_options.include_usage
    translated(openai_chat(**nulls))
    text = CompletionRequest.model_validate({"prompt": "x", "echo": None, **nulls})
    assert (text.n, text.stream, text.echo) == (1, False, False)
    translated(openai_completion(echo=None, **nulls))
    with pytest.raises(ValueError, match="messages"):  # a required field stays required
        ChatCompletionRequest.model_validate({"messages": None})


def test_n_above_one_is_a_clear_400() -> None:
    error = refused(openai_chat(n=2), "n")
    assert "n=2" in error.body.error.message
    assert "only n=1" in error.body.error.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "auto"}, "tool_choice"),  # without tools
        ({"response_format": {"type": "yaml"}}, "response_format"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages",
        ),
    ],
)
def test_what_tokenbus_cannot_honour_is_refused(fields: dict[str, object], param: str) -> None:
    refused(openai_chat(**fields), param)


def test_vllm_sampling_fields_pass_on_by_their_names() -> None:
    fields = {
        "top_k": 5,
        "min_p": 0.1,
        "repetition_penalty": 1.2,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "logit_bias": {"50256": -100, "11": 2.5},
        "min_tokens": 3,
        "ignore_eos": True,
        "stop_token_ids": [2, 7],
        "seed": 9,
    }
    for req in (translated(openai_chat(**fields)), translated(openai_completion(**fields))):
        assert req.logit_bias == {50256: -100.0, 11: 2.5}
        assert (req.top_k, req.min_p, req.repetition_penalty) == (5, 0.1, 1.2)
        assert (req.presence_penalty, req.frequency_penalty) == (0.5, -0.5)
        assert (req.min_tokens, req.ignore_eos, req.stop_token_ids, req.seed) == (
            3,
            True,
            [2, 7],
            9,
        )
        assert req.sampling_needs() == frozenset(fields)


def test_unset_sampling_stays_unset_for_the_models_defaults() -> None:
    req = translated(openai_chat())
    assert (req.temperature, req.top_p, req.top_k, req.min_p, req.repetition_penalty) == (
        None,
        None,
        None,
        None,
        None,
    )
    assert req.sampling_needs() == frozenset()
    # Explicit nulls are unset too (vLLM's clients send them).
    assert (
        translated(openai_chat(temperature=None, top_k=None, ignore_eos=None)).temperature is None
    )


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"top_k": -2}, "top_k", "greater than or equal to -1"),
        ({"min_p": 1.5}, "min_p", "less than or equal to 1"),
        ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
        ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
        ({"frequency_penalty": -3}, "frequency_penalty", "greater than or equal to -2"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "less than or equal to 100"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "valid integer"),
        ({"logit_bias": {"-1": 1}}, "logit_bias", "greater than or equal to 0"),
        ({"min_tokens": -1}, "min_tokens", "greater than or equal to 0"),
        ({"min_tokens": 17, "max_tokens": 16}, None, "min_tokens: 17 is above max_tokens (16)"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", "greater than or equal to 0"),
        ({"temperature": 2.5}, "temperature", "less than or equal to 2"),
    ],
)
def test_sampling_fields_out_of_vllms_ranges_are_a_400_naming_them(
    fields: dict[str, object], param: str | None, words: str
) -> None:
    error = refused(openai_chat(**fields), param)
    message = error.body.error.message
    assert words in message
    assert (param or "min_tokens") in message


def test_zero_penalties_and_text_format_are_accepted() -> None:
    translated(
        openai_chat(presence_penalty=0, frequency_penalty=0.0, response_format={"type": "text"})
    )


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": [1, 2, 3]}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"echo": True}, "echo"),
        ({"best_of": 2}, "best_of"),
    ],
)
def test_completion_refusals(fields: dict[str, object], param: str) -> None:
    refused(openai_completion(**fields), param)


def test_limits_of_the_edge_apply() -> None:
    error = refused(openai_chat(max_tokens=101))
    assert "max_tokens" in error.body.error.message
    assert "at most 100" in error.body.error.message
    refused(openai_chat(temperature=3))
    refused(openai_chat(stop=["a", "b", "c", "d", "e"]))
    assert translated(openai_completion(prompt=["only one"])).prompt == "only one"


# -- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (ErrorCode.invalid_request, 400),
        (ErrorCode.unauthorized, 401),
        (ErrorCode.not_found, 404),
        (ErrorCode.rate_limited, 429),
        (ErrorCode.overloaded, 503),
        (ErrorCode.deadline_exceeded, 504),
        (ErrorCode.internal, 500),
    ],
)
def test_error_codes_map_to_statuses(code: ErrorCode, status: int) -> None:
    error = http_error(code, "why")
    assert error.status == status
    assert error.body.error.message == "why"


def test_retry_after_rounds_up_to_whole_seconds() -> None:
    assert http_error(ErrorCode.rate_limited, "x", retry_after_ms=1).headers["Retry-After"] == "1"
    headers = http_error(ErrorCode.overloaded, "x", retry_after_ms=2500).headers
    assert headers["Retry-After"] == "3"
    # The exact hint, under the name the `openai` SDK reads and under tokenbus's own.
    assert headers["retry-after-ms"] == headers["X-Tokenbus-Retry-After-Ms"] == "2500"
    assert http_error(ErrorCode.overloaded, "x").headers == {}


def test_unknown_model_names_the_served_ones() -> None:
    error = unknown_model(unknown_model_message("gpt-4", ["sim-8b"]))
    assert (error.status, error.body.error.code, error.body.error.param) == (
        404,
        "model_not_found",
        "model",
    )
    assert "sim-8b" in error.body.error.message


# -- SSE ----------------------------------------------------------------------------------------


def done(reason: str = "stop", model: str | None = None) -> DoneFrame:
    return DoneFrame(
        request_id="r1",
        finish_reason=reason,
        model=model,
        usage=Usage(prompt_tokens=3, completion_tokens=2),
        timings=Timings(queue_ms=1, batch_size=1, ttft_ms=2, total_ms=3),
    )


def delta(seq: int, text: str) -> DeltaFrame:
    return DeltaFrame(request_id="r1", seq=seq, text=text)


def test_chat_stream_ids_role_chunk_usage_and_done() -> None:
    stream = SseStream(CHAT, include_usage=True)
    out = stream.take(AcceptedFrame(request_id="r1", resume_token="t", tier=Tier.interactive))
    out += stream.take(delta(0, "Hel")) + stream.take(delta(1, "lo")) + stream.take(done())
    seen = sse_events(out)
    assert [i for i, _ in seen] == ["0:-1", "0:0", "0:1", "0:1", "0:1", None]
    role, first, second, finish, usage, end = (d for _, d in seen)
    assert isinstance(role, dict)
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["id"] == "chatcmpl-r1"
    assert role["object"] == "chat.completion.chunk"
    assert isinstance(first, dict)
    assert isinstance(second, dict)
    assert (
        first["choices"][0]["delta"]["content"] + second["choices"][0]["delta"]["content"]
        == "Hello"
    )
    assert isinstance(finish, dict)
    assert finish["choices"][0]["finish_reason"] == "stop"
    assert isinstance(usage, dict)
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert end == "[DONE]"
    assert out[-1] == DONE
    assert stream.ended
    assert stream.take(delta(2, "late")) == []


def test_continuous_usage_puts_the_usage_so_far_in_every_chunk_as_vllm_does() -> None:
    """vLLM's `stream_options.continuous_usage_stats` (guidellm streams with it, issue 42):
    every chunk carries the prompt's tokens and the completion's so far, from the counts the
    deltas carry; the last usage chunk is the final's, as without it."""
    assert isinstance(openai_chat(stream_options={"continuous_usage_stats": True}), ChatRequest)
    stream = SseStream(CHAT, include_usage=True, continuous_usage=True)
    out = stream.take(AcceptedFrame(request_id="r1", resume_token="t", tier=Tier.interactive))
    out += stream.take(DeltaFrame(request_id="r1", seq=0, text="Hel", tokens=1, prompt_tokens=3))
    out += stream.take(DeltaFrame(request_id="r1", seq=1, text="lo", tokens=1))
    out += stream.take(done())
    chunks = [d for _, d in sse_events(out) if isinstance(d, dict)]
    usages = [(c["usage"]["prompt_tokens"], c["usage"]["completion_tokens"]) for c in chunks]
    assert usages == [(3, 0), (3, 1), (3, 2), (3, 2), (3, 2)]  # role, Hel, lo, finish, usage
    assert all(c["usage"]["total_tokens"] == sum(u) for c, u in zip(chunks, usages, strict=True))
    # Without include_usage it is off, as in vLLM; without it, no chunk but the last has one.
    for plain in (SseStream(CHAT, include_usage=False, continuous_usage=True),):
        plain_out = plain.take(DeltaFrame(request_id="r1", seq=0, text="a", tokens=1))
        assert all(d.get("usage") is None for _, d in sse_events(plain_out) if isinstance(d, dict))


def test_the_model_and_fallback_map_and_the_answer_names_who_answered() -> None:
    request = openai_chat(model="big", fallback_model="small")
    assert isinstance(request, ChatRequest)
    assert (request.model, request.fallback_model) == ("big", "small")
    ident = Identity("chat", "r1", "big", 1)
    whole = Answer(ident)
    whole.take(done(model="small"))
    assert whole.result is not None
    assert not isinstance(whole.result, HttpError)
    assert whole.result.model == "small"
    stream = SseStream(ident, include_usage=False)
    first = sse_events(stream.take(delta(0, "a")))
    finish = sse_events(stream.take(done(model="small")))
    assert [d["model"] for _, d in first if isinstance(d, dict)] == ["big", "big"]
    assert [d["model"] for _, d in finish if isinstance(d, dict)] == ["small"]


def test_the_variant_that_answered_is_the_system_fingerprint() -> None:
    canary = done().model_copy(update={"variant": "canary"})
    for kind in ("chat", "text"):
        ident = Identity(kind, "r1", "m", 1)  # type: ignore[arg-type]
        whole = Answer(ident)
        whole.take(canary)
        assert whole.result is not None
        assert not isinstance(whole.result, HttpError)
        assert whole.result.system_fingerprint == "canary"
        stream = SseStream(ident, include_usage=True)
        bodies = [d for _, d in sse_events(stream.take(delta(0, "a")) + stream.take(canary))]
        # Known once the answer is: on the finishing and usage chunks, absent before.
        assert [d.get("system_fingerprint") for d in bodies if isinstance(d, dict)][-2:] == [
            "canary",
            "canary",
        ]
        assert all("system_fingerprint" not in d for d in bodies[:-3] if isinstance(d, dict))
    # The baseline answered: no fingerprint at all (vLLM-like clients see nothing new).
    baseline = Answer(CHAT)
    baseline.take(done())
    assert baseline.result is not None
    assert "system_fingerprint" not in baseline.result.model_dump(exclude_unset=False)


def test_unknown_models_are_refused_only_after_the_directory_listened_a_while() -> None:
    models = ModelDirectory(stale_s=10, listening_since=100.0, grace_s=3.0)
    models.observe(beat("w1", "a", 100), 100)
    named = ChatRequest(prompt="hi", model="b")
    assert models.unknown(named, now=102.0) is None  # too new to say
    assert models.unknown(named, now=104.0) == (
        "model",
        "model 'b' is not served here; available models: a",
    )
    assert models.unknown(ChatRequest(prompt="hi", model="a"), now=104.0) is None
    assert models.unknown(ChatRequest(prompt="hi"), now=104.0) is None
    fallback = ChatRequest(prompt="hi", model="a", fallback_model="c")
    assert models.unknown(fallback, now=104.0) == (
        "fallback_model",
        "model 'c' is not served here; available models: a",
    )


def test_text_stream_without_usage() -> None:
    stream = SseStream(TEXT, include_usage=False)
    seen = sse_events(stream.take(delta(0, "a")) + stream.take(done("length")))
    assert [i for i, _ in seen] == ["0:0", "0:0", None]
    first, finish, _ = (d for _, d in seen)
    assert isinstance(first, dict)
    assert first["object"] == "text_completion"
    assert first["choices"][0]["text"] == "a"
    assert isinstance(finish, dict)
    assert finish["choices"][0]["finish_reason"] == "length"


def test_a_new_attempt_before_any_text_is_invisible() -> None:
    stream = SseStream(CHAT, include_usage=False)
    assert stream.take(ResetFrame(request_id="r1", attempt=1)) == []
    seen = sse_events(stream.take(delta(0, "x")))
    assert [i for i, _ in seen] == ["1:-1", "1:0"]
    assert not stream.cancel


def test_a_new_attempt_after_text_ends_the_stream_with_an_error() -> None:
    stream = SseStream(CHAT, include_usage=False)
    stream.take(delta(0, "x"))
    seen = sse_events(stream.take(ResetFrame(request_id="r1", attempt=1)))
    (_, error), (_, end) = seen
    assert isinstance(error, dict)
    assert "re-run" in error["error"]["message"]
    assert end == "[DONE]"
    assert stream.cancel
    assert stream.ended


def test_resumed_stream_sends_no_role_chunk_and_continues_ids() -> None:
    stream = SseStream(CHAT, include_usage=False, after=EventId(0, 4))
    seen = sse_events(stream.take(delta(5, "y")))
    assert [i for i, _ in seen] == ["0:5"]
    # A resumed client holds text: a new attempt cannot be shown to it either.
    stream.take(ResetFrame(request_id="r1", attempt=1))
    assert stream.cancel


def test_error_frame_becomes_an_error_event() -> None:
    stream = SseStream(CHAT, include_usage=False)
    frame = ErrorFrame(code=ErrorCode.deadline_exceeded, message="late", request_id="r1")
    (_, error), _ = sse_events(stream.take(frame))
    assert error == {
        "error": {
            "message": "late",
            "type": "timeout_error",
            "param": None,
            "code": "deadline_exceeded",
        }
    }


@pytest.mark.parametrize(
    ("value", "parsed"),
    [("0:5", EventId(0, 5)), (" 2:-1 ", EventId(2, -1)), ("x", None), ("1:-2", None), ("", None)],
)
def test_last_event_id(value: str, parsed: EventId | None) -> None:
    assert parse_event_id(value) == parsed


# -- non-streaming ------------------------------------------------------------------------------


def test_answer_gathers_text_and_drops_a_superseded_attempt() -> None:
    answer = Answer(CHAT)
    for frame in (
        delta(0, "old"),
        ResetFrame(request_id="r1", attempt=1),
        delta(0, "ne"),
        delta(1, "w"),
    ):
        answer.take(frame)
    assert answer.result is None
    answer.take(done())
    body = answer.result
    assert body is not None
    assert not isinstance(body, HttpError)
    dumped = body.model_dump()
    assert dumped["choices"][0]["message"] == {"role": "assistant", "content": "new"}
    assert dumped["usage"]["total_tokens"] == 5


def test_answer_error_keeps_retry_after() -> None:
    answer = Answer(TEXT)
    answer.take(
        ErrorFrame(code=ErrorCode.overloaded, message="busy", request_id="r1", retry_after_ms=1500)
    )
    assert isinstance(answer.result, HttpError)
    assert answer.result.status == 503
    assert answer.result.headers["Retry-After"] == "2"


# -- models -------------------------------------------------------------------------------------


def beat(worker: str, model: str, at: float) -> Heartbeat:
    return Heartbeat(
        worker_id=worker,
        model=model,
        total_slots=1,
        free_slots=1,
        running=0,
        queued_tokens=0,
        utilisation=0.0,
        sent_at=at,
    )


def test_model_directory_lists_live_workers_models() -> None:
    models = ModelDirectory(stale_s=10)
    models.observe(beat("w1", "a", 100), 100)
    models.observe(beat("w2", "b", 105), 105)
    models.observe(beat("w3", "a", 106), 106)
    assert models.served(now=108) == {"a": 100, "b": 105}
    assert models.served(now=112) == {"a": 100, "b": 105}  # w1 stale, w3 still serves `a`
    assert models.served(now=117) == {}
    models.observe(beat("w1", "a", 120), 120)
    assert models.served(now=121) == {"a": 120}


def test_model_directory_reports_the_smallest_context_of_a_models_live_workers() -> None:
    models = ModelDirectory(stale_s=10)
    models.observe(beat("w1", "a", 100).model_copy(update={"max_model_len": 4096}), 100)
    models.observe(beat("w2", "a", 101).model_copy(update={"max_model_len": 2048}), 101)
    models.observe(beat("w3", "b", 101), 101)  # an old worker: it does not say
    assert models.max_model_len(now=102) == {"a": 2048}
    assert models.max_model_len(now=111) == {"a": 2048}  # w1 stale; w2 still live
    models.observe(beat("w2", "a", 112), 112)  # no longer says
    assert models.max_model_len(now=113) == {}


def test_model_directory_ignores_a_late_older_beat() -> None:
    models = ModelDirectory(stale_s=10)
    models.observe(beat("w1", "new", 200), 200)
    models.observe(beat("w1", "old", 150), 150)
    assert list(models.served(now=201)) == ["new"]


def test_a_worker_whose_clock_runs_behind_stays_listed_while_it_is_heard() -> None:
    """Issue 38, item 4: staleness is judged on when the edge heard a beat, not its sent_at."""
    models = ModelDirectory(stale_s=10)
    behind = 40.0  # the worker's clock runs 40 s behind the edge's
    for now in (100.0, 101.0, 102.0):
        models.observe(beat("w1", "a", now - behind), now)
    assert models.served(now=103.0) == {"a": 100}
    assert models.served(now=113.0) == {}  # unheard for 11 s: gone
