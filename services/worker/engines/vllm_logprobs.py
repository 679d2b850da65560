"""vLLM's per-token logprobs (`CompletionOutput.logprobs`) as tokenbus's `TokenLogprob`s.

Pure, and free of vLLM imports. vLLM 0.32's output processor gives a DELTA stream, for each
new token, a dict token id -> `Logprob(logprob, rank, decoded_token)` (`vllm/logprobs.py`
`append_logprobs_for_next_position`): the sampled token, with its rank in the vocabulary,
and the request's `logprobs` most likely tokens, ranks 1..n (one entry when the sampled
token is one of them). A `FlatLogprobs` reads the same, by position.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from shared.messages import TokenLogprob, TopLogprob

# What vLLM's server writes for -inf (and what it reports a missing logprob as): JSON has no
# infinity, and OpenAI uses this floor.
LOGPROB_FLOOR = -9999.0

Step = Mapping[int, Any]  # token id -> vllm.logprobs.Logprob


def token_logprobs(
    token_ids: Sequence[int],
    steps: Sequence[Step | None] | None,
    top: int,
    decode: Callable[[int], str],
) -> tuple[TokenLogprob, ...]:
    """One `TokenLogprob` per token of `token_ids` (a delta's new tokens), each with the
    `top` most likely alternatives by rank; `steps` is the delta's `logprobs`, position by
    position. `decode` names a token vLLM left undecoded (`decoded_token` None).

    A position vLLM gave nothing for (None, or no entry for the token) reads as the floor,
    as vLLM's own server reports it.
    """
    found = len(steps) if steps is not None else 0
    return tuple(
        _one(token_id, (steps[i] if steps is not None and i < found else None) or {}, top, decode)
        for i, token_id in enumerate(token_ids)
    )


def _one(token_id: int, step: Step, top: int, decode: Callable[[int], str]) -> TokenLogprob:
    chosen = step.get(token_id)
    ranked = sorted(
        (rank, tid)
        for tid, lp in step.items()
        if (rank := lp.rank) is not None and 1 <= rank <= top
    )
    return TokenLogprob(
        token=_text(token_id, chosen, decode),
        logprob=LOGPROB_FLOOR if chosen is None else clamp(chosen.logprob),
        top=[
            TopLogprob(token=_text(tid, step[tid], decode), logprob=clamp(step[tid].logprob))
            for _, tid in ranked
        ],
    )


def _text(token_id: int, logprob: Any, decode: Callable[[int], str]) -> str:
    decoded = None if logprob is None else logprob.decoded_token
    return decoded if decoded is not None else decode(token_id)


def clamp(logprob: float) -> float:
    """The logprob as JSON can carry it: -inf (and NaN) become the floor."""
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR
