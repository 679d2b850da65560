"""The sim's logprobs (tests and benches only; `TOKENBUS_WORKER_SIM_LOGPROBS`): the sim has
no logits, so a token's logprob and its alternatives are made up from the token's text and
position. They are shaped and sized as vLLM's are (one entry per token, up to 20
alternatives, most likely first), which is what a test of the bus's and the edge's weight
needs (issue 37, N1), and mean nothing else."""

from __future__ import annotations

import zlib

from shared.messages import TokenLogprob, TopLogprob

# Alternatives' texts: short words, as a tokenizer's pieces mostly are.
_ALTERNATIVES = tuple(f" alt{i}" for i in range(20))


def token_logprob(piece: str, position: int, top: int) -> TokenLogprob:
    """`piece`'s made-up logprob at `position`, with `top` alternatives (the chosen token
    first among them, as vLLM lists it when it is the most likely)."""
    chosen = -((zlib.crc32(f"{position}:{piece}".encode()) % 1000) / 1000.0)
    alternatives = [TopLogprob(token=piece, logprob=chosen)][:top]
    alternatives += [
        TopLogprob(token=_ALTERNATIVES[i], logprob=chosen - 1.0 - i) for i in range(top - 1)
    ]
    return TokenLogprob(token=piece, logprob=chosen, top=alternatives)
