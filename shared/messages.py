"""Pydantic models of every record that crosses a Kafka topic."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from enum import StrEnum
from typing import Annotated, Any, Literal, Protocol, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    TypeAdapter,
    ValidationInfo,
    field_validator,
    model_validator,
)

from shared.schema_bounds import schema_problem
from shared.tokens import prompt_token_bound

TOPIC_NAME = r"^[A-Za-z0-9._-]{1,249}$"
REQUEST_ID = r"^[A-Za-z0-9._:-]{1,128}$"
# A model variant's name (shared/variants.py), as workers declare it.
VARIANT_NAME = r"^[A-Za-z0-9._-]{1,64}$"
# The largest max_tokens any service takes (a signed 32-bit count, as engines keep them).
MAX_TOKENS_LIMIT = 2**31 - 1


class Tier(StrEnum):
    """Priority tier; interactive rides first."""

    interactive = "interactive"
    background = "background"


class ErrorCode(StrEnum):
    """Stable error codes of the protocol."""

    invalid_request = "invalid_request"
    unauthorized = "unauthorized"
    rate_limited = "rate_limited"
    overloaded = "overloaded"
    deadline_exceeded = "deadline_exceeded"
    cancelled = "cancelled"
    not_found = "not_found"
    internal = "internal"


class RequestLimits(BaseModel):
    """Configured bounds a request is checked against (passed as validation context).

    `max_tokens_cap`: the operator's cap on `max_tokens` (None: none; the model's context
    caps it, at the edge and the worker). `default_max_tokens`: the output estimate that
    budgets and quota charges use for a request that sets no `max_tokens` (its answer runs
    to the end of the context or a stop, and may be longer: ADR 0051).
    """

    max_tokens_cap: int | None = None
    default_max_tokens: int = 256
    max_prompt_chars: int = 65536
    max_request_tokens: int | None = None  # prompt tokens + max_tokens; None: no bound


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _unset(value: object) -> bool:
    """A field added to a record later is left out of it while unset, so a reader that
    forbids unknown fields still reads the record: ingest reading a request, and every
    reader of a release before ADR 0072."""
    return value is None


class FunctionCall(Model):
    """What a tool call calls, as OpenAI shapes it: `arguments` is JSON text (an object)."""

    name: str = Field(min_length=1, max_length=256)
    arguments: str


class ToolCall(Model):
    """One call of a tool by the model, in OpenAI's shape (a chat message's `tool_calls`)."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


def _bounded_schema(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    """A structured-output schema within the bounds an engine compiles safely
    (shared/schema_bounds.py); else the validation error names the bound."""
    if schema is not None and (problem := schema_problem(schema)):
        raise ValueError(f"schema: {problem}")
    return schema


class FunctionDefinition(Model):
    """A function the model may call: `parameters` is its arguments' JSON schema."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _bounded(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        return _bounded_schema(schema)


class Tool(Model):
    """A tool offered to the model (OpenAI's `tools[]`; functions only)."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(Model):
    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(Model):
    """`tool_choice` naming one function: the answer is one call of it."""

    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaFormat(Model):
    """`response_format.json_schema`, as OpenAI shapes it (`schema` is the JSON schema)."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_by_name=True, serialize_by_alias=True
    )

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    # `schema` would shadow pydantic's own attribute: named so only in Python.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @field_validator("json_schema")
    @classmethod
    def _bounded(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        return _bounded_schema(schema)


class ResponseFormat(Model):
    """The answer's format: free text, any JSON object, or JSON valid against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type `json_schema`, and only then")
        return self


# The structured-output fields an engine may honour (as the sampling fields): `tools` with a
# tool_choice other than "none", and a `response_format` other than text.
StructuredField = Literal["tools", "response_format"]
STRUCTURED_FIELDS: frozenset[str] = frozenset(get_args(StructuredField))


def structured_needs(values: Callable[[str], object]) -> frozenset[str]:
    """The structured-output fields a request (a `ChatRequest`, an engine request) asks
    for; `values` reads a field by name."""
    needs: set[str] = set()
    if values("tools") and values("tool_choice") != "none":
        needs.add("tools")
    fmt = values("response_format")
    if isinstance(fmt, ResponseFormat) and fmt.type != "text":
        needs.add("response_format")
    return frozenset(needs)


class ChatMessage(Model):
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    # An assistant's calls (its content is then often ""), and the call a tool's message
    # answers: templated by the model's chat template (vLLM engine), never flattened.
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=128, exclude_if=_unset)
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=256, exclude_if=_unset)

    @model_validator(mode="after")
    def _calls_by_the_assistant(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message carries them")
        return self


class ReplyTo(Model):
    """Where a request's results go: a topic and, optionally, one partition of it."""

    topic: str = Field(pattern=TOPIC_NAME)
    partition: int | None = Field(default=None, ge=0)


# One instance for every record validated without configured limits: building a model per
# validator call was a measurable share of parsing a tier record.
DEFAULT_LIMITS = RequestLimits()


def _limits(info: ValidationInfo) -> RequestLimits:
    ctx = info.context
    limits = ctx.get("limits") if isinstance(ctx, dict) else None
    return limits if isinstance(limits, RequestLimits) else DEFAULT_LIMITS


# vLLM's sampling fields beyond temperature, top_p and stop, by vLLM's names: an engine
# honours some of them (its `sampling_fields`), advertises those in its heartbeat, and is
# never given a request that sets one it does not honour (README, "Sampling fields").
SamplingField = Literal[
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "seed",
]
SAMPLING_FIELDS: frozenset[str] = frozenset(get_args(SamplingField))
# What an engine returns beyond text when asked (not sampling: it changes no token), honoured
# and advertised as the sampling fields are: `logprobs`, the log-probabilities of each
# generated token and its most likely alternatives.
OutputField = Literal["logprobs"]
OUTPUT_FIELDS: frozenset[str] = frozenset(get_args(OutputField))
# At most this many alternatives per token: vLLM's default `max_logprobs`, OpenAI's cap for
# chat's `top_logprobs`.
MAX_TOP_LOGPROBS = 20
# What a heartbeat without `capabilities` means (a worker from before they were advertised):
# the one field of these that every engine took then.
BASE_SAMPLING: frozenset[str] = frozenset({"seed"})
# Each field's neutral value: set to it (or unset), a field asks nothing of the engine, as
# clients that send `presence_penalty: 0` by default expect.
_NEUTRAL: dict[str, tuple[object, ...]] = {
    "top_k": (None, 0, -1),
    "min_p": (None, 0.0),
    "repetition_penalty": (None, 1.0),
    "presence_penalty": (None, 0.0),
    "frequency_penalty": (None, 0.0),
    "logit_bias": (None, {}),
    "min_tokens": (None, 0),
    "ignore_eos": (None, False),
    "stop_token_ids": (None, [], ()),
    "seed": (None,),
    "logprobs": (None,),  # 0 asks too: the chosen token's own logprob
}


def sampling_needs(values: Callable[[str], object]) -> frozenset[str]:
    """The sampling (and output) fields a request sets to other than their neutral value:
    what its engine must honour. `values` reads a field by name (a request's, an engine
    request's)."""
    return frozenset(name for name, neutral in _NEUTRAL.items() if values(name) not in neutral)


def _choice_name(choice: ToolChoice) -> str:
    return f"function {choice.function.name!r}" if isinstance(choice, NamedToolChoice) else choice


def not_honoured_message(field: str, engines: Iterable[str], model: str | None) -> str:
    """Why a request is refused for a sampling field: the one wording of edge and worker."""
    names = ", ".join(sorted(set(engines))) or "unknown"
    where = f"model {model!r}" if model is not None else "this deployment"
    return (
        f"{field}: not supported by the engine serving {where} ({names}); leave it unset"
        " or send it to a model served by an engine that supports it (vllm)"
    )


TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]


