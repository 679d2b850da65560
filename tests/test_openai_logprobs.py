"""Logprobs over the OpenAI API, the pure parts: what a body asks, and OpenAI's shapes back.

The shapes are checked with the `openai` SDK's own types, as a client reads them.
"""

from __future__ import annotations

import pytest
from openai.types import Completion as SdkCompletion
from openai.types.chat import ChatCompletion as SdkChatCompletion
from openai.types.chat import ChatCompletionChunk as SdkChatCompletionChunk
from openai.types.completion_choice import Logprobs as SdkLegacyLogprobs

from services.edge.capabilities import unhonoured
from services.edge.openai.errors import HttpError
from services.edge.openai.ignored import MAX_NAMES, ignored_fields
from services.edge.openai.logprobs import chat_logprobs, completion_logprobs, token_bytes
from services.edge.openai.schema import ChatCompletionRequest, CompletionRequest
from services.edge.openai.translate import Answer, Identity, SseStream
from services.edge.protocol import AcceptedFrame, DeltaFrame, DoneFrame, ResetFrame
from services.worker.engines.base import EngineRequest, FieldNotHonoured, check_sampling
from services.worker.engines.sim import SimEngine
from services.worker.engines.vllm import VllmEngine
from shared.messages import (
    Capabilities,
    ChatRequest,
    Tier,
    Timings,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from tests.chat_client import sse_data
from tests.factories import openai_chat, openai_completion


def asks(result: ChatRequest | HttpError) -> int | None:
    assert isinstance(result, ChatRequest), result
    return result.logprobs


def refused(result: ChatRequest | HttpError, param: str) -> str:
    assert isinstance(result, HttpError), result
    assert (result.status, result.body.error.param) == (400, param)
    return result.body.error.message


# -- what a body asks ---------------------------------------------------------------------------


def test_chat_asks_with_a_flag_and_top_logprobs() -> None:
    assert asks(openai_chat()) is None
    assert asks(openai_chat(logprobs=False)) is None
    assert asks(openai_chat(logprobs=None, top_logprobs=None)) is None
    assert asks(openai_chat(logprobs=True)) == 0
    assert asks(openai_chat(logprobs=True, top_logprobs=0)) == 0
    assert asks(openai_chat(logprobs=True, top_logprobs=5)) == 5
    assert asks(openai_chat(logprobs=True, top_logprobs=20)) == 20
    assert asks(openai_chat(logprobs=False, top_logprobs=0)) is None  # vLLM accepts it too


@pytest.mark.parametrize("top", [-1, 21, 1000])
def test_chat_top_logprobs_out_of_range_is_a_400(top: int) -> None:
    assert "between 0 and 20" in refused(
        openai_chat(logprobs=True, top_logprobs=top), "top_logprobs"
    )


def test_top_logprobs_without_logprobs_is_a_400_as_in_vllm() -> None:
    assert "logprobs: true" in refused(openai_chat(top_logprobs=2), "top_logprobs")
    assert "logprobs: true" in refused(openai_chat(logprobs=False, top_logprobs=2), "top_logprobs")


def test_chat_logprobs_must_be_a_flag() -> None:
    with pytest.raises(ValueError, match="logprobs"):
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "x"}], "logprobs": "yes please"}
        )


def test_completions_ask_with_a_count() -> None:
    assert asks(openai_completion()) is None
    assert asks(openai_completion(logprobs=None)) is None
    assert asks(openai_completion(logprobs=0)) == 0
    assert asks(openai_completion(logprobs=5)) == 5
    assert asks(openai_completion(logprobs=20)) == 20  # vLLM allows past OpenAI's 5


@pytest.mark.parametrize("count", [-1, 21])
def test_completion_logprobs_out_of_range_is_a_400(count: int) -> None:
    refused(openai_completion(logprobs=count), "logprobs")


def test_the_request_record_validates_the_range() -> None:
    with pytest.raises(ValueError, match="logprobs"):
        ChatRequest(prompt="x", logprobs=21)
    with pytest.raises(ValueError, match="logprobs"):
        ChatRequest(prompt="x", logprobs=-1)
    assert ChatRequest(prompt="x", logprobs=0).sampling_needs() == {"logprobs"}
    assert ChatRequest(prompt="x").sampling_needs() == frozenset()


def test_unset_logprobs_stay_out_of_the_record_and_logprobs_are_not_cached() -> None:
    assert "logprobs" not in ChatRequest(prompt="x").model_dump_json()
    assert '"logprobs":3' in ChatRequest(prompt="x", logprobs=3).model_dump_json()
    assert ChatRequest(prompt="x", seed=1).cacheable
    assert not ChatRequest(prompt="x", seed=1, logprobs=0).cacheable


