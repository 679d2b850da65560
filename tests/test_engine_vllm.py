"""The vLLM adapter's mapping, checked against a recording fake of vLLM's AsyncLLM interface.

The fake stands in for `vllm.v1.engine.async_llm.AsyncLLM` and friends (vLLM cannot be
installed here); the contract suite runs the adapter against real vLLM where it exists.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest

from services.worker.engines.base import (
    ChatTurn,
    EngineDelta,
    EngineFinish,
    EngineRequest,
    PromptTooLong,
)
from services.worker.engines.vllm import (
    VllmApi,
    VllmEngine,
    engine_args,
    engine_args_from_settings,
    finish_reason,
)
from services.worker.settings import WorkerSettings

DELTA = "RequestOutputKind.DELTA(fake)"


@dataclass
class FakeCompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


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


@dataclass
class FakeTokenizer:
    chat_template: str | None = "{fake}"
    rendered: list[list[dict[str, str]]] = field(default_factory=list)

    def apply_chat_template(
        self, messages: list[dict[str, str]], *, tokenize: bool, add_generation_prompt: bool
    ) -> str:
        assert tokenize is False
        assert add_generation_prompt is True
        self.rendered.append(messages)
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def encode(self, text: str) -> list[int]:
        """One token per character, like the tiny test model's tokenizer."""
        return [ord(c) for c in text]


@dataclass
class FakeModelConfig:
    max_model_len: int


class FakeAsyncLLM:
    """Records every call; streams scripted outputs, waits forever where told to."""

    instances: ClassVar[list[FakeAsyncLLM]] = []

    def __init__(self, args: FakeEngineArgs) -> None:
        self.args = args
        self.generate_calls: list[dict[str, Any]] = []
        self.aborted: list[str] = []
        self.shut_down = False
        self.tokenizer = FakeTokenizer()
        self.script: dict[str, list[FakeRequestOutput]] = {}
        self.hang_after_script: set[str] = set()
        self.model_config = FakeModelConfig(max_model_len=64)
        FakeAsyncLLM.instances.append(self)

    @classmethod
    def from_engine_args(cls, args: FakeEngineArgs) -> FakeAsyncLLM:
        return cls(args)

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


def fake_sampling_params(**kwargs: Any) -> dict[str, Any]:
    return kwargs


def fake_engine_args(**kwargs: Any) -> FakeEngineArgs:
    return FakeEngineArgs(kwargs)


API = VllmApi(FakeAsyncLLM, fake_engine_args, fake_sampling_params, DELTA)


async def started_engine(max_num_seqs: int = 4) -> tuple[VllmEngine, FakeAsyncLLM]:
    engine = VllmEngine(API, engine_args(API, model="/models/x", max_num_seqs=max_num_seqs))
    await engine.start()
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
    )


def test_engine_args_need_a_model_path() -> None:
    with pytest.raises(ValueError, match="MODEL_PATH"):
        engine_args_from_settings(API, WorkerSettings(worker_engine="vllm"))


@pytest.mark.parametrize(
    ("vllm", "ours"),
    [("stop", "stop"), ("length", "length"), ("abort", "cancelled"), (None, "cancelled")],
)
def test_finish_reasons_map(vllm: str | None, ours: str) -> None:
    assert finish_reason(vllm) == ours


async def test_generate_forwards_sampling_priority_and_trace_headers() -> None:
    engine, llm = await started_engine()
    llm.script["r1"] = [out("r1", "Hel", [7, 8]), out("r1", "lo", [9], "length")]
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
        EngineDelta("Hel", 2),
        EngineDelta("lo", 1),
        EngineFinish("length", prompt_tokens=3, completion_tokens=3),
    ]
    (call,) = llm.generate_calls
    assert call["prompt"] == "hi"
    assert call["request_id"] == "r1"
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
    )
    assert engine.capacity().free_slots == 4
    await engine.stop()
    assert llm.shut_down