class BatchRef(Model):
    """The OpenAI batch line a request answers (ADR 0075): set by the edge running the
    batch, never by a client; it names the request's trace and metrics."""

    batch_id: str = Field(pattern=r"^batch_[0-9a-f]{1,64}$")
    custom_id: str = Field(min_length=1, max_length=512)


class ChatRequest(Model):
    """What a client asks for; the body of a `chat.request` frame.

    Sampling fields left unset stay unset (None) on the wire: the engine applies the
    model's own defaults (vLLM: its `generation_config.json`), as vLLM's server does; so
    does `max_tokens`: unset, the answer runs to the end of the context or a stop.
    """

    # The output estimate of a request without max_tokens (`effective_max_tokens`): from
    # the limits it was validated under; never on the wire.
    _output_estimate: int = PrivateAttr(default=DEFAULT_LIMITS.default_max_tokens)

    client_id: str | None = Field(default=None, max_length=128)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    prompt: str | None = None
    max_tokens: int | None = Field(
        default=None,
        description="Most tokens to generate; unset: the rest of the model's context (its"
        " max_model_len minus the prompt), as vLLM has it. Above the context: refused.",
    )
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    stop: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(
        default_factory=list, max_length=4
    )
    seed: int | None = Field(
        default=None,
        ge=-(2**63),
        le=2**63 - 1,
        description="Sampling seed: the same seed and request give the same answer.",
    )
    top_k: int | None = Field(
        default=None, ge=-1, le=2**31 - 1, description="0 or -1: off (all tokens)."
    )
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(
        default=None, gt=0.0, le=100.0, allow_inf_nan=False, description="1: off."
    )
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[TokenId, Bias] | None = Field(
        default=None, max_length=1024, description="Token id -> bias added to its logit."
    )
    min_tokens: int | None = Field(
        default=None, ge=0, le=2**31 - 1, description="No end (EOS, stop) before this many."
    )
    ignore_eos: bool | None = Field(
        default=None, description="true: generate on past the end-of-sequence token."
    )
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=64)
    logprobs: int | None = Field(
        default=None,
        exclude_if=_unset,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="Return each generated token's logprob and this many most likely"
        " alternatives (0: the token's own only); unset: no logprobs.",
    )
    delta_tokens: bool | None = Field(
        default=None,
        exclude_if=_unset,
        description="true: each delta of the answer says how many tokens it covers, the first"
        " also the prompt's (`tokens`, `prompt_tokens`; the OpenAI API's"
        " `continuous_usage_stats` asks it); unset: they are left out.",
    )
    tools: list[Tool] | None = Field(
        default=None,
        max_length=128,
        exclude_if=_unset,
        description="Functions the model may call (OpenAI's `tools`); engines with a chat"
        " template render them into the prompt as the template does.",
    )
    tool_choice: ToolChoice | None = Field(
        default=None,
        exclude_if=_unset,
        description="none, auto (the default with tools), required, or a named function;"
        " required and a named function are guided by the tools' JSON schemas.",
    )
    parallel_tool_calls: bool | None = Field(
        default=None,
        exclude_if=_unset,
        description="false: the answer calls one tool at most; unset: it may call several.",
    )
    response_format: ResponseFormat | None = Field(
        default=None,
        exclude_if=_unset,
        description="text (the default), json_object or json_schema: the answer is guided to"
        " be JSON (valid against the schema).",
    )
    priority: Tier | None = None
    model: str | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        description="The model to run on; unset: the deployment's default model"
        " (TOKENBUS_SCHEDULER_DEFAULT_MODEL), or any worker when that is unset.",
    )
    fallback_model: str | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        description="A model this request may run on instead when its deadline cannot be met"
        " on `model`'s backlog; unset: the tier's configured fallback, if any.",
    )
    cache: bool = Field(
        default=True,
        description="false: never answer this request from the response cache, nor store its"
        " answer there (only deterministic requests are cached: temperature 0 or a seed).",
    )
    conversation_id: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        description="Names a conversation whose turns share a prompt prefix: the scheduler"
        " sends them to the worker that last served it (prefix-affinity routing).",
    )
    variant: str | None = Field(
        default=None,
        pattern=VARIANT_NAME,
        exclude_if=_unset,
        description="Pins the variant of `model` that runs it ('baseline': the workers without"
        " a variant) instead of the rollout's choice; held while no worker of it is live, never"
        " run elsewhere, never cached. Over the edge only keys with the pin_variant scope may.",
    )
    batch_line: BatchRef | None = Field(
        default=None,
        exclude_if=_unset,
        description="The batch and custom_id this request answers (set by the edge that runs"
        " the batch); unset: no batch's.",
    )
    # Bounded so every service can turn it into a float deadline (~24.8 days at most).
    deadline_ms: int | None = Field(
        default=None, ge=1, le=2**31 - 1, description="Budget from acceptance."
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens_in_range(cls, value: int | None, info: ValidationInfo) -> int | None:
        # Unset stays unset: the engine generates to the end of the context or a stop.
        if value is None:
            return None
        cap = _limits(info).max_tokens_cap
        if value < 1:
            raise ValueError("must be at least 1")
        if value > MAX_TOKENS_LIMIT:
            raise ValueError(f"must be at most {MAX_TOKENS_LIMIT}")
        if cap is not None and value > cap:
            raise ValueError(f"must be at most {cap} (the configured cap)")
        return value

    @model_validator(mode="after")
    def _output_estimate_from_limits(self, info: ValidationInfo) -> ChatRequest:
        self._output_estimate = _limits(info).default_max_tokens
        return self

    @model_validator(mode="after")
    def _one_prompt(self, info: ValidationInfo) -> ChatRequest:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("exactly one of messages or prompt is required")
        size = len(self.prompt_text()) + len(self.template_extras())
        limit = _limits(info).max_prompt_chars
        if size > limit:
            field = "prompt" if self.prompt is not None else "messages"
            raise ValueError(f"{field} is {size} characters, above the limit of {limit}")
        return self

    # Field validators, so a refusal names its field (OpenAI's `param`); each reads the
    # fields declared before it (`info.data`: messages, then tools, then tool_choice).
    @field_validator("tools")
    @classmethod
    def _tools_in_a_chat(cls, tools: list[Tool] | None, info: ValidationInfo) -> list[Tool] | None:
        if tools and info.data.get("messages") is None:
            raise ValueError("only a chat (messages) can call tools, not a prompt")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_among_tools(
        cls, choice: ToolChoice | None, info: ValidationInfo
    ) -> ToolChoice | None:
        if choice is None or choice == "none":
            return choice
        tools: list[Tool] | None = info.data.get("tools")
        if not tools:
            raise ValueError(f"{_choice_name(choice)} needs `tools`")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {
            t.function.name for t in tools
        }:
            raise ValueError(f"function {choice.function.name!r} is not in `tools`")
        return choice

    @field_validator("response_format")
    @classmethod
    def _format_or_guided_call(
        cls, fmt: ResponseFormat | None, info: ValidationInfo
    ) -> ResponseFormat | None:
        choice = info.data.get("tool_choice")
        if fmt is None or fmt.type == "text" or not info.data.get("tools"):
            return fmt
        if choice == "required" or isinstance(choice, NamedToolChoice):
            raise ValueError(
                f"cannot be combined with tool_choice {_choice_name(choice)}, whose answer is"
                " guided by the tool's schema"
            )
        return fmt

    @model_validator(mode="after")
    def _min_tokens_in_range(self) -> ChatRequest:
        # With max_tokens unset, the engine checks it against the rest of the context.
        if (
            self.min_tokens is not None
            and self.max_tokens is not None
            and self.min_tokens > self.max_tokens
        ):
            raise ValueError(
                f"min_tokens: {self.min_tokens} is above max_tokens ({self.max_tokens})"
            )
        return self

    def sampling_needs(self) -> frozenset[str]:
        """The sampling fields this request sets (to other than neutral): what the engine
        that runs it must honour."""
        return sampling_needs(lambda name: getattr(self, name)) | structured_needs(
            lambda name: getattr(self, name)
        )

    @property
    def guided(self) -> bool:
        """A grammar guides the answer (the engine compiles one for it): a `response_format`
        other than text, or a tool call that is required or named (`auto` is parsed, not
        guided)."""
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            return True
        return bool(self.tools) and self.tool_choice_in_effect not in ("auto", "none")

    @property
    def tool_choice_in_effect(self) -> ToolChoice:
        """The tool choice as the engine applies it: unset means auto with tools, else none."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def template_extras(self) -> str:
        """What a chat template may render beyond `prompt_text`: the tools' definitions and
        the assistants' tool calls, as JSON (counted in the prompt's bounds)."""
        parts = [json.dumps(t.model_dump(mode="json")) for t in self.tools or ()]
        # Not rendered, but compiled into the engine's grammar: charged as prompt (N2).
        if self.response_format is not None and self.response_format.json_schema is not None:
            parts.append(json.dumps(self.response_format.json_schema.json_schema))
        for m in self.messages or ():
            parts += [c.model_dump_json() for c in m.tool_calls or ()]
            parts += [m.tool_call_id] if m.tool_call_id else []
        return "\n".join(parts)

    def prompt_text(self) -> str:
        """The prompt as one string: the engine's input for the `sim` engine."""
        if self.prompt is not None:
            return self.prompt
        return "\n".join(f"{m.role}: {m.content}" for m in self.messages or [])

    def prompt_token_bound(self) -> int:
        """At most how many tokens the prompt makes for the model (shared/tokens.py): what
        quotas, batch budgets and fair share charge before the request runs."""
        text = self.prompt_text()
        if extras := self.template_extras():
            text = f"{text}\n{extras}"
        return prompt_token_bound(text, len(self.messages or ()))

    @property
    def effective_max_tokens(self) -> int:
        """`max_tokens`, or where it is unset the output estimate that batch budgets, fair
        share and quota charges use (`RequestLimits.default_max_tokens` of the limits it was
        validated under, TOKENBUS_DEFAULT_MAX_TOKENS): the answer itself may be longer, up
        to the end of the context (ADR 0051)."""
        return self.max_tokens if self.max_tokens is not None else self._output_estimate

    def carry_estimate(self, source: ChatRequest) -> None:
        """Take `source`'s output estimate: for a record built from it without validating
        under its limits (`model_construct`, `from_record`)."""
        self._output_estimate = source._output_estimate

    @property
    def deterministic(self) -> bool:
        """Whether the answer is fixed by the request's fields: greedy, or a seeded sample
        (what the response cache may answer, ADR 0036)."""
        return self.temperature == 0 or self.seed is not None

    @property
    def cacheable(self) -> bool:
        """Whether the response cache may answer it and store its answer (it did not opt out,
        and asks for no logprobs, which the cache does not keep, nor tools or a response
        format, which its key does not hold)."""
        return (
            self.cache
            and self.variant is None  # pinned: an eval or a gold run wants its own answer
            and self.deterministic
            and self.logprobs is None
            and not self.tools
            and self.response_format is None
        )


