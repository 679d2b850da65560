"""The vLLM adapter's mapping, checked against a recording fake of vLLM's AsyncLLM interface.

The fake stands in for `vllm.v1.engine.async_llm.AsyncLLM` and friends, for the pure parts
of the mapping; tests/test_real_engines.py runs the adapter on real vLLM (its CPU build)
with a real model, through the whole bus.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import pytest

from services.worker.engines.base import (
    ChatTurn,
    EngineDelta,
    EngineFinish,
    EngineRequest,
    MaxTokensOverContext,
    PromptTooLong,
)
from services.worker.engines.vllm import (
    EngineRequestFailed,
    VllmApi,
    VllmEngine,
    engine_args,
    engine_args_from_settings,
    finish_reason,
)
from services.worker.settings import WorkerSettings
from shared.messages import (
    OUTPUT_FIELDS,
    SAMPLING_FIELDS,
    STRUCTURED_FIELDS,
    TokenLogprob,
    TopLogprob,
)

DELTA = "RequestOutputKind.DELTA(fake)"


@dataclass
class FakeLogprob:
    """vLLM's `vllm.logprobs.Logprob`."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class FakeCompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[dict[int, FakeLogprob] | None] | None = None


@dataclass
class FakeRequestOutput:
    request_id: str
    prompt_token_ids: list[int] | None
    outputs: list[FakeCompletionOutput]
    finished: bool


@dataclass
class FakeEngineArgs:
    """Records the keyword arguments `AsyncEngineArgs(...)` was given."""

    kwargs: dict[str, Any]

    @property
    def max_num_seqs(self) -> int:
        return int(self.kwargs["max_num_seqs"])


BOS = 1


@dataclass
class FakeTokenizer:
    """A tokenizer that adds a BOS, as Llama-3's, Mistral's and Gemma's do; its template
    starts with one too."""

    chat_template: str | None = "{fake}"
    rendered: list[list[dict[str, str]]] = field(default_factory=list)

    def apply_chat_template(
        self, messages: list[dict[str, str]], *, tokenize: bool, add_generation_prompt: bool
    ) -> str:
        assert tokenize is False
        assert add_generation_prompt is True
        self.rendered.append(messages)
        return "<s>" + "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """One token per character; "<s>" is the BOS, added in front when asked."""
        ids = [BOS] if add_special_tokens else []
        if text.startswith("<s>"):
            ids, text = [*ids, BOS], text[3:]
        return ids + [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


@dataclass
class FakeModelConfig:
    max_model_len: int
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    def get_diff_sampling_param(self) -> dict[str, Any]:
        return dict(self.sampling_defaults)


class FakeAsyncLLM:
    """Records every call; streams scripted outputs, waits forever where told to."""

    instances: ClassVar[list[FakeAsyncLLM]] = []
    sampling_defaults: ClassVar[dict[str, Any]] = {}  # the next instance's model's

    def __init__(self, args: FakeEngineArgs) -> None:
        self.args = args
        self.generate_calls: list[dict[str, Any]] = []
        self.aborted: list[str] = []
        self.shut_down = False
        self.tokenizer = FakeTokenizer()
        self.script: dict[str, list[FakeRequestOutput]] = {}
        self.hang_after_script: set[str] = set()
        self.model_config = FakeModelConfig(64, dict(FakeAsyncLLM.sampling_defaults))
        self.stat_loggers: list[Any] = []
        FakeAsyncLLM.instances.append(self)

    @classmethod
    def from_engine_args(
        cls, args: FakeEngineArgs, *, stat_loggers: list[type] | None = None
    ) -> FakeAsyncLLM:
        llm = cls(args)
        llm.stat_loggers = [factory(None, 0) for factory in stat_loggers or []]
        return llm

    async def generate(
        self,
        prompt: Any,
        sampling_params: Any,
        request_id: str,
        *,
        trace_headers: dict[str, str] | None = None,
        priority: int = 0,
    ) -> AsyncIterator[FakeRequestOutput]:
        self.generate_calls.append(
            dict(
                prompt=prompt,
                sampling_params=sampling_params,
                request_id=request_id,
                trace_headers=trace_headers,
                priority=priority,
            )
        )
        for out in self.script.get(request_id, []):
            await asyncio.sleep(0)
            yield out
        if request_id in self.hang_after_script:
            await asyncio.Event().wait()

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def get_tokenizer(self) -> FakeTokenizer:
        return self.tokenizer

    def shutdown(self) -> None:
        self.shut_down = True


async def calls_reach(llm: FakeAsyncLLM, count: int, within_s: float = 10.0) -> None:
    """Until vLLM's generate has `count` calls (each request is tokenized in a thread
    first, so this takes as long as the machine takes to run it)."""
    deadline = time.monotonic() + within_s
    while len(llm.generate_calls) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(llm.generate_calls)} generate calls, not {count}")
        await asyncio.sleep(0.001)


def fake_sampling_params(**kwargs: Any) -> dict[str, Any]:
    return kwargs


def fake_engine_args(**kwargs: Any) -> FakeEngineArgs:
    return FakeEngineArgs(kwargs)


API = VllmApi(FakeAsyncLLM, fake_engine_args, fake_sampling_params, DELTA)


async def started_engine(
    max_num_seqs: int = 4, defaults: dict[str, Any] | None = None
) -> tuple[VllmEngine, FakeAsyncLLM]:
    """`defaults`: the model's generation config, as `get_diff_sampling_param` reports it."""
    engine = VllmEngine(API, engine_args(API, model="/models/x", max_num_seqs=max_num_seqs))
    FakeAsyncLLM.sampling_defaults = defaults or {}
    try:
        await engine.start()
    finally:
        FakeAsyncLLM.sampling_defaults = {}
    return engine, FakeAsyncLLM.instances[-1]


