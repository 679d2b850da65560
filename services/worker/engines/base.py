"""The `Engine` protocol every engine implements, and the values that cross it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from shared.context_limits import max_tokens_over_context
from shared.messages import (
    ResponseFormat,
    TokenLogprob,
    Tool,
    ToolCall,
    ToolChoice,
    not_honoured_message,
    sampling_needs,
    structured_needs,
)

# "repetition": vLLM's repetition detector ended it (its FinishReason.REPETITION).
FinishReason = Literal["stop", "length", "repetition", "cancelled"]


@dataclass(frozen=True)
class ChatTurn:
    """One message of a chat prompt; engines with a chat template render these themselves."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # the call a tool's message answers


@dataclass(frozen=True)
class EngineRequest:
    """One request to generate: the prompt, its sampling settings, where it stands in line.

    `prompt` is always set (for chat requests, the turns joined as `role: content` lines) so
    engines without a chat template, and the `sim` engine's deterministic text, use it as is;
    `messages` carries the turns for engines that apply the model's own chat template.
    """

    request_id: str
    prompt: str
    # None: the rest of the context (`tokens_to_generate`), as vLLM's `SamplingParams`.
    max_tokens: int | None
    # None: the model's default (vLLM: its generation config), as every sampling field.
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None  # None: the engine's own randomness
    # vLLM's sampling fields (shared/messages.py SAMPLING_FIELDS); an engine is never given
    # one set that it does not honour (`check_sampling`).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: Mapping[int, float] | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: tuple[int, ...] | None = None
    # Alternatives per token to return with each token's logprob (0: its own only); None:
    # no logprobs. An output field, checked as the sampling fields are.
    logprobs: int | None = None
    # Structured outputs (shared/messages.py STRUCTURED_FIELDS), checked as the sampling
    # fields are: the tools offered, which the answer may call, and the answer's format.
    tools: tuple[Tool, ...] | None = None
    tool_choice: ToolChoice | None = None  # None: auto with tools, else none
    parallel_tool_calls: bool | None = None  # False: one call at most
    response_format: ResponseFormat | None = None
    priority: int = 0  # lower runs first, as in vLLM's priority scheduling
    messages: tuple[ChatTurn, ...] | None = None
    trace_headers: Mapping[str, str] = field(default_factory=dict)
    # The prefix cache's salt (shared/prefixes.py `cache_salt`, one per tenant): a prompt
    # reuses cached blocks only of prompts with the same salt. None: unsalted.
    cache_salt: str | None = None
    # The answer's text so far, sent by the request's earlier attempts (QueuedRequest.
    # `continues`): generate what follows it, within `max_tokens` counted from the answer's
    # start, and count its tokens in the finish's `completion_tokens`. Given only to an
    # engine whose `continues_answers` is True (ADR 0071).
    continues: str | None = None


@dataclass(frozen=True)
class EngineDelta:
    """New text, and how many generated tokens it covers; with `logprobs` asked, one
    `TokenLogprob` per token, in order."""

    text: str
    tokens: int
    logprobs: tuple[TokenLogprob, ...] | None = None
    # On a stream's first output: the prompt's tokens, as the engine counts them (the OpenAI
    # API's `continuous_usage_stats`); None on the others.
    prompt_tokens: int | None = None


@dataclass(frozen=True)
class EngineFinish:
    """The last output of every stream: why it ended and the usage it is billed for."""

    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    # The tools the answer calls, parsed from its text (None: it calls none); `content`
    # is then the text besides the calls (None: none).
    tool_calls: tuple[ToolCall, ...] | None = None
    content: str | None = None


EngineOutput = EngineDelta | EngineFinish


@dataclass(frozen=True)
class Capacity:
    """What an engine can take now; the worker's heartbeat is built from this.

    `free_slots` counts sequences the engine could start without anyone waiting:
    `total_slots - running - queued`, never below zero.
    """

    total_slots: int
    free_slots: int
    running: int
    queued: int
    queued_tokens: int
    utilisation: float
    # Share of recent prompt tokens found in the engine's prefix cache; None: not known.
    prefix_cache_hit_rate: float | None = None
    # Share of the engine's KV cache in use (vLLM's scheduler stats); None: not known.
    kv_cache_usage: float | None = None


class RequestRefused(ValueError):
    """A request the engine cannot run as asked: the client's error (`invalid_request`)."""


class PromptTooLong(RequestRefused):
    """The prompt leaves no room in the model's context for one output token: refused
    before the engine sees it."""

    def __init__(self, prompt_tokens: int, context_length: int) -> None:
        how = "longer than" if prompt_tokens > context_length else "all of"
        super().__init__(
            f"the prompt is {prompt_tokens} tokens, {how} the model's context length"
            f" of {context_length} tokens: no room for an output token"
        )
        self.prompt_tokens = prompt_tokens
        self.context_length = context_length


class MaxTokensOverContext(RequestRefused):
    """`max_tokens` is above the model's context (shared/context_limits.py)."""


class FieldNotHonoured(RequestRefused):
    """The request sets a sampling field the engine does not honour: refused, never dropped."""

    def __init__(self, field: str, engine: str) -> None:
        super().__init__(not_honoured_message(field, [engine], None))
        self.field = field
        self.engine = engine


def check_sampling(request: EngineRequest, engine: str, honoured: frozenset[str]) -> None:
    """Raise `FieldNotHonoured` for the first field `request` sets that is not `honoured`.

    The edge refuses such a request when it knows the workers of its model; this is the
    worker's side of it, for a request that reached an engine the edge did not see.
    """
    asked = sampling_needs(lambda name: getattr(request, name)) | structured_needs(
        lambda name: getattr(request, name)
    )
    lacking = asked - honoured
    if lacking:
        raise FieldNotHonoured(min(lacking), engine)