class RequestRecord(ChatRequest):
    """A request on `tokenbus.requests`, as the edge or an external producer writes it."""

    request_id: str = Field(pattern=REQUEST_ID)
    tenant: str = Field(default="default", min_length=1, max_length=128)
    reply_to: ReplyTo | None = None
    created_at: float = Field(
        default_factory=time.time, allow_inf_nan=False, description="Unix time, seconds."
    )
    plan: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9._-]{1,64}$",
        exclude_if=_unset,
        description="The plan of the API key that sent it (`tokenbus keys create --plan`),"
        " stamped by the edge; a route's rules may start it on another model by it"
        " (TOKENBUS_ROUTES). A record on an application's own topic may not set it.",
    )


def over_budget(prompt_tokens: int, max_tokens: int, budget: int | None) -> str | None:
    """Why no batch could ever hold a request (its prompt plus max_tokens is above `budget`,
    the largest tier token budget), or None. Refused where it enters rather than left to wait
    forever: the one rule for ingest and the edge (ADR 0041)."""
    cost = prompt_tokens + max_tokens
    if budget is None or cost <= budget:
        return None
    return (
        f"prompt (up to {prompt_tokens} tokens) plus max_tokens ({max_tokens}) is {cost} tokens,"
        f" above the largest batch token budget of {budget}"
    )