def out(rid: str, text: str, ids: list[int], reason: str | None = None) -> FakeRequestOutput:
    return FakeRequestOutput(
        rid, [1, 2, 3], [FakeCompletionOutput(text, ids, reason)], finished=reason is not None
    )


def test_engine_args_carry_the_settings_and_priority_scheduling() -> None:
    settings = WorkerSettings(
        worker_engine="vllm",
        worker_model_path="/models/llama3-8b",
        worker_max_num_seqs=48,
        worker_dtype="bfloat16",
        worker_quantization="fp8",
        worker_gpu_memory_utilization=0.85,
        worker_max_model_len=8192,
        worker_tensor_parallel_size=2,
    )
    args = engine_args_from_settings(API, settings)
    assert args.kwargs == dict(
        model="/models/llama3-8b",
        dtype="bfloat16",
        quantization="fp8",
        gpu_memory_utilization=0.85,
        max_model_len=8192,
        max_num_seqs=48,
        tensor_parallel_size=2,
        scheduling_policy="priority",
        enable_prefix_caching=True,
        enforce_eager=False,
        # llguidance unless the operator names another (issue 37, N2, ADR 0069).
        structured_outputs_config={"backend": "guidance", "disable_additional_properties": True},
    )
    auto = WorkerSettings(
        worker_engine="vllm",
        worker_model_path="/m",
        worker_structured_outputs_backend="auto",
    )
    assert engine_args_from_settings(API, auto).kwargs["structured_outputs_config"] == {
        "backend": "auto"
    }


def test_on_vllms_cpu_build_the_rotary_embedding_is_pytorchs_own() -> None:
    """The C++ rotary kernel of vLLM's CPU build turned the real model's answers to
    gibberish under enforce_eager on an AVX-512 machine (ADR 0062); a GPU keeps vLLM's
    kernels."""
    cpu = replace(API, cpu=True)
    args = engine_args(cpu, model="/models/x", max_num_seqs=2, enforce_eager=True)
    assert args.kwargs["compilation_config"] == {"custom_ops": ["-rotary_embedding"]}
    assert "compilation_config" not in engine_args(API, model="/models/x", max_num_seqs=2).kwargs


def test_engine_args_need_a_model_path() -> None:
    with pytest.raises(ValueError, match="MODEL_PATH"):
        engine_args_from_settings(API, WorkerSettings(worker_engine="vllm"))