# -- who honours them ---------------------------------------------------------------------------


def test_only_the_vllm_engine_honours_logprobs() -> None:
    assert "logprobs" in VllmEngine.sampling_fields
    assert "logprobs" not in SimEngine.sampling_fields


def test_the_edge_refuses_logprobs_no_live_worker_honours() -> None:
    sim = Capabilities(engine="sim", sampling=SimEngine.sampling_fields)
    vllm = Capabilities(engine="vllm", sampling=VllmEngine.sampling_fields)
    request = ChatRequest(prompt="x", model="sim-8b", logprobs=0)
    why = unhonoured(request, [sim])
    assert why is not None
    assert why.startswith("logprobs: not supported by the engine serving model 'sim-8b' (sim)")
    assert unhonoured(request, [sim, vllm]) is None
    assert unhonoured(ChatRequest(prompt="x"), [sim]) is None


def test_a_worker_refuses_logprobs_its_engine_does_not_honour() -> None:
    with pytest.raises(FieldNotHonoured, match=r"logprobs: .*\(sim\)"):
        check_sampling(EngineRequest("r1", "x", 4, logprobs=0), "sim", SimEngine.sampling_fields)
    check_sampling(EngineRequest("r1", "x", 4, logprobs=3), "vllm", VllmEngine.sampling_fields)


# -- OpenAI's shapes ----------------------------------------------------------------------------

HEL = TokenLogprob(
    token="Hel",
    logprob=-0.25,
    top=[TopLogprob(token="Hel", logprob=-0.25), TopLogprob(token="He", logprob=-1.5)],
)
LO = TokenLogprob(
    token="lo",
    logprob=-2.0,
    top=[TopLogprob(token="p", logprob=-0.5), TopLogprob(token="lo", logprob=-2.0)],
)
EMOJI = TokenLogprob(token="🙂", logprob=-9999.0, top=[])


def delta(seq: int, text: str, logprobs: list[TokenLogprob] | None) -> DeltaFrame:
    return DeltaFrame(request_id="r1", seq=seq, text=text, logprobs=logprobs)


def done() -> DoneFrame:
    return DoneFrame(
        request_id="r1",
        finish_reason="length",
        usage=Usage(prompt_tokens=3, completion_tokens=3),
        timings=Timings(queue_ms=1, batch_size=1, ttft_ms=2, total_ms=3),
    )


ACCEPTED = AcceptedFrame(request_id="r1", resume_token="t", tier=Tier.interactive)


def ident(kind: str, logprobs: bool = True) -> Identity:
    return Identity("chat" if kind == "chat" else "text", "r1", "m", 1700000000, logprobs)


def test_chat_logprobs_shape_and_bytes() -> None:
    shaped = chat_logprobs([HEL, EMOJI]).model_dump()
    assert shaped == {
        "content": [
            {
                "token": "Hel",
                "logprob": -0.25,
                "bytes": [72, 101, 108],
                "top_logprobs": [
                    {"token": "Hel", "logprob": -0.25, "bytes": [72, 101, 108]},
                    {"token": "He", "logprob": -1.5, "bytes": [72, 101]},
                ],
            },
            {
                "token": "🙂",
                "logprob": -9999.0,
                "bytes": list("🙂".encode()),
                "top_logprobs": [],
            },
        ]
    }
    assert token_bytes("é") == [0xC3, 0xA9]


def test_completion_logprobs_shape_with_offsets_from_where_the_text_stands() -> None:
    shaped = completion_logprobs([HEL, LO], text_offset=7).model_dump()
    assert shaped == {
        "text_offset": [7, 10],
        "token_logprobs": [-0.25, -2.0],
        "tokens": ["Hel", "lo"],
        # The token itself and its alternatives, as vLLM's (up to n + 1 entries).
        "top_logprobs": [{"Hel": -0.25, "He": -1.5}, {"lo": -2.0, "p": -0.5}],
    }


def test_chat_answer_gathers_every_tokens_logprobs_across_a_reset() -> None:
    answer = Answer(ident("chat"))
    for frame in [
        ACCEPTED,
        delta(0, "x", [LO]),
        ResetFrame(request_id="r1", attempt=1),  # the old attempt's logprobs go with its text
        delta(0, "Hel", [HEL]),
        delta(1, "lo", [LO]),
        done(),
    ]:
        answer.take(frame)
    assert answer.result is not None
    assert not isinstance(answer.result, HttpError)
    body = SdkChatCompletion.model_validate(answer.result.model_dump())
    logprobs = body.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.content is not None
    assert [t.token for t in logprobs.content] == ["Hel", "lo"]
    assert [len(t.top_logprobs) for t in logprobs.content] == [2, 2]
    assert logprobs.content[1].top_logprobs[0].token == "p"


