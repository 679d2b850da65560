"""OpenAI-compatible request and response bodies: what `/v1/*completions` reads and writes.

Field names, defaults and extension fields follow vLLM's OpenAI server
(`vllm/entrypoints/openai/protocol.py`), so its users' clients work unchanged. Unknown
fields are accepted and ignored, as vLLM and OpenAI do; fields tokenbus cannot honour are
refused in `translate.py`, never silently dropped.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.messages import Tier


class OpenAIModel(BaseModel):
    """Requests: unknown fields are kept (and ignored), as OpenAI's own server does.

    An explicit `null` is the field left unset (its default), as vLLM's server reads
    `"n": null`, `"stream": null`, `"echo": null`...: clients serialise unset fields so.
    """

    model_config = ConfigDict(extra="allow", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            k: v
            for k, v in data.items()
            if v is not None or k not in fields or fields[k].is_required()
        }


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ContentPart(OpenAIModel):
    """A content part of another kind (image, audio): tokenbus serves text only."""

    type: str


class Message(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ContentPart] | None = None
    name: str | None = None
    # An assistant's calls, and the call a tool's message answers (`translate.py` checks
    # them into the request's `ChatMessage`s).
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    # vLLM's extension: usage on every chunk, not only the last.
    continuous_usage_stats: bool = False


Stop = str | list[str] | None
# vLLM's `priority` is an int (lower runs first); tokenbus's tiers are also accepted by name.
Priority = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] | Tier


class SamplingFields(OpenAIModel):
    """What both endpoints share: sampling, length, streaming, tokenbus's extensions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: Stop = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's sampling extensions, by its names (ranges checked by `ChatRequest`).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    # Extensions, as vLLM's `priority`: the tier, a deadline from acceptance, the model the
    # request may run on instead when its deadline cannot be met on `model`, and the
    # conversation whose turns share a prompt prefix (prefix-affinity routing); the variant
    # of `model` it is pinned to (keys with the pin_variant scope: `tokenbus eval`).
    priority: Priority | None = None
    deadline_ms: int | None = None
    fallback_model: str | None = None
    conversation_id: str | None = None
    variant: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    # Chat asks for logprobs with a flag, and for `top_logprobs` alternatives per token.
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's extensions for a guided answer: `structured_outputs` ({"json": <schema>} or
    # {"json_object": true}) and the older `guided_json` (a schema), read as a
    # `response_format` (`tool_calls.py`).
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    # Completions ask with the number of alternatives per token (0: the token's own).
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


# -- responses ----------------------------------------------------------------------------------


class Body(BaseModel):
    """Responses: exactly these fields."""

    model_config = ConfigDict(extra="forbid")


class Usage(Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class FunctionCallBody(Body):
    name: str
    arguments: str  # JSON text of an object


class ToolCallBody(Body):
    """A tool the answer calls (the SDK's `ChatCompletionMessageToolCall`)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallBody


class ChunkToolCall(ToolCallBody):
    """A tool call in a stream's `delta.tool_calls` (the SDK's `ChoiceDeltaToolCall`): whole,
    in one chunk, `index` its place among the answer's calls."""

    index: int


class AssistantMessage(Body):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # Absent when the answer calls no tool.
    tool_calls: list[ToolCallBody] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatTopLogprob(Body):
    """An alternative at a token's position (the `openai` SDK's `TopLogprob`)."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    """A generated token (the SDK's `ChatCompletionTokenLogprob`): its logprob and the most
    likely tokens at its position, most likely first."""

    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(Body):
    """A chat choice's `logprobs`: one entry per token of its content (in a chunk: of the
    chunk's content)."""

    content: list[ChatTokenLogprob] | None


class CompletionLogprobs(Body):
    """A completion choice's `logprobs`, in the legacy shape: four lists, one entry per
    token; `top_logprobs` maps each position's token and its alternatives to their logprobs."""

    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class ChatChoice(Body):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str


class ChatCompletion(Body):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    # OpenAI's "backend configuration that the model runs with": the variant of the model
    # that answered (ADR 0054), on the bodies made once it is known; absent: the baseline.
    system_fingerprint: str | None = Field(default=None, exclude_if=lambda v: v is None)


class ChunkDelta(Body):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ChunkToolCall] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatChunkChoice(Body):
    index: int = 0
    delta: ChunkDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Body):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    # OpenAI's "backend configuration that the model runs with": the variant of the model
    # that answered (ADR 0054), on the bodies made once it is known; absent: the baseline.
    system_fingerprint: str | None = Field(default=None, exclude_if=lambda v: v is None)


class CompletionChoice(Body):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(Body):
    """A `text_completion`, whole or one streamed chunk of it (OpenAI uses one object)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    # OpenAI's "backend configuration that the model runs with": the variant of the model
    # that answered (ADR 0054), on the bodies made once it is known; absent: the baseline.
    system_fingerprint: str | None = Field(default=None, exclude_if=lambda v: v is None)


class ModelCard(Body):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tokenbus"
    # As vLLM's server reports it: the context its workers take (null: not known).
    max_model_len: int | None = None


class ModelList(Body):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(Body):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(Body):
    error: ErrorDetail