@pytest.mark.parametrize(
    ("vllm", "ours"),
    [
        ("stop", "stop"),
        ("length", "length"),
        ("repetition", "repetition"),
        ("abort", "cancelled"),
        (None, "cancelled"),
        ("error", None),
    ],
)
def test_finish_reasons_keep_their_meaning(vllm: str | None, ours: str | None) -> None:
    assert finish_reason(vllm) == ours


async def test_an_error_finish_fails_the_request_and_a_repetition_ends_it() -> None:
    engine, llm = await started_engine()
    llm.script["bad-0"] = [out("bad-0", "x", [1], "error")]
    with pytest.raises(EngineRequestFailed, match="finish_reason 'error'"):
        _ = [o async for o in engine.generate(EngineRequest("bad", "p", 10))]
    llm.script["rep-1"] = [out("rep-1", "la la", [1, 2], "repetition")]
    outputs = [o async for o in engine.generate(EngineRequest("rep", "p", 10))]
    assert outputs[-1] == EngineFinish("repetition", prompt_tokens=2, completion_tokens=2)
    assert engine.capacity().free_slots == 4
    await engine.stop()


async def test_each_submission_gets_its_own_vllm_request_id() -> None:
    """A re-run of a request (its next attempt, here) must not collide in vLLM with the
    abort of the attempt before it: vLLM's ids are per submission."""
    engine, llm = await started_engine()
    llm.hang_after_script.update({"r-0", "r-1"})
    first = engine.generate(EngineRequest("r", "p", 10))
    task = asyncio.ensure_future(anext(first))
    await calls_reach(llm, 1)
    assert await engine.abort("r")
    assert await task == EngineFinish("cancelled", 2, 0)
    second = engine.generate(EngineRequest("r", "p", 10))
    task = asyncio.ensure_future(anext(second))
    await calls_reach(llm, 2)
    assert [c["request_id"] for c in llm.generate_calls] == ["r-0", "r-1"]
    assert llm.aborted == ["r-0"]
    await engine.abort("r")
    await task
    await engine.stop()


async def test_generate_forwards_sampling_priority_and_trace_headers() -> None:
    engine, llm = await started_engine()
    llm.script["r1-0"] = [out("r1-0", "Hel", [7, 8]), out("r1-0", "lo", [9], "length")]
    request = EngineRequest(
        request_id="r1",
        prompt="hi",
        max_tokens=3,
        temperature=0.7,
        top_p=0.9,
        stop=("END",),
        seed=42,
        priority=1,
        trace_headers={"traceparent": "00-abc-def-01"},
    )
    outputs = [o async for o in engine.generate(request)]
    assert outputs == [
        EngineDelta("Hel", 2, prompt_tokens=3),  # the first output says the prompt's
        EngineDelta("lo", 1),
        EngineFinish("length", prompt_tokens=3, completion_tokens=3),
    ]
    (call,) = llm.generate_calls
    assert call["prompt"] == {"prompt_token_ids": [BOS, ord("h"), ord("i")]}
    assert call["request_id"] == "r1-0"
    assert call["priority"] == 1
    assert call["trace_headers"] == {"traceparent": "00-abc-def-01"}
    assert call["sampling_params"] == dict(
        n=1,
        max_tokens=3,
        temperature=0.7,
        top_p=0.9,
        stop=["END"],
        seed=42,
        output_kind=DELTA,
        # Unset: vLLM's neutral values (the fake model has no generation defaults).
        top_k=0,
        min_p=0.0,
        repetition_penalty=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        min_tokens=0,
        ignore_eos=False,
        stop_token_ids=None,
        logit_bias=None,
        logprobs=None,
    )
    assert engine.capacity().free_slots == 4


async def test_every_sampling_field_reaches_sampling_params() -> None:
    engine, llm = await started_engine()
    llm.script["r1-0"] = [out("r1-0", "x", [7], "length")]
    request = EngineRequest(
        request_id="r1",
        prompt="hi",
        max_tokens=3,
        top_k=5,
        min_p=0.1,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={11: -100.0},
        min_tokens=2,
        ignore_eos=True,
        stop_token_ids=(2, 9),
        seed=4,
    )
    assert engine.sampling_fields == SAMPLING_FIELDS | OUTPUT_FIELDS | STRUCTURED_FIELDS
    _ = [o async for o in engine.generate(request)]
    params = llm.generate_calls[0]["sampling_params"]
    assert {k: params[k] for k in SAMPLING_FIELDS} == dict(
        top_k=5,
        min_p=0.1,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={11: -100.0},
        min_tokens=2,
        ignore_eos=True,
        stop_token_ids=[2, 9],
        seed=4,
    )
    await engine.stop()