async def test_chat_requests_use_the_model_chat_template() -> None:
    engine, llm = await started_engine()
    llm.script["c"] = [out("c", "ok", [5], "stop")]
    request = EngineRequest(
        request_id="c",
        prompt="user: hi",
        max_tokens=4,
        messages=(ChatTurn("system", "be brief"), ChatTurn("user", "hi")),
    )
    outputs = [o async for o in engine.generate(request)]
    assert outputs[-1] == EngineFinish("stop", 3, 1)
    assert llm.generate_calls[0]["prompt"] == "<system>be brief<user>hi<assistant>"
    assert llm.generate_calls[0]["trace_headers"] is None
    llm.tokenizer.chat_template = None
    llm.script["p"] = [out("p", "ok", [5], "stop")]
    _ = [
        o
        async for o in engine.generate(EngineRequest("p", "user: hi", 4, messages=request.messages))
    ]
    assert llm.generate_calls[1]["prompt"] == "user: hi"
    await engine.stop()


async def test_abort_calls_vllm_ends_the_stream_and_frees_capacity() -> None:
    engine, llm = await started_engine(max_num_seqs=2)
    llm.script["a"] = [out("a", "x", [1])]
    llm.hang_after_script.add("a")
    stream = engine.generate(EngineRequest("a", "p", 100))
    assert await anext(stream) == EngineDelta("x", 1)
    cap = engine.capacity()
    assert (cap.free_slots, cap.running, cap.queued) == (1, 1, 0)
    assert await engine.abort("a") is True
    assert engine.capacity().free_slots == 2
    assert "a" in llm.aborted
    rest = [o async for o in stream]
    assert rest == [EngineFinish("cancelled", prompt_tokens=3, completion_tokens=1)]
    assert await engine.abort("a") is False
    await engine.stop()


async def test_capacity_counts_requests_beyond_max_num_seqs_as_queued() -> None:
    engine, llm = await started_engine(max_num_seqs=1)
    for rid in ("q1", "q2", "q3"):
        llm.hang_after_script.add(rid)
    streams = [engine.generate(EngineRequest(rid, "p", 10)) for rid in ("q1", "q2", "q3")]
    tasks = [asyncio.ensure_future(anext(s)) for s in streams]
    for _ in range(1000):  # let the three pump tasks reach vLLM
        if len(llm.generate_calls) == 3:
            break
        await asyncio.sleep(0)
    cap = engine.capacity()
    assert (cap.total_slots, cap.free_slots, cap.running, cap.queued) == (1, 0, 1, 2)
    for rid in ("q1", "q2", "q3"):
        await engine.abort(rid)
    for task in tasks:
        assert await task == EngineFinish("cancelled", 1, 0)
    for s in streams:
        await s.aclose()  # type: ignore[attr-defined]
    await engine.stop()


async def test_closing_the_stream_early_aborts_in_vllm() -> None:
    engine, llm = await started_engine()
    llm.script["g"] = [out("g", "a", [1])]
    llm.hang_after_script.add("g")
    stream = engine.generate(EngineRequest("g", "p", 10))
    await anext(stream)
    await stream.aclose()  # type: ignore[attr-defined]
    assert llm.aborted == ["g"]
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
        _ = [o async for o in engine.generate(EngineRequest("long", "x" * 65, max_tokens=4))]
    assert "65 tokens" in str(refused.value)
    assert "context length of 64 tokens" in str(refused.value)
    assert llm.generate_calls == []  # vLLM never got it
    assert engine.capacity().free_slots == 4
    llm.script["fits"] = [out("fits", "ok", [1], "stop")]
    outputs = [o async for o in engine.generate(EngineRequest("fits", "x" * 64, max_tokens=4))]
    assert isinstance(outputs[-1], EngineFinish)
    assert outputs[-1].finish_reason == "stop"  # exactly the context length: accepted
    await engine.stop()
