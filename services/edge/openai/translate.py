"""OpenAI requests to tokenbus requests, and the edge's stream frames back to OpenAI bodies.

Pure: no I/O and no clock (times are passed in), so each mapping rule is tested with
plain values. The rules:
- `max_completion_tokens` wins over `max_tokens` (as in vLLM); unset, it stays unset: the
  answer runs to the end of the context or a stop (ADR 0051);
- `priority`: a tier by name, or vLLM's integer (<= 0 interactive, > 0 background);
- `model` names the model the request runs on (unset: the deployment's default), and the
  answer names the model that answered (`fallback_model`, an extension, if it ran there);
- vLLM's sampling fields (`top_k`, `min_p`, penalties, `logit_bias`, `min_tokens`,
  `ignore_eos`, `stop_token_ids`, `seed`) pass on by their names; unset, they stay unset
  (the model's defaults apply), as `temperature` and `top_p` do; whether the model's engine
  honours them is the gateway's check (`services/edge/capabilities.py`);
- `logprobs` (chat: `logprobs` and `top_logprobs`) passes on as the request's `logprobs`,
  checked as the sampling fields are, and comes back where OpenAI puts it (`logprobs.py`);
- `tools`, `tool_choice` and `response_format` pass on by their names (`tool_calls.py`),
  checked as the sampling fields are; an answer's tool calls come back in OpenAI's shapes;
- what tokenbus cannot honour (n > 1, images) is a 400 naming the field, never silently
  dropped;
- a new attempt (a worker died) is invisible if the client has seen no text of the old one;
  after text it cannot be taken back over OpenAI's protocol, so the stream ends with an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from pydantic import ValidationError

from services.edge.openai import tool_calls
from services.edge.openai.errors import HttpError, http_error, invalid, restarting
from services.edge.openai.logprobs import asked as asked_logprobs
from services.edge.openai.logprobs import chat_logprobs, completion_logprobs
from services.edge.openai.schema import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatLogprobs,
    ChunkDelta,
    Completion,
    CompletionChoice,
    CompletionRequest,
    ContentPart,
    Message,
    TextPart,
    Usage,
)
from services.edge.openai.sse import DONE, EventId, event
from services.edge.protocol import (
    AcceptedFrame,
    DeltaFrame,
    DoneFrame,
    ErrorFrame,
    ResetFrame,
    ServerFrame,
    StreamResumedFrame,
)
from shared.messages import (
    SAMPLING_FIELDS,
    ChatRequest,
    ErrorCode,
    RequestLimits,
    Tier,
    TokenLogprob,
    error_message,
)

Kind = Literal["chat", "text"]
OpenAIRequest = ChatCompletionRequest | CompletionRequest


def to_chat_request(body: OpenAIRequest, limits: RequestLimits) -> ChatRequest | HttpError:
    """The tokenbus request an OpenAI body asks for, or the 400 that says why not."""
    if refused := _unsupported(body):
        return refused
    logprobs = asked_logprobs(body)
    if isinstance(logprobs, HttpError):
        return logprobs
    fields: dict[str, object] = {
        "max_tokens": _max_tokens(body),
        "stop": body.stop if body.stop is not None else [],
        "priority": _tier(body.priority),
        "deadline_ms": body.deadline_ms,
        "model": body.model,
        "fallback_model": body.fallback_model,
        "conversation_id": body.conversation_id,
        "variant": body.variant,
        # Unset stays unset: the engine applies the model's defaults.
        "temperature": body.temperature,
        "top_p": body.top_p,
        **{name: getattr(body, name) for name in SAMPLING_FIELDS},
        "logprobs": logprobs,
        # vLLM's continuous usage: the deltas must say what they cover.
        "delta_tokens": _continuous_usage(body) or None,
    }
    if isinstance(body, ChatCompletionRequest):
        messages = [_message(m) for m in body.messages]
        if bad := next((m for m in messages if isinstance(m, HttpError)), None):
            return bad
        fields["messages"] = messages
        tool_fields = tool_calls.request_fields(body)
        if isinstance(tool_fields, HttpError):
            return tool_fields
        fields.update(tool_fields)
    else:
        prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
        fields["prompt"] = prompt
    try:
        return ChatRequest.model_validate(fields, context={"limits": limits})
    except ValidationError as exc:
        return invalid(error_message(exc), _param(exc))


def _continuous_usage(body: OpenAIRequest) -> bool:
    """vLLM's `stream_options.continuous_usage_stats`, which counts only with `include_usage`
    on a stream, as in vLLM."""
    options = body.stream_options
    return (
        body.stream
        and options is not None
        and options.include_usage
        and options.continuous_usage_stats
    )


def _param(exc: ValidationError) -> str | None:
    """The field the first error is about (OpenAI's `param`); None for the whole request."""
    loc = exc.errors(include_url=False)[0]["loc"]
    return str(loc[0]) if loc else None


def _max_tokens(body: OpenAIRequest) -> int | None:
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        return body.max_completion_tokens
    return body.max_tokens


def _tier(priority: int | Tier | None) -> Tier | None:
    if priority is None or isinstance(priority, Tier):
        return priority
    return Tier.interactive if priority <= 0 else Tier.background


def _message(message: Message) -> dict[str, object] | HttpError:
    role = "system" if message.role == "developer" else message.role
    content = message.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        parts = [p for p in content if not isinstance(p, TextPart)]
        if parts:
            kind = parts[0].type if isinstance(parts[0], ContentPart) else "?"
            return invalid(
                f"messages: content parts of type `{kind}` are not supported (text only)",
                "messages",
            )
        text = "".join(p.text for p in content if isinstance(p, TextPart))
    return {"role": role, "content": text, **tool_calls.message_fields(message)}


def _unsupported(body: OpenAIRequest) -> HttpError | None:
    """The first field whose value tokenbus cannot honour, as a 400."""
    if body.n != 1:
        return invalid(
            f"n={body.n}: tokenbus generates one choice per request; only n=1 is supported"
            " (send n requests instead)",
            "n",
        )
    checks: list[tuple[bool, str, str]] = []
    if not isinstance(body, ChatCompletionRequest):
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        token_ids = any(not isinstance(p, str) for p in prompts)
        checks += [
            (token_ids, "prompt", "token ids are not supported; send the prompt as text"),
            (len(prompts) != 1, "prompt", "exactly one prompt per request is supported"),
            (body.echo, "echo", "not supported"),
            ((body.best_of or 1) > 1, "best_of", "only 1 is supported"),
            (bool(body.suffix), "suffix", "not supported"),
        ]
    for failed, param, why in checks:
        if failed:
            return invalid(f"{param}: {why}", param)
    return None


def frame_error(frame: ErrorFrame) -> HttpError:
    """An `error` frame as the HTTP answer it stands for."""
    return http_error(frame.code, frame.message, retry_after_ms=frame.retry_after_ms)


def usage_of(frame: DoneFrame) -> Usage:
    u = frame.usage
    return Usage(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        total_tokens=u.prompt_tokens + u.completion_tokens,
    )


RESET_AFTER_TEXT = (
    "the request was re-run after a worker failure, and the text already sent cannot be taken"
    " back over this API; send the request again (the WebSocket API shows the new attempt)"
)


@dataclass(frozen=True)
class Identity:
    """What every body of one request's answer repeats."""

    kind: Kind
    request_id: str
    model: str
    created: int
    logprobs: bool = False  # asked for: each choice carries `logprobs` (else null)
    # The tool answers it may get (`tool_calls.tool_answer`); None: it calls no tool.
    tools: tool_calls.ToolAnswer | None = None
    variant: str | None = None  # the variant that answered, once known (`answered_by`)

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.kind == 'chat' else 'cmpl'}-{self.request_id}"