async def test_unset_sampling_takes_the_models_generation_defaults() -> None:
    engine, llm = await started_engine(defaults={"temperature": 0.6, "top_k": 20, "max_tokens": 9})
    assert engine.sampling_defaults == {"temperature": 0.6, "top_k": 20}
    llm.script["r1-0"] = [out("r1-0", "x", [7], "length")]
    llm.script["r2-1"] = [out("r2-1", "x", [7], "length")]
    _ = [o async for o in engine.generate(EngineRequest("r1", "hi", 3))]
    _ = [o async for o in engine.generate(EngineRequest("r2", "hi", 3, temperature=0.0, top_k=3))]
    unset, given = (c["sampling_params"] for c in llm.generate_calls)
    assert (unset["temperature"], unset["top_k"], unset["top_p"]) == (0.6, 20, 1.0)
    assert (given["temperature"], given["top_k"]) == (0.0, 3)
    assert unset["max_tokens"] == given["max_tokens"] == 3  # the request's, never the config's
    await engine.stop()
    await engine.stop()
    assert llm.shut_down


async def test_chat_requests_reach_vllm_as_template_token_ids_with_one_bos() -> None:
    engine, llm = await started_engine()
    llm.script["c-0"] = [out("c-0", "ok", [5], "stop")]
    request = EngineRequest(
        request_id="c",
        prompt="user: hi",
        max_tokens=4,
        messages=(ChatTurn("system", "be brief"), ChatTurn("user", "hi")),
    )
    outputs = [o async for o in engine.generate(request)]
    rendered = "<system>be brief<user>hi<assistant>"
    ids = llm.generate_calls[0]["prompt"]["prompt_token_ids"]
    assert ids == [BOS, *map(ord, rendered)]  # the template's BOS, not a second one
    assert outputs[-1] == EngineFinish("stop", len(ids), 1)  # usage: the templated count
    assert llm.generate_calls[0]["trace_headers"] is None
    llm.tokenizer.chat_template = None  # no template: the joined turns, as a plain prompt
    llm.script["p-1"] = [out("p-1", "ok", [5], "stop")]
    _ = [
        o
        async for o in engine.generate(EngineRequest("p", "user: hi", 4, messages=request.messages))
    ]
    assert llm.generate_calls[1]["prompt"] == {"prompt_token_ids": [BOS, *map(ord, "user: hi")]}
    await engine.stop()


async def test_abort_calls_vllm_ends_the_stream_and_frees_capacity() -> None:
    engine, llm = await started_engine(max_num_seqs=2)
    llm.script["a-0"] = [out("a-0", "x", [1])]
    llm.hang_after_script.add("a-0")
    stream = engine.generate(EngineRequest("a", "p", None))  # unset: to the context's end
    assert await anext(stream) == EngineDelta("x", 1, prompt_tokens=2)
    cap = engine.capacity()
    assert (cap.free_slots, cap.running, cap.queued) == (1, 1, 0)
    # Its prompt (2) and the rest of the context (64 - 2), less the one token generated.
    assert cap.queued_tokens == 2 + 62 - 1
    assert await engine.abort("a") is True
    assert engine.capacity().free_slots == 2
    assert "a-0" in llm.aborted
    rest = [o async for o in stream]
    assert rest == [EngineFinish("cancelled", prompt_tokens=2, completion_tokens=1)]
    assert await engine.abort("a") is False
    await engine.stop()


