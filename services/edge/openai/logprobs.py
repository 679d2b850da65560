"""Logprobs: what an OpenAI body asks for, and the workers' `TokenLogprob`s in OpenAI's shapes.

Pure. Chat asks with `logprobs: true` and `top_logprobs` (0..20), completions with
`logprobs: <n>`; both become the request's `logprobs` (alternatives per token). The answer
puts them where OpenAI's and vLLM's servers do:
- chat: `choices[].logprobs.content`, one `{token, logprob, bytes, top_logprobs}` per
  token, the alternatives most likely first (OpenAI's rule; vLLM lists the chosen token
  first when it is not among them);
- completions: `choices[].logprobs` as `{tokens, token_logprobs, top_logprobs,
  text_offset}`, each position's `top_logprobs` holding its token and the alternatives (as
  vLLM's: up to n + 1 entries), `text_offset` counting characters from the answer's start.
In a stream each chunk carries the logprobs of its own tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.edge.openai.errors import HttpError, invalid
from services.edge.openai.schema import (
    ChatCompletionRequest,
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
    CompletionRequest,
)
from shared.messages import MAX_TOP_LOGPROBS, TokenLogprob


def asked(body: ChatCompletionRequest | CompletionRequest) -> int | HttpError | None:
    """The alternatives per token the body asks for (0: each token's own logprob only);
    None: no logprobs; or the 400 that says why the ask is wrong. A completion's
    `logprobs` is range-checked with the request (`ChatRequest.logprobs`)."""
    if isinstance(body, CompletionRequest):
        return body.logprobs
    top = body.top_logprobs
    if not body.logprobs:
        if top:  # vLLM's rule: alternatives without the logprobs they go with
            return invalid("top_logprobs: needs `logprobs: true`", "top_logprobs")
        return None
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        return invalid(f"top_logprobs: must be between 0 and {MAX_TOP_LOGPROBS}", "top_logprobs")
    return top or 0


def wanted(body: ChatCompletionRequest | CompletionRequest) -> bool:
    """Whether the answer carries logprobs (each choice's `logprobs` is set, else null)."""
    return isinstance(asked(body), int)


def token_bytes(token: str) -> list[int]:
    """The token's UTF-8 bytes (OpenAI's `bytes`: a token may be part of a character)."""
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(tokens: Sequence[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=t.token,
                logprob=t.logprob,
                bytes=token_bytes(t.token),
                top_logprobs=[
                    ChatTopLogprob(token=a.token, logprob=a.logprob, bytes=token_bytes(a.token))
                    for a in t.top
                ],
            )
            for t in tokens
        ]
    )


def completion_logprobs(tokens: Sequence[TokenLogprob], text_offset: int) -> CompletionLogprobs:
    """`text_offset`: characters of the answer before the first of `tokens` (0 for a whole
    answer; in a stream, the text sent before this chunk)."""
    offsets: list[int] = []
    for t in tokens:
        offsets.append(text_offset)
        text_offset += len(t.token)
    return CompletionLogprobs(
        text_offset=offsets,
        token_logprobs=[t.logprob for t in tokens],
        tokens=[t.token for t in tokens],
        top_logprobs=[{t.token: t.logprob, **{a.token: a.logprob for a in t.top}} for t in tokens],
    )