class Judged(Model):
    """The answer a shadow validation's gold run is scored against: the original request's,
    as its variant gave it (shared/shadows.py)."""

    request_id: str = Field(pattern=REQUEST_ID, description="The original request's id.")
    model: str = Field(min_length=1, max_length=200)
    variant: str | None = Field(
        default=None,
        pattern=VARIANT_NAME,
        description="The variant that answered; None: the baseline.",
    )
    text: str = Field(description="The answer's text, as its stream carried it.")


class QueuedRequest(RequestRecord):
    """A validated request on a tier topic, with what the scheduler needs to place it."""

    tier: Tier
    prompt_tokens: int = Field(ge=0)
    reply_to: ReplyTo
    attempt: int = Field(default=0, ge=0)
    accepted_at: float = Field(default_factory=time.time)
    trace: dict[str, str] = Field(
        default_factory=dict,
        description="W3C trace context (traceparent, tracestate) of the request's latest span;"
        " set by the scheduler in a batch, so a worker continues each request's own trace.",
    )
    cascade_step: int | None = Field(
        default=None,
        ge=0,
        exclude_if=_unset,
        description="A request for a route (TOKENBUS_ROUTES): the position in its cascade of the"
        " model that runs this attempt; set by the scheduler that first queues it (the route's"
        " rules), raised by a worker whose answer failed the route's verifier.",
    )
    cache_key: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="Set by ingest on a cacheable request that missed the response cache: the"
        " worker stores a complete answer under this key on the cache topic.",
    )
    shadow_gold: str | None = Field(
        default=None,
        pattern=VARIANT_NAME,
        exclude_if=_unset,
        description="Set by the scheduler on a request sampled for shadow validation (its"
        " model's rollout `shadow`): the gold variant ('baseline': the workers without one)."
        " The worker that answers it then queues a copy pinned to the gold, with `judged`.",
    )
    judged: Judged | None = Field(
        default=None,
        exclude_if=_unset,
        description="On a shadow validation's gold run (written by the worker that answered"
        " the original): the answer it is scored against once it is done (ShadowScore).",
    )
    continues: str | None = Field(
        default=None,
        exclude_if=_unset,
        description="The answer's text its earlier attempts wrote to `reply_to` before they"
        " were lost (a worker killed, fenced or drained, its engine dead): this attempt"
        " continues it, with `max_tokens` counted from the start of the answer, rather than"
        " start over. Its worker writes this text again as the attempt's first delta, so a"
        " reader that starts the answer over at each new attempt still has it whole; the"
        " edge shows only what extends what its client was shown (ADR 0071).",
    )
    requeued: int = Field(
        default=0,
        ge=0,
        exclude_if=lambda v: v == 0,  # readers from before it still read the record
        description="How many times a scheduler moved this request, held long at its tier"
        " partition's commit position, to the partition's tail (services/scheduler/"
        "requeue.py): a record with a higher count is the request moved on, not a second copy.",
    )

    @property
    def deadline_at(self) -> float | None:
        if self.deadline_ms is None:
            return None
        return self.created_at + self.deadline_ms / 1000.0

    @property
    def token_cost(self) -> int:
        """Tokens this request may occupy: its prompt plus everything it may generate."""
        return self.prompt_tokens + self.effective_max_tokens

    def next_attempt(self, sent: str | None = None) -> QueuedRequest:
        """The request as it is run again elsewhere: same id, the next attempt number.

        The one place the retry rule lives: a hand-back, a recovery and a replay all count
        attempts with it, and a reset announces the attempt it returns. `sent`: the text
        this attempt wrote to `reply_to` (its first delta on, `continues` included), which
        the next attempt continues; None or empty: it continues what this one was given.
        """
        update: dict[str, object] = {"attempt": self.attempt + 1}
        if sent:
            update["continues"] = sent
        return self.model_copy(update=update)

    @classmethod
    def from_record(
        cls,
        record: RequestRecord,
        *,
        tier: Tier,
        reply_to: ReplyTo | None = None,
        prompt_tokens: int | None = None,
    ) -> QueuedRequest:
        """The tier record of a validated request: the one way to build it, for what ingest
        forwards and what the edge writes straight to a tier topic (ADR 0041).

        Built without validating again: `record` was validated under its limits, and what
        is added here is tokenbus's own. `reply_to`: where the results go (None: the
        record's own, which it must then have); `prompt_tokens`: the bound already
        computed (None: `record.prompt_token_bound()`).
        """
        reply_to = reply_to or record.reply_to
        if reply_to is None:
            raise ValueError(f"request {record.request_id}: a tier record needs a reply_to")
        if prompt_tokens is None:
            prompt_tokens = record.prompt_token_bound()
        if prompt_tokens < 0:
            raise ValueError(f"request {record.request_id}: prompt_tokens {prompt_tokens} < 0")
        fields = {name: getattr(record, name) for name in RequestRecord.model_fields}
        fields.update(tier=tier, reply_to=reply_to, prompt_tokens=prompt_tokens)
        queued = cls.model_construct(**fields, accepted_at=time.time())
        queued.carry_estimate(record)
        return queued