async def test_capacity_counts_requests_beyond_max_num_seqs_as_queued() -> None:
    engine, llm = await started_engine(max_num_seqs=1)
    for rid in ("q1-0", "q2-1", "q3-2"):
        llm.hang_after_script.add(rid)
    streams = [engine.generate(EngineRequest(rid, "p", 10)) for rid in ("q1", "q2", "q3")]
    tasks = [asyncio.ensure_future(anext(s)) for s in streams]
    await calls_reach(llm, 3)  # the three pump tasks reached vLLM
    cap = engine.capacity()
    assert (cap.total_slots, cap.free_slots, cap.running, cap.queued) == (1, 0, 1, 2)
    for rid in ("q1", "q2", "q3"):
        await engine.abort(rid)
    for task in tasks:
        assert await task == EngineFinish("cancelled", 2, 0)
    for s in streams:
        await s.aclose()  # type: ignore[attr-defined]
    await engine.stop()


async def test_capacity_follows_vllms_scheduler_stats() -> None:
    """vLLM's running and waiting counts and KV-cache use, from the stat logger vLLM calls
    after each step (as vLLM calls it: keywords), reach the capacity the heartbeat sends."""
    engine, llm = await started_engine(max_num_seqs=4)
    (logger,) = llm.stat_loggers
    for rid in ("k1-0", "k2-1", "k3-2"):
        llm.hang_after_script.add(rid)
    streams = [engine.generate(EngineRequest(rid, "p", 10)) for rid in ("k1", "k2", "k3")]
    tasks = [asyncio.ensure_future(anext(s)) for s in streams]
    await calls_reach(llm, 3)
    # The KV cache is full: vLLM runs two and keeps one waiting, below max_num_seqs.
    stats = FakeSchedulerStats(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.97)
    logger.record(stats, None, mm_cache_stats=None, engine_idx=0)
    cap = engine.capacity()
    assert (cap.running, cap.queued, cap.free_slots) == (2, 1, 0)
    assert cap.kv_cache_usage == 0.97
    for rid in ("k1", "k2", "k3"):
        await engine.abort(rid)
    # No step follows the last abort: the stale waiting count must not hold the slots.
    assert engine.capacity().free_slots == 4
    for task in tasks:
        await task
    await engine.stop()


