"""The `vllm` engine: an adapter over vLLM's `AsyncLLM` (optional extra `tokenbus[vllm]`).

Written against vLLM's v1 engine API (`vllm/v1/engine/async_llm.py` on main at commit
00080ee, between v0.16 and v0.18; see docs/engines.md): `AsyncLLM.from_engine_args`,
`generate(prompt, sampling_params, request_id, trace_headers=, priority=)` yielding
`RequestOutput`s, `abort(request_id)`, `SamplingParams(output_kind=RequestOutputKind.DELTA)`,
and the `stat_loggers` factories of `from_engine_args` (`vllm/v1/metrics/loggers.py`
StatLoggerBase: `record(scheduler_stats, iteration_stats, engine_idx)`), from which the
prefix-cache hit rate is read (`SchedulerStats.prefix_cache_stats`, a `PrefixCacheStats` of
requests, queries and hits in tokens, `vllm/v1/metrics/stats.py`).
vLLM is imported only by `load_vllm`, so this module imports (and is tested) without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from services.worker.engines.base import (
    Capacity,
    EngineDelta,
    EngineFinish,
    EngineOutput,
    EngineRequest,
    FinishReason,
    check_prompt,
)
from services.worker.settings import WorkerSettings
from shared.tokens import estimate_tokens

log = structlog.get_logger()


class AsyncLLMLike(Protocol):
    """The slice of `vllm.v1.engine.async_llm.AsyncLLM` this adapter calls."""

    def generate(
        self,
        prompt: Any,
        sampling_params: Any,
        request_id: str,
        *,
        trace_headers: dict[str, str] | None = None,
        priority: int = 0,
    ) -> AsyncIterator[Any]: ...

    async def abort(self, request_id: str) -> None: ...

    def get_tokenizer(self) -> Any: ...

    def shutdown(self) -> None: ...


@dataclass(frozen=True)
class VllmApi:
    """The vLLM names the adapter uses: the real ones from `load_vllm`, or a test's fakes."""

    async_llm: Any  # has from_engine_args(engine_args) -> AsyncLLMLike
    engine_args: Callable[..., Any]  # AsyncEngineArgs
    sampling_params: Callable[..., Any]  # SamplingParams
    delta_output_kind: Any  # RequestOutputKind.DELTA


def load_vllm() -> VllmApi:
    """Import vLLM; raises ImportError where the `vllm` extra is not installed."""
    from vllm.engine.arg_utils import (  # type: ignore[import-not-found,unused-ignore]
        AsyncEngineArgs,
    )
    from vllm.sampling_params import (  # type: ignore[import-not-found,unused-ignore]
        RequestOutputKind,
        SamplingParams,
    )
    from vllm.v1.engine.async_llm import AsyncLLM  # type: ignore[import-not-found,unused-ignore]

    return VllmApi(AsyncLLM, AsyncEngineArgs, SamplingParams, RequestOutputKind.DELTA)


def engine_args_from_settings(api: VllmApi, settings: WorkerSettings) -> Any:
    if settings.worker_model_path is None:
        raise ValueError("the vllm engine needs TOKENBUS_WORKER_MODEL_PATH")
    return engine_args(
        api,
        model=settings.worker_model_path,
        max_num_seqs=settings.worker_max_num_seqs,
        dtype=settings.worker_dtype,
        quantization=settings.worker_quantization,
        gpu_memory_utilization=settings.worker_gpu_memory_utilization,
        max_model_len=settings.worker_max_model_len,
        tensor_parallel_size=settings.worker_tensor_parallel_size,
    )


def engine_args(
    api: VllmApi,
    *,
    model: str,
    max_num_seqs: int,
    dtype: str = "auto",
    quantization: str | None = None,
    gpu_memory_utilization: float = 0.9,
    max_model_len: int | None = None,
    tensor_parallel_size: int = 1,
) -> Any:
    """`AsyncEngineArgs` for a worker: priority scheduling, so tier priority is honoured."""
    return api.engine_args(
        model=model,
        dtype=dtype,
        quantization=quantization,
        gpu_memory_utilization=gpu_memory_utilization,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        tensor_parallel_size=tensor_parallel_size,
        scheduling_policy="priority",
    )


def sampling_params(api: VllmApi, request: EngineRequest) -> Any:
    """`SamplingParams` streaming deltas, with the request's limits and stop strings."""
    return api.sampling_params(
        n=1,
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        stop=list(request.stop) or None,
        seed=request.seed,
        output_kind=api.delta_output_kind,
    )