class Batch(Model):
    """Requests that ride together; what the scheduler sends to workers."""

    batch_id: str
    tier: Tier
    requests: list[QueuedRequest] = Field(min_length=1)
    reason: Literal["full", "tokens", "timeout", "deadline", "adaptive", "drain"]
    formed_at: float = Field(default_factory=time.time)
    worker_id: str | None = None


class Usage(Model):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)


class Timings(Model):
    queue_ms: float
    batch_size: int
    ttft_ms: float
    total_ms: float


class ResultBase(Model):
    """Framing every result record carries: who, which attempt, where in the stream."""

    request_id: str = Field(pattern=REQUEST_ID)
    attempt: int = Field(default=0, ge=0)
    seq: int = Field(ge=0)


class TopLogprob(Model):
    """One token and its log-probability at a position (an alternative the model weighed)."""

    token: str = Field(max_length=1024, description="The token's text, as the engine decodes it.")
    logprob: float = Field(allow_inf_nan=False, description="Clamped at -9999.0, as vLLM does.")


class TokenLogprob(TopLogprob):
    """A generated token's logprob and the most likely alternatives at its position, most
    likely first (as many as the request's `logprobs` asked)."""

    top: list[TopLogprob] = Field(default_factory=list, max_length=MAX_TOP_LOGPROBS)