def test_answers_not_asking_carry_null_logprobs() -> None:
    for kind in ("chat", "text"):
        answer = Answer(ident(kind, logprobs=False))
        for frame in [ACCEPTED, delta(0, "Hel", None), done()]:
            answer.take(frame)
        assert answer.result is not None
        assert not isinstance(answer.result, HttpError)
        assert answer.result.model_dump()["choices"][0]["logprobs"] is None


def test_an_answer_with_no_tokens_still_says_logprobs() -> None:
    answer = Answer(ident("chat"))
    for frame in [ACCEPTED, done()]:
        answer.take(frame)
    assert answer.result is not None
    assert not isinstance(answer.result, HttpError)
    assert answer.result.model_dump()["choices"][0]["logprobs"] == {"content": []}


def test_completion_answer_shape() -> None:
    answer = Answer(ident("text"))
    for frame in [ACCEPTED, delta(0, "Hel", [HEL]), delta(1, "lo", [LO]), done()]:
        answer.take(frame)
    assert answer.result is not None
    assert not isinstance(answer.result, HttpError)
    body = SdkCompletion.model_validate(answer.result.model_dump())
    logprobs = body.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens == ["Hel", "lo"]
    assert logprobs.token_logprobs == [-0.25, -2.0]
    assert logprobs.text_offset == [0, 3]


def test_chat_stream_chunks_carry_their_own_tokens_logprobs() -> None:
    stream = SseStream(ident("chat"), include_usage=False)
    out: list[bytes] = []
    for frame in [ACCEPTED, delta(0, "Hel", [HEL]), delta(1, "lo🙂", [LO, EMOJI]), done()]:
        out += stream.take(frame)
    chunks = [SdkChatCompletionChunk.model_validate(c) for c in sse_data(out)]
    role, first, second, finish = chunks
    assert role.choices[0].logprobs is None  # the opening chunk has no tokens
    assert finish.choices[0].logprobs is None
    for chunk, tokens in [(first, ["Hel"]), (second, ["lo", "🙂"])]:
        logprobs = chunk.choices[0].logprobs
        assert logprobs is not None
        assert logprobs.content is not None
        assert [t.token for t in logprobs.content] == tokens


def test_text_stream_offsets_run_on_across_chunks() -> None:
    stream = SseStream(ident("text"), include_usage=False)
    out: list[bytes] = []
    for frame in [ACCEPTED, delta(0, "Hel", [HEL]), delta(1, "lo", [LO]), done()]:
        out += stream.take(frame)
    # (The SDK's `Completion` wants a finish_reason on every choice; it reads a stream's
    # chunks unchecked, so only their logprobs are checked against its type here.)
    first, second, finish = (
        None
        if c["choices"][0]["logprobs"] is None
        else SdkLegacyLogprobs(**c["choices"][0]["logprobs"])
        for c in sse_data(out)
    )
    assert first is not None
    assert first.text_offset == [0]
    assert second is not None
    assert second.text_offset == [3]
    assert second.top_logprobs == [{"lo": -2.0, "p": -0.5}]
    assert finish is None


def test_streams_not_asking_carry_null_logprobs() -> None:
    stream = SseStream(ident("chat", logprobs=False), include_usage=False)
    out: list[bytes] = []
    for frame in [ACCEPTED, delta(0, "Hel", None), done()]:
        out += stream.take(frame)
    assert all(c["choices"][0]["logprobs"] is None for c in sse_data(out))


# -- fields nothing reads -----------------------------------------------------------------------


def test_ignored_fields_are_named_never_valued() -> None:
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "x", "weight": 2}],
            "stream_options": {"include_usage": True, "chunk_size": 4},
            "metadata": {"secret": "hunter2"},
            "store": True,
            "temperature": 0.5,
        }
    )
    assert ignored_fields(body) == [
        "messages[].weight",
        "metadata",
        "store",
        "stream_options.chunk_size",
    ]
    assert ignored_fields(CompletionRequest.model_validate({"prompt": "x"})) == []


def test_ignored_fields_are_bounded() -> None:
    body = CompletionRequest.model_validate(
        {"prompt": "x", **{f"f{i:03d}" + "x" * 100: 1 for i in range(100)}}
    )
    names = ignored_fields(body)
    assert len(names) == MAX_NAMES
    assert all(len(n) == 64 for n in names)
    assert names[0].startswith("f000")