def finish_reason(vllm_reason: str | None) -> FinishReason:
    """vLLM's `CompletionOutput.finish_reason` ("stop", "length", "abort") in our terms."""
    if vllm_reason == "length":
        return "length"
    if vllm_reason == "stop":
        return "stop"
    return "cancelled"


# vLLM's own hit rate covers its last 1000 requests (PrefixCachingMetrics.max_recent_requests).
HIT_RATE_REQUESTS = 1000


class PrefixCacheWindow:
    """vLLM's prefix-cache hit rate over its last `max_requests` requests, as vLLM logs it.

    Fed every `PrefixCacheStats` the engine reports (`reset`, `requests`, `queries`, `hits`;
    queries and hits count tokens); a reset of the cache empties the window.
    """

    def __init__(self, max_requests: int = HIT_RATE_REQUESTS) -> None:
        self.max_requests = max_requests
        self._updates: deque[tuple[int, int, int]] = deque()  # (requests, queries, hits)
        self._requests = self._queries = self._hits = 0

    def observe(self, stats: Any) -> None:
        if getattr(stats, "reset", False):
            self._updates.clear()
            self._requests = self._queries = self._hits = 0
        requests = int(getattr(stats, "requests", 0))
        if requests <= 0:
            return
        update = (requests, int(stats.queries), int(stats.hits))
        self._updates.append(update)
        self._requests += update[0]
        self._queries += update[1]
        self._hits += update[2]
        while len(self._updates) > 1 and self._requests - self._updates[0][0] >= self.max_requests:
            old = self._updates.popleft()
            self._requests -= old[0]
            self._queries -= old[1]
            self._hits -= old[2]

    @property
    def hit_rate(self) -> float | None:
        return None if self._queries <= 0 else self._hits / self._queries


class PrefixCacheStatLogger:
    """A vLLM stat logger (the StatLoggerBase interface) that feeds a `PrefixCacheWindow`."""

    def __init__(self, window: PrefixCacheWindow) -> None:
        self.window = window

    def record(self, scheduler_stats: Any, iteration_stats: Any, engine_idx: int = 0) -> None:
        stats = getattr(scheduler_stats, "prefix_cache_stats", None)
        if stats is not None:
            self.window.observe(stats)

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass


def stat_logger_factory(window: PrefixCacheWindow) -> Callable[..., PrefixCacheStatLogger]:
    """A `StatLoggerFactory` (called with the VllmConfig and an engine index)."""

    def make(vllm_config: Any, engine_index: int = 0) -> PrefixCacheStatLogger:
        return PrefixCacheStatLogger(window)

    return make


@dataclass
class _InFlight:
    request: EngineRequest
    prompt_tokens: int
    outputs: asyncio.Queue[EngineOutput | BaseException] = field(default_factory=asyncio.Queue)
    generated: int = 0
    pump: asyncio.Task[None] | None = None
    finished: bool = False

    def finish(self, out: EngineFinish) -> None:
        if not self.finished:
            self.finished = True
            self.outputs.put_nowait(out)


