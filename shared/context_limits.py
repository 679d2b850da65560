"""Whether a request's `max_tokens` fits the model's context: the one rule of edge and worker.

As vLLM 0.32's OpenAI server has it (`TokenizeParams`, `get_max_tokens`): a `max_tokens`
above the model's context (`max_model_len`) is refused, naming the field; a prompt plus
`max_tokens` above it is not: generation stops at the end of the context (finish_reason
`length`), and an unset `max_tokens` is the rest of the context (ADR 0051).
"""

from __future__ import annotations


def max_tokens_over_context(max_tokens: int | None, context_length: int | None) -> str | None:
    """Why `max_tokens` cannot be asked of a model of `context_length` tokens; None if it
    can, or if either is unknown (unset: the rest of the context)."""
    if max_tokens is None or context_length is None or max_tokens <= context_length:
        return None
    return (
        f"max_tokens: This model's maximum context length is {context_length} tokens. However,"
        f" you requested {max_tokens} output tokens (max_tokens). Please request fewer, or"
        " leave max_tokens unset for the rest of the context."
    )