def answered_by(ident: Identity, done: DoneFrame) -> Identity:
    """The identity the last bodies carry: the model that answered, if it was another
    (the request ran on its fallback model), and the variant of it that answered."""
    model = ident.model if done.model is None else done.model
    return replace(ident, model=model, variant=done.variant)


@dataclass
class Answer:
    """A non-streaming answer, gathered from frames; `result` is set by the final one."""

    ident: Identity
    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    result: ChatCompletion | Completion | HttpError | None = None

    def take(self, frame: ServerFrame) -> None:
        if isinstance(frame, DeltaFrame):
            self.parts.append(frame.text)
            self.logprobs += frame.logprobs or ()
        elif isinstance(frame, ResetFrame):
            # Nothing was shown: the new attempt simply replaces it.
            self.parts.clear()
            self.logprobs.clear()
        elif isinstance(frame, DoneFrame):
            self.ident = answered_by(self.ident, frame)
            self.result = self._body(
                "".join(self.parts), frame.finish_reason, usage_of(frame), frame
            )
        elif isinstance(frame, ErrorFrame):
            self.result = frame_error(frame)

    def _body(
        self, text: str, finish: str, usage: Usage, done: DoneFrame
    ) -> ChatCompletion | Completion:
        i = self.ident
        if i.kind == "chat":
            calls = done.tool_calls or []
            message = (
                AssistantMessage(content=done.content, tool_calls=tool_calls.message_calls(calls))
                if calls
                else AssistantMessage(content=text)
            )
            choice = ChatChoice(
                message=message,
                logprobs=chat_logprobs(self.logprobs) if i.logprobs else None,
                finish_reason=tool_calls.finish_reason(i.tools, finish, calls),
            )
            return ChatCompletion(
                id=i.id,
                created=i.created,
                model=i.model,
                system_fingerprint=i.variant,
                choices=[choice],
                usage=usage,
            )
        logprobs = completion_logprobs(self.logprobs, 0) if i.logprobs else None
        return Completion(
            id=i.id,
            created=i.created,
            model=i.model,
            system_fingerprint=i.variant,
            choices=[CompletionChoice(text=text, logprobs=logprobs, finish_reason=finish)],
            usage=usage,
        )