class VllmEngine:
    """Streams vLLM `RequestOutput` deltas as engine outputs; one pump task per request."""

    name = "vllm"
    cpu_seconds = 0.0  # the engine core runs in its own process

    def __init__(self, api: VllmApi, args: Any) -> None:
        self._api = api
        self._args = args
        self._max_num_seqs = int(args.max_num_seqs)
        self._llm: AsyncLLMLike | None = None
        self._inflight: dict[str, _InFlight] = {}
        self.context_length: int | None = getattr(args, "max_model_len", None)
        self.prefix_cache = PrefixCacheWindow()

    async def start(self) -> None:
        if self._llm is None:
            factory = stat_logger_factory(self.prefix_cache)
            try:
                self._llm = self._api.async_llm.from_engine_args(self._args, stat_loggers=[factory])
            except TypeError as exc:  # a vLLM without custom stat loggers
                log.warning("vllm.no_stat_loggers", error=repr(exc))
                self._llm = self._api.async_llm.from_engine_args(self._args)
            self.context_length = _max_model_len(self._llm) or self.context_length

    async def stop(self) -> None:
        for flight in list(self._inflight.values()):
            await self._cancel(flight)
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        llm = self._require_llm()
        prompt = await self._render_prompt(llm, request)
        if self.context_length is not None:
            # vLLM would refuse it too, but as an engine error; refused here, it is the
            # client's: `invalid_request`, naming the limit.
            tokenizer = await self._tokenizer(llm)
            check_prompt(len(tokenizer.encode(prompt)), self.context_length)
        flight = _InFlight(request, estimate_tokens(prompt))
        self._inflight[request.request_id] = flight
        stream = llm.generate(
            prompt,
            sampling_params(self._api, request),
            request.request_id,
            trace_headers=dict(request.trace_headers) or None,
            priority=request.priority,
        )
        flight.pump = asyncio.create_task(self._pump(flight, stream), name="vllm-pump")
        try:
            while True:
                out = await flight.outputs.get()
                if isinstance(out, BaseException):
                    raise out
                yield out
                if isinstance(out, EngineFinish):
                    return
        finally:
            if not flight.finished:  # the consumer went away: free the slot in vLLM too
                await self._cancel(flight)
            self._inflight.pop(request.request_id, None)

    async def abort(self, request_id: str) -> bool:
        flight = self._inflight.pop(request_id, None)
        if flight is None:
            return False
        await self._cancel(flight)
        return True

    def capacity(self) -> Capacity:
        # vLLM admits up to max_num_seqs at once and queues the rest (by priority).
        in_flight = len(self._inflight)
        running = min(in_flight, self._max_num_seqs)
        queued_tokens = sum(
            f.prompt_tokens + f.request.max_tokens - f.generated for f in self._inflight.values()
        )
        return Capacity(
            total_slots=self._max_num_seqs,
            free_slots=max(0, self._max_num_seqs - in_flight),
            running=running,
            queued=in_flight - running,
            queued_tokens=queued_tokens,
            utilisation=running / self._max_num_seqs,
            prefix_cache_hit_rate=self.prefix_cache.hit_rate,
        )

    def _require_llm(self) -> AsyncLLMLike:
        if self._llm is None:
            raise RuntimeError("VllmEngine.start() has not run")
        return self._llm

    @staticmethod
    async def _tokenizer(llm: AsyncLLMLike) -> Any:
        tokenizer = llm.get_tokenizer()
        if inspect.isawaitable(tokenizer):  # async before vLLM 0.12
            tokenizer = await tokenizer
        return tokenizer

    async def _render_prompt(self, llm: AsyncLLMLike, request: EngineRequest) -> str:
        if request.messages is None:
            return request.prompt
        tokenizer = await self._tokenizer(llm)
        if not getattr(tokenizer, "chat_template", None):
            return request.prompt
        rendered: str = tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in request.messages],
            tokenize=False,
            add_generation_prompt=True,
        )
        return rendered

    async def _pump(self, flight: _InFlight, stream: AsyncIterator[Any]) -> None:
        try:
            async for out in stream:
                completion = out.outputs[0]
                tokens = len(completion.token_ids)
                flight.generated += tokens
                if completion.text or tokens:
                    flight.outputs.put_nowait(EngineDelta(completion.text, tokens))
                if out.prompt_token_ids is not None:
                    flight.prompt_tokens = len(out.prompt_token_ids)
                if out.finished:
                    flight.finish(
                        EngineFinish(
                            finish_reason(completion.finish_reason),
                            flight.prompt_tokens,
                            flight.generated,
                        )
                    )
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.error("vllm.generate_failed", request_id=flight.request.request_id, error=repr(exc))
            flight.finished = True
            flight.outputs.put_nowait(exc)
            return
        # A stream that ends without a finished output was aborted inside vLLM.
        flight.finish(EngineFinish("cancelled", flight.prompt_tokens, flight.generated))

    async def _cancel(self, flight: _InFlight) -> None:
        """Stop the request in vLLM and end its stream with "cancelled"."""
        self._inflight.pop(flight.request.request_id, None)
        flight.finish(EngineFinish("cancelled", flight.prompt_tokens, flight.generated))
        if flight.pump is not None and not flight.pump.done():
            # Cancelling vLLM's generate() makes it abort the request itself.
            flight.pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flight.pump
        if self._llm is not None:
            await self._llm.abort(flight.request.request_id)


def _max_model_len(llm: Any) -> int | None:
    """The context length vLLM settled on (`AsyncLLM.model_config.max_model_len`)."""
    value = getattr(getattr(llm, "model_config", None), "max_model_len", None)
    return value if isinstance(value, int) else None