@dataclass
class FakeSchedulerStats:
    """Shaped as vLLM's `SchedulerStats` (the fields the adapter reads)."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    prefix_cache_stats: Any = None


async def test_closing_the_stream_early_aborts_in_vllm() -> None:
    engine, llm = await started_engine()
    llm.script["g-0"] = [out("g-0", "a", [1])]
    llm.hang_after_script.add("g-0")
    stream = engine.generate(EngineRequest("g", "p", 10))
    await anext(stream)
    await stream.aclose()  # type: ignore[attr-defined]
    assert llm.aborted == ["g-0"]
    assert engine.capacity().free_slots == 4
    await engine.stop()


async def test_an_error_inside_vllm_reaches_the_caller() -> None:
    engine, llm = await started_engine()

    async def broken(*args: Any, **kwargs: Any) -> AsyncIterator[FakeRequestOutput]:
        raise RuntimeError("engine dead")
        yield  # pragma: no cover

    llm.generate = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="engine dead"):
        _ = [o async for o in engine.generate(EngineRequest("e", "p", 10))]
    assert engine.capacity().free_slots == 4
    await engine.stop()


async def test_a_prompt_over_max_model_len_is_refused_before_vllm_sees_it() -> None:
    engine, llm = await started_engine()
    assert engine.context_length == 64  # AsyncLLM.model_config.max_model_len
    with pytest.raises(PromptTooLong) as refused:
        _ = [o async for o in engine.generate(EngineRequest("long", "x" * 64, max_tokens=4))]
    assert "65 tokens" in str(refused.value)  # the BOS counts
    assert "context length of 64 tokens" in str(refused.value)
    assert llm.generate_calls == []  # vLLM never got it
    assert engine.capacity().free_slots == 4
    # The whole context: no room for an output token, as vLLM 0.32 refuses it (ADR 0051).
    with pytest.raises(PromptTooLong, match="64 tokens, all of the model's context"):
        _ = [o async for o in engine.generate(EngineRequest("whole", "x" * 63, max_tokens=4))]
    # A max_tokens above the whole context, as vLLM's server refuses it.
    with pytest.raises(MaxTokensOverContext, match="maximum context length is 64 tokens"):
        _ = [o async for o in engine.generate(EngineRequest("over", "x", max_tokens=65))]
    assert llm.generate_calls == []
    llm.script["fits-0"] = [out("fits-0", "ok", [1], "stop")]
    outputs = [o async for o in engine.generate(EngineRequest("fits", "x" * 62, max_tokens=4))]
    assert isinstance(outputs[-1], EngineFinish)
    assert outputs[-1].finish_reason == "stop"  # one token short of the context: accepted
    await engine.stop()


async def test_an_unset_max_tokens_reaches_vllm_unset() -> None:
    engine, llm = await started_engine()
    llm.script["r1-0"] = [out("r1-0", "x", [7], "stop")]
    _ = [o async for o in engine.generate(EngineRequest("r1", "hi", None))]
    [call] = llm.generate_calls
    # vLLM fills in max_model_len - prompt length itself (InputProcessor, 0.32).
    assert call["sampling_params"]["max_tokens"] is None
    await engine.stop()


async def test_logprobs_are_asked_of_vllm_and_read_per_new_token() -> None:
    engine, llm = await started_engine()
    # Two deltas: one token (sampled = rank 1), then two (the second sampled at rank 7,
    # below the asked top 2; vLLM left one undecoded, and one -inf).
    first = out("r1-0", "a", [97])
    first.outputs[0].logprobs = [
        {97: FakeLogprob(-0.1, 1, "a"), 98: FakeLogprob(-2.5, 2, "b")},
    ]
    second = out("r1-0", "cd", [99, 100], "length")
    second.outputs[0].logprobs = [
        {99: FakeLogprob(-0.2, 1, None), 101: FakeLogprob(-3.0, 2, "e")},
        {
            100: FakeLogprob(float("-inf"), 7, "d"),
            102: FakeLogprob(-0.5, 1, "f"),
            103: FakeLogprob(-1.5, 2, "g"),
        },
    ]
    llm.script["r1-0"] = [first, second]
    outputs = [o async for o in engine.generate(EngineRequest("r1", "hi", 3, logprobs=2))]
    assert llm.generate_calls[0]["sampling_params"]["logprobs"] == 2
    deltas = [o for o in outputs if isinstance(o, EngineDelta)]
    assert [d.logprobs for d in deltas] == [
        (
            TokenLogprob(
                token="a",
                logprob=-0.1,
                top=[TopLogprob(token="a", logprob=-0.1), TopLogprob(token="b", logprob=-2.5)],
            ),
        ),
        (
            TokenLogprob(
                token="c",  # decoded by the tokenizer: vLLM gave no text
                logprob=-0.2,
                top=[TopLogprob(token="c", logprob=-0.2), TopLogprob(token="e", logprob=-3.0)],
            ),
            TokenLogprob(
                token="d",
                logprob=-9999.0,  # -inf, as vLLM's server writes it
                top=[TopLogprob(token="f", logprob=-0.5), TopLogprob(token="g", logprob=-1.5)],
            ),
        ),
    ]
    await engine.stop()


async def test_no_logprobs_asked_none_given() -> None:
    engine, llm = await started_engine()
    llm.script["r1-0"] = [out("r1-0", "a", [97], "length")]
    outputs = [o async for o in engine.generate(EngineRequest("r1", "hi", 3))]
    assert llm.generate_calls[0]["sampling_params"]["logprobs"] is None
    assert [o.logprobs for o in outputs if isinstance(o, EngineDelta)] == [None]
    await engine.stop()


async def test_logprobs_zero_gives_the_chosen_tokens_own_only() -> None:
    engine, llm = await started_engine()
    done = out("r1-0", "a", [97], "length")
    done.outputs[0].logprobs = [{97: FakeLogprob(-0.3, 4, "a")}]
    llm.script["r1-0"] = [done]
    outputs = [o async for o in engine.generate(EngineRequest("r1", "hi", 3, logprobs=0))]
    assert [o.logprobs for o in outputs if isinstance(o, EngineDelta)] == [
        (TokenLogprob(token="a", logprob=-0.3, top=[]),)
    ]
    await engine.stop()