class DeltaResult(ResultBase):
    kind: Literal["delta"] = "delta"
    text: str
    logprobs: list[TokenLogprob] | None = Field(
        default=None,
        exclude_if=_unset,
        description="One per generated token of `text`, in order, when the request asked for"
        " logprobs; absent otherwise (left out of the record, not null).",
    )
    tokens: int | None = Field(
        default=None,
        ge=0,
        exclude_if=_unset,
        description="Where the request asked (`delta_tokens`): how many generated tokens"
        " `text` covers (0 for a continuation's text so far, counted by the attempt that"
        " generated it); absent otherwise.",
    )
    prompt_tokens: int | None = Field(
        default=None,
        ge=0,
        exclude_if=_unset,
        description="Where the request asked (`delta_tokens`), on the first delta of the"
        " engine's output: the prompt's tokens as the engine counts them (a continuation's:"
        " with the text so far); absent otherwise.",
    )


_LOGPROBS = TypeAdapter(Sequence[TokenLogprob])


class DeltaFrames:
    """One stream's `DeltaResult` records as bytes: what `encode(DeltaResult(...))` writes.

    A worker's hot path: the stream's framing (id, attempt) is checked once, by
    `DeltaResult` itself, and each chunk then costs one string escape (C, `json`) instead
    of a model built and dumped. The bytes are pydantic's own, to the byte
    (tests/test_delta_frames.py).
    """

    def __init__(self, request_id: str, attempt: int) -> None:
        framing = DeltaResult(request_id=request_id, attempt=attempt, seq=0, text="")
        self._head = (
            f'{{"request_id":{_json_string(framing.request_id)},"attempt":{framing.attempt},"seq":'
        )

    def encode(
        self,
        seq: int,
        text: str,
        logprobs: Sequence[TokenLogprob] | None = None,
        tokens: int | None = None,
        prompt_tokens: int | None = None,
    ) -> bytes:
        if seq < 0:
            raise ValueError(f"seq must be >= 0, not {seq}")
        if (tokens is not None and tokens < 0) or (prompt_tokens is not None and prompt_tokens < 0):
            raise ValueError(f"token counts must be >= 0, not {tokens}, {prompt_tokens}")
        tail = "" if logprobs is None else f',"logprobs":{_LOGPROBS.dump_json(logprobs).decode()}'
        if tokens is not None:
            tail += f',"tokens":{int(tokens)}'
        if prompt_tokens is not None:
            tail += f',"prompt_tokens":{int(prompt_tokens)}'
        return f'{self._head}{seq},"kind":"delta","text":{_json_string(text)}{tail}}}'.encode()


# A str as JSON the way pydantic writes it: UTF-8 as is, only quotes, backslashes and
# control characters escaped.
_json_string = json.JSONEncoder(ensure_ascii=False).encode


class DoneResult(ResultBase):
    kind: Literal["done"] = "done"
    # "repetition": vLLM's repetition detector ended the answer.
    finish_reason: Literal["stop", "length", "repetition", "cancelled"]
    usage: Usage
    timings: Timings
    model: str | None = Field(default=None, description="The model that answered.")
    cached: bool = Field(
        default=False, description="Answered from the response cache, not by a worker."
    )
    tool_calls: list[ToolCall] | None = Field(
        default=None,
        exclude_if=_unset,
        description="The tools the answer calls, parsed from its text (the deltas carry the"
        " text as generated); absent when it calls none.",
    )
    content: str | None = Field(
        default=None,
        exclude_if=_unset,
        description="With `tool_calls`: the answer's text besides the calls (absent: none).",
    )
    variant: str | None = Field(
        default=None,
        exclude_if=_unset,
        description="The variant of `model` that answered (its worker's TOKENBUS_WORKER_VARIANT);"
        " absent: the model's baseline.",
    )


class CacheEntry(Model):
    """On `tokenbus.cache` (compacted, keyed by `key`): a complete deterministic answer.

    Written by the worker that answered it; read by every ingest replica, which replays it
    as the result stream of a later request with the same key.
    """

    key: str = Field(pattern=r"^[0-9a-f]{64}$")
    chunks: list[str] = Field(description="The answer's deltas, as the worker sent them.")
    finish_reason: Literal["stop", "length"]
    usage: Usage
    model: str = Field(description="The model that answered.")
    request_id: str = Field(pattern=REQUEST_ID, description="The request it answered first.")
    stored_at: float = Field(default_factory=time.time, description="Unix time, seconds.")