@dataclass
class SseStream:
    """A streaming answer: frames in, SSE bytes out; `ended` once the last event is made.

    `after`: where a resumed client stands (its `Last-Event-ID`); None for a new request.
    `event_ids`: each event carries `id: <attempt>:<seq>` (asked for, or a resume).
    `cancel`: set when the request must be cancelled (a new attempt after text was sent).
    `hold`: every delta is held until the answer ends, as a tool answer's are: a route's
    answer may be replaced by a later model of its cascade (a `reset`, ADR 0059), and text
    sent over this API cannot be taken back.
    `continuous_usage`: vLLM's `stream_options.continuous_usage_stats` (with `include_usage`):
    every chunk carries the usage so far, from the token counts the deltas carry (a stream
    resumed on another edge counts from where it resumed).
    """

    ident: Identity
    include_usage: bool
    after: EventId | None = None
    hold: bool = False
    event_ids: bool = True
    continuous_usage: bool = False
    ended: bool = False
    cancel: bool = False
    _prompt_tokens: int = 0  # from the first delta that says
    _completion_tokens: int = 0  # the deltas' so far
    _prompt_told: bool = False
    _attempt: int = 0
    _last_seq: int = -1
    _texted: bool = False  # the client holds text of attempt `_attempt`
    _opened: bool = False  # the role chunk is sent (or, resumed, was sent before)
    _text_sent: int = 0  # characters of text sent: where a chunk's `text_offset`s start
    # A request that may call tools: its deltas, held back until the answer is whole.
    _held: list[DeltaFrame] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.after is not None:
            self._opened = True
            self._attempt, self._last_seq = self.after.attempt, self.after.seq
            self._texted = self.after.seq >= 0

    started: bool = False  # an event was made: from now on an error is an event in the stream

    def take(self, frame: ServerFrame) -> list[bytes]:
        out = self._take(frame)
        self.started = self.started or bool(out)
        return out

    def _take(self, frame: ServerFrame) -> list[bytes]:
        if self.ended or isinstance(frame, AcceptedFrame | StreamResumedFrame):
            return []
        if isinstance(frame, ResetFrame):
            if self._texted:
                self.cancel = True
                return self._error(http_error(ErrorCode.internal, RESET_AFTER_TEXT))
            self._attempt, self._last_seq = frame.attempt, -1
            self._held.clear()
            return []
        if isinstance(frame, ErrorFrame):
            return self._error(frame_error(frame))
        self._note_prompt(frame)  # before the role chunk, which has it, as vLLM's has
        out = self._opening()
        if isinstance(frame, DeltaFrame):
            self._completion_tokens += frame.tokens or 0
        if isinstance(frame, DeltaFrame) and (self.ident.tools is not None or self.hold):
            self._held.append(frame)
            return out
        if isinstance(frame, DeltaFrame):
            self._last_seq = frame.seq
            self._texted = self._texted or bool(frame.text)
            out.append(event(self._chunk(frame.text, None, frame.logprobs), self._id()))
            self._text_sent += len(frame.text)
            return out
        self.ended = True
        self.ident = answered_by(self.ident, frame)
        if self.ident.tools is not None or self.hold:
            return out + self._tool_answer(frame)
        out.append(event(self._chunk(None, frame.finish_reason), self._id()))
        if self.include_usage:
            out.append(event(self._usage_chunk(usage_of(frame)), self._id()))
        out.append(DONE)
        return out

    def _note_prompt(self, frame: ServerFrame) -> None:
        """The prompt's tokens, from the first delta that carries them (the attempt's first)."""
        if self._prompt_told or not isinstance(frame, DeltaFrame):
            return
        if frame.prompt_tokens is not None:
            self._prompt_told, self._prompt_tokens = True, frame.prompt_tokens

    def _usage_so_far(self) -> Usage | None:
        if not (self.continuous_usage and self.include_usage):
            return None
        prompt, completion = self._prompt_tokens, self._completion_tokens
        return Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )

    def restarting(self) -> list[bytes]:
        """The edge drains: an `error` event (`edge_restarting`) that ends this connection's
        stream and names where it stands, its `id:` sent whether ids were asked for or not:
        the client sends the request again to another edge with it as `Last-Event-ID`."""
        where = EventId(self._attempt, self._last_seq)
        return [event(restarting(str(where)).body, where)]

    def _id(self) -> EventId | None:
        return EventId(self._attempt, self._last_seq) if self.event_ids else None

    def _tool_answer(self, done: DoneFrame) -> list[bytes]:
        """The end of a stream whose deltas were held: its content (the text, or the text
        besides the calls) in one chunk, its calls whole in the next, then the finish."""
        held, self._held = self._held, []
        if held:
            self._last_seq = held[-1].seq
        calls = done.tool_calls or []
        text = done.content if calls else "".join(f.text for f in held)
        out: list[bytes] = []
        if text:
            logprobs = None if calls else [t for f in held for t in f.logprobs or ()]
            out.append(event(self._chunk(text, None, logprobs), self._id()))
        if calls:
            delta = ChunkDelta(tool_calls=tool_calls.delta_calls(calls))
            out.append(event(self._chat_chunk(delta, None), self._id()))
        finish = tool_calls.finish_reason(self.ident.tools, done.finish_reason, calls)
        out.append(event(self._chunk(None, finish), self._id()))
        if self.include_usage:
            out.append(event(self._usage_chunk(usage_of(done)), self._id()))
        out.append(DONE)
        return out

    def _opening(self) -> list[bytes]:
        """A chat stream opens with the assistant's role, as OpenAI's and vLLM's do."""
        if self.ident.kind != "chat" or self._opened:
            return []
        self._opened = True
        return [event(self._chat_chunk(ChunkDelta(role="assistant", content=""), None), self._id())]

    def _error(self, error: HttpError) -> list[bytes]:
        self.ended = True
        return [event(error.body, self._id()), DONE]

    def _chunk(
        self, text: str | None, finish: str | None, logprobs: list[TokenLogprob] | None = None
    ) -> ChatCompletionChunk | Completion:
        """A chunk of text (or the finish); with logprobs asked, the text's tokens'."""
        tokens = (logprobs or []) if self.ident.logprobs and text is not None else None
        if self.ident.kind == "chat":
            chat = None if tokens is None else chat_logprobs(tokens)
            return self._chat_chunk(ChunkDelta(content=text), finish, chat)
        i = self.ident
        legacy = None if tokens is None else completion_logprobs(tokens, self._text_sent)
        choice = CompletionChoice(text=text or "", logprobs=legacy, finish_reason=finish)
        return Completion(
            id=i.id,
            created=i.created,
            model=i.model,
            system_fingerprint=i.variant,
            choices=[choice],
            usage=self._usage_so_far(),
        )

    def _chat_chunk(
        self, delta: ChunkDelta, finish: str | None, logprobs: ChatLogprobs | None = None
    ) -> ChatCompletionChunk:
        i = self.ident
        choice = ChatChunkChoice(delta=delta, logprobs=logprobs, finish_reason=finish)
        return ChatCompletionChunk(
            id=i.id,
            created=i.created,
            model=i.model,
            system_fingerprint=i.variant,
            choices=[choice],
            usage=self._usage_so_far(),
        )

    def _usage_chunk(self, usage: Usage) -> ChatCompletionChunk | Completion:
        i = self.ident
        if i.kind == "chat":
            return ChatCompletionChunk(
                id=i.id,
                created=i.created,
                model=i.model,
                system_fingerprint=i.variant,
                choices=[],
                usage=usage,
            )
        return Completion(
            id=i.id,
            created=i.created,
            model=i.model,
            system_fingerprint=i.variant,
            choices=[],
            usage=usage,
        )