def check_prompt(prompt_tokens: int, context_length: int | None) -> None:
    """Raise `PromptTooLong` if the prompt leaves no room for one output token in the
    context (None: unknown), as vLLM 0.32 counts it: a prompt of the whole context length
    is refused too."""
    if context_length is not None and prompt_tokens >= context_length:
        raise PromptTooLong(prompt_tokens, context_length)


def tokens_to_generate(
    prompt_tokens: int, max_tokens: int | None, context_length: int | None
) -> int:
    """How many tokens a request may generate, as vLLM 0.32 reckons it: `max_tokens`, never
    past the end of the context; unset, the rest of the context (max_model_len - prompt).

    Raises `PromptTooLong` (no room left), `MaxTokensOverContext` (`max_tokens` above the
    whole context, which vLLM's server refuses), or `RequestRefused` for an unset
    `max_tokens` on an engine that does not know its context.
    """
    check_prompt(prompt_tokens, context_length)
    if (why := max_tokens_over_context(max_tokens, context_length)) is not None:
        raise MaxTokensOverContext(why)
    if context_length is None:
        if max_tokens is None:
            raise RequestRefused(
                "max_tokens: required here, as this engine does not know its model's context"
                " length (set TOKENBUS_WORKER_MAX_MODEL_LEN)"
            )
        return max_tokens
    room = context_length - prompt_tokens
    return room if max_tokens is None else min(max_tokens, room)


class Engine(Protocol):
    """What a worker needs from an engine.

    `generate` submits the request and streams its `EngineDelta`s, always ending with one
    `EngineFinish` (finish_reason "cancelled" after `abort`). Closing the stream early
    aborts the request. A prompt longer than `context_length` raises `PromptTooLong` from
    the stream's first step, before the request is submitted, as does a request setting a
    sampling field it does not honour (`FieldNotHonoured`); any other exception from
    the stream is the engine failing that request. `abort` returns whether the request was
    still in the engine; once it returns, the request's slot is counted free in
    `capacity()`.

    An engine that continues an answer (`EngineRequest.continues`) says so with a class
    attribute `continues_answers = True`; without it, a request's next attempt starts over.
    """

    name: str
    # The sampling and output fields (shared/messages.py SAMPLING_FIELDS, OUTPUT_FIELDS) it
    # honours: advertised in the worker's heartbeat; a request setting another is refused
    # (`check_sampling`).
    sampling_fields: frozenset[str]
    # Tokens of context the model takes (prompt and generated); None: unknown, not checked.
    context_length: int | None
    # CPU seconds the engine's own steps have taken in the worker process so far, so the
    # worker's cost can be told apart from the engine's (0.0 where they run elsewhere or
    # are not measured).
    cpu_seconds: float

    async def start(self) -> None: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]: ...

    async def abort(self, request_id: str) -> bool: ...

    def capacity(self) -> Capacity: ...

    async def stop(self) -> None: ...


def engine_failure(engine: Engine) -> str | None:
    """Why the engine is dead, if it says so: an engine may have `failure() -> str | None`
    (vLLM: its engine core gone; the sim: its fault file); one without it never says."""
    failure = getattr(engine, "failure", None)
    return failure() if callable(failure) else None


class OutputSink(Protocol):
    """Where a push engine hands one request's outputs (`PushEngine.submit`).

    Called from the engine's step loop, synchronously and never awaited: one pass over a
    step's outputs reaches every request it touched (as vLLM's v1 output processor appends
    to each `RequestState`), so a token costs a call, not a task wakeup. A sink must not
    raise (it keeps its own failure for its run) nor call back into the engine.
    """

    def on_output(self, out: EngineOutput) -> None:
        """The request's next output; after its `EngineFinish` nothing more comes."""

    def on_error(self, error: Exception) -> None:
        """The engine failed this request (as an exception from `generate`'s stream)."""


@runtime_checkable
class PushEngine(Engine, Protocol):
    """An engine that can also push a request's outputs to a sink (`submit`).

    `submit` behaves as `generate` with its stream read to the end: deltas, then one
    `EngineFinish` ("cancelled" after `abort`), or `on_error`; a prompt longer than
    `context_length` raises `PromptTooLong` from `submit` itself, before the request is
    submitted. There is no stream to close: a caller that stops listening before the
    finish aborts the request (`abort`).
    """

    def submit(self, request: EngineRequest, sink: OutputSink) -> None: ...


@runtime_checkable
class StaticEngine(Engine, Protocol):
    """An engine that can also run a batch as one call (TOKENBUS_WORKER_BATCH_MODE=static).

    `generate_batch` submits every request at once, as one static batch: their prompts are
    padded to the longest, they start together, and their slots stay taken until the
    longest row has finished (Triton's static batcher, a padded `model.generate`). It
    returns one stream per request, in order, each behaving as `generate`'s does: deltas
    as the row's tokens come, then one `EngineFinish` as soon as that row is done (its own
    stop, EOS or max_tokens; the batch may run on for longer rows). A prompt longer than
    `context_length` is refused in its own stream (`PromptTooLong` at its first step) and
    left out of the batch. `abort`, or closing a stream once read from, ends that row's
    stream at once (closing one never read may not reach the engine: abort it); its slot
    is still taken until the batch ends. A batch larger than the engine's slots
    runs as consecutive static batches. While anything runs or waits, `capacity()` counts
    the batch's whole width as running.
    """

    def generate_batch(
        self, requests: Sequence[EngineRequest]
    ) -> list[AsyncIterator[EngineOutput]]: ...