class RequestAttempt(Protocol):
    """One attempt of a request: what an answer to it is addressed by."""

    @property
    def request_id(self) -> str: ...

    @property
    def attempt(self) -> int: ...


class ErrorResult(ResultBase):
    kind: Literal["error"] = "error"
    code: ErrorCode
    message: str
    retry_after_ms: int | None = Field(
        default=None,
        ge=0,
        description="With `rate_limited` or `overloaded`: when the same request may be sent"
        " again (ms).",
    )
    usage: Usage | None = Field(
        default=None,
        exclude_if=_unset,
        description="What the run used before it ended, where the engine said (a cancelled"
        " run's tokens): the edge settles the tenant's tokens-per-minute charge with it, as"
        " with a `done`'s.",
    )

    @classmethod
    def for_request(
        cls,
        request: RequestAttempt | str,
        code: ErrorCode,
        message: str,
        *,
        seq: int = 0,
        retry_after_ms: int | None = None,
        usage: Usage | None = None,
    ) -> ErrorResult:
        """The error that answers one attempt of a request; a bare id is its first attempt.

        `seq` is 0 unless the error ends a stream that already carried records.
        """
        if isinstance(request, str):
            return cls(
                request_id=request,
                seq=seq,
                code=code,
                message=message,
                retry_after_ms=retry_after_ms,
                usage=usage,
            )
        return cls(
            request_id=request.request_id,
            attempt=request.attempt,
            seq=seq,
            code=code,
            message=message,
            retry_after_ms=retry_after_ms,
            usage=usage,
        )


class ResetResult(ResultBase):
    """Attempt `attempt` supersedes every earlier one: a reader drops their later records.

    Written by the scheduler to a request's `reply_to` before it re-runs the request of a
    worker declared dead, so a worker that was only paused (a zombie) and writes on cannot
    show its stale attempt to anyone. Carries no text; `seq` is always 0 and counts nothing.
    A reset after the request's first final (`done` or `error`) is dropped with everything
    else after it: the first final is the answer (ADR 0055).
    """

    kind: Literal["reset"] = "reset"
    seq: int = Field(default=0, ge=0)
    reason: str = ""
    usage: Usage | None = Field(
        default=None,
        exclude_if=_unset,
        description="What the attempt it supersedes used, where a cascade declined that"
        " attempt's answer (its verifier failed, or its engine did): the tenant's tokens are"
        " spent all the same, and the edge settles the charge with them beside the final's"
        " (issue 37, N5). Unset where the attempt was lost to a fault (a worker declared"
        " dead): the tenant is not charged for it.",
    )

    @classmethod
    def before_retry(
        cls, request: QueuedRequest, reason: str, usage: Usage | None = None
    ) -> ResetResult:
        """The reset that announces the request's next attempt (`QueuedRequest.next_attempt`)."""
        return cls(
            request_id=request.request_id,
            attempt=request.next_attempt().attempt,
            reason=reason,
            usage=usage,
        )


ResultRecord = Annotated[
    DeltaResult | DoneResult | ErrorResult | ResetResult, Field(discriminator="kind")
]


def unknown_model_message(model: str, known: Iterable[str]) -> str:
    """Why a named model is refused: the one wording at the edge and in the scheduler."""
    available = ", ".join(sorted(set(known))) or "none"
    return f"model {model!r} is not served here; available models: {available}"


def error_message(exc: Exception, skip_loc: int = 0) -> str:
    """One line naming each bad field, from a pydantic ValidationError or any exception.

    `skip_loc` drops leading location parts, such as the union tag of a tagged frame.
    """
    from pydantic import ValidationError

    if not isinstance(exc, ValidationError):
        return str(exc)
    parts = []
    for err in exc.errors(include_url=False):
        if err["type"] in ("union_tag_invalid", "union_tag_not_found"):
            loc = "type"
        else:
            loc = ".".join(str(p) for p in err["loc"][skip_loc:]) or "request"
        msg = str(err["msg"]).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)


class CancelRecord(Model):
    """On `tokenbus.control`: stop generating for this request and free its slot."""

    kind: Literal["cancel"] = "cancel"
    request_id: str = Field(pattern=REQUEST_ID)
    reason: Literal["client", "disconnect", "deadline"] = "client"
    sent_at: float = Field(default_factory=time.time)


class Capabilities(Model):
    """What a worker's engine can do, as its heartbeat advertises it."""

    engine: str = Field(min_length=1, max_length=64)
    # Names, not `SamplingField`s: a newer worker's field must not make its beat unreadable.
    sampling: frozenset[Annotated[str, Field(max_length=64)]] = Field(max_length=64)


# The TTFT buckets of a worker's outcome counts (`Outcomes.ttft`): upper bounds in seconds,
# log-spaced by 1.25 from 5 ms to about 38 s (each bucket ~12 % wide around its middle), and
# a last bucket for anything longer. Fixed: workers and schedulers must bucket alike, so a
# change is a change of the heartbeat's schema.
OUTCOME_TTFT_BOUNDS_S: tuple[float, ...] = tuple(round(0.005 * 1.25**i, 6) for i in range(41))


class Outcomes(Model):
    """In a heartbeat: what the worker's requests came to since its process started.

    Cumulative, so a lost, late or repeated beat loses or adds nothing: a scheduler takes
    the difference from the same incarnation's largest counts so far (ADR 0058).
    """

    answered: int = Field(default=0, ge=0, description="Requests answered (`done`).")
    failed: int = Field(
        default=0,
        ge=0,
        description="Requests that ended in an error the worker answers for (`internal`: the"
        " engine failed them); a cancel or a refused request is neither.",
    )
    ttft: list[int] = Field(
        default_factory=lambda: [0] * (len(OUTCOME_TTFT_BOUNDS_S) + 1),
        description="Answered requests by time to first token (created_at -> first token),"
        " one count per bucket of `OUTCOME_TTFT_BOUNDS_S` and a last one for longer.",
    )

    @field_validator("ttft")
    @classmethod
    def _one_count_per_bucket(cls, ttft: list[int]) -> list[int]:
        if len(ttft) != len(OUTCOME_TTFT_BOUNDS_S) + 1 or min(ttft) < 0:
            raise ValueError(f"{len(OUTCOME_TTFT_BOUNDS_S) + 1} counts, none negative")
        return ttft


# On a drained worker's last heartbeat ("1"): it has handed back what it held and exits;
# schedulers take it as gone at once, not as dead after its silence. A header, not a field:
# the releases before ADR 0072 refuse a heartbeat with a field they do not know.
LEAVING_HEADER = "tokenbus-leaving"


class Heartbeat(Model):
    """On `tokenbus.workers`: what a worker can take now."""

    worker_id: str
    model: str
    total_slots: int = Field(ge=0)
    free_slots: int = Field(ge=0)
    running: int = Field(ge=0)
    queued_tokens: int = Field(ge=0)
    utilisation: float = Field(ge=0.0, le=1.0)
    sent_at: float = Field(default_factory=time.time)
    batch_partition: int | None = Field(
        default=None, ge=0, description="The partition of the batches topic this worker reads."
    )
    batches_consumed: int = Field(
        default=0,
        ge=0,
        description="Next offset the worker reads on its batch partition: every batch below"
        " it is in the worker's hands (the scheduler's acknowledgement).",
    )
    held: list[tuple[str, int]] = Field(
        default_factory=list,
        description="(request_id, attempt) of every request taken in and not yet answered or"
        " handed back: what a scheduler hands back if this worker dies.",
    )
    interval_ms: float = Field(
        default=1000.0, gt=0, description="Longest gap between two heartbeats of this worker."
    )
    started_at: float = Field(
        default=0.0,
        description="When this worker process started: the same worker_id with another"
        " started_at is a new incarnation.",
    )
    batch_mode: Literal["continuous", "static"] = Field(
        default="continuous",
        description="static: each batch runs as one engine call, one batch at a time, so a"
        " batch sent to it takes all its slots until a heartbeat says otherwise.",
    )
    prefix_cache_hit_rate: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="Share of recent prompt tokens the engine found in its prefix cache"
        " (None: the engine does not say).",
    )
    queued: int = Field(
        default=0,
        ge=0,
        description="Requests handed to the engine that wait there for a slot (vLLM: its"
        " scheduler's waiting count).",
    )
    kv_cache_usage: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="Share of the engine's KV cache in use (None: the engine does not say).",
    )
    max_model_len: int | None = Field(
        default=None,
        ge=1,
        description="Tokens of context the model takes, prompt and answer (None: unknown).",
    )
    capabilities: Capabilities | None = Field(
        default=None,
        description="The worker's engine and the sampling fields it honours (None: a worker"
        " from before they were advertised: `BASE_SAMPLING`, engine unknown).",
    )
    variant: str | None = Field(
        default=None,
        exclude_if=_unset,
        pattern=VARIANT_NAME,
        description="The variant of its model this worker runs (TOKENBUS_WORKER_VARIANT);"
        " absent: the model's baseline.",
    )
    load_s: float | None = Field(
        default=None,
        ge=0.0,
        description="Seconds from this worker's process start to ready (its model loaded, its"
        " batch partition read): what a cold start of its model costs (None: not measured).",
    )
    outcomes: Outcomes | None = Field(
        default=None,
        exclude_if=_unset,
        description="What its requests came to since it started (None: a worker from before"
        " outcomes were counted); schedulers judge canaries by them (ADR 0058).",
    )


class StreamResumed(Model):
    """On `tokenbus.control`: an edge now serves this request's stream to a resumed client.

    The edge that had the stream before stops its disconnect grace timer, so it does not
    cancel a request that a client has picked up elsewhere. Workers ignore it.
    """

    kind: Literal["resumed"] = "resumed"
    request_id: str = Field(pattern=REQUEST_ID)
    edge_id: str = Field(min_length=1, max_length=200)
    sent_at: float = Field(default_factory=time.time)


ControlRecord = Annotated[CancelRecord | StreamResumed, Field(discriminator="kind")]
