"""Deterministic text for the `sim` engine: the same prompt and settings give the same tokens."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from services.worker.engines.base import FinishReason

_SENTENCE = (
    "the bus leaves when it is full or when the first passenger has waited long enough "
    "tokens stream back through kafka to the edge and on to the socket every request "
    "carries its own reply address so any edge can deliver it batches form per tier "
    "interactive traffic rides first background work ages until it may board deadlines "
    "are kept workers report free slots the scheduler sends each batch to one worker "
    "with room a result record names its request attempt and sequence number so the "
    "client never sees a token twice a trace follows the request across every hop "
    "latency throughput and memory are measured not guessed"
)
_WORDS = _SENTENCE.split()


@dataclass(frozen=True)
class Completion:
    """What the `sim` engine generates for one request, token by token."""

    pieces: tuple[str, ...]  # text emitted for each generated token ('' where held back)
    completion_tokens: int
    finish_reason: FinishReason

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def natural_tokens(prompt: str, temperature: float = 1.0, top_p: float = 1.0) -> list[str]:
    """The full answer the model 'wants' to give, before max_tokens and stop apply."""
    seed = hashlib.sha256(f"{prompt}\x00{temperature!r}\x00{top_p!r}".encode()).digest()
    rng = random.Random(seed)
    length = rng.randint(24, 120)
    tokens: list[str] = []
    sentence = 0
    while len(tokens) < length:
        word = rng.choice(_WORDS)
        if sentence == 0:
            tokens.append(("" if not tokens else " ") + word.capitalize())
        else:
            tokens.append(" " + word)
        sentence += 1
        if sentence >= rng.randint(6, 14):
            tokens.append(".")
            sentence = 0
    if tokens[-1] != ".":
        tokens.append(".")
    return tokens


def complete(
    prompt: str,
    max_tokens: int,
    stop: tuple[str, ...] = (),
    temperature: float = 1.0,
    top_p: float = 1.0,
) -> Completion:
    """Apply `max_tokens` and `stop` to the natural answer, as a real engine would."""
    pieces: list[str] = []
    emitted = ""
    for count, token in enumerate(natural_tokens(prompt, temperature, top_p), start=1):
        candidate = emitted + token
        hit = _first_stop(candidate, stop)
        if hit is not None:
            # The stop string is not part of the output; the token that completed it counts.
            pieces.append(candidate[:hit][len(emitted) :])
            return Completion(tuple(pieces), count, "stop")
        pieces.append(token)
        emitted = candidate
        if count >= max_tokens:
            return Completion(tuple(pieces), count, "length")
    return Completion(tuple(pieces), len(pieces), "stop")


def _first_stop(text: str, stop: tuple[str, ...]) -> int | None:
    hits = [i for s in stop if (i := text.find(s)) >= 0]
    return min(hits) if hits else None


# Echoed text is emitted this many characters per token: lossless, whatever it holds.
ECHO_PIECE_CHARS = 4


def echo(prompt: str, marker: str, max_tokens: int) -> Completion | None:
    """Test-only scripted answer: the prompt's text after the last `marker`, verbatim.

    None if the prompt has no marker. Lets a test make the model "say" a given text (the
    chat page's XSS tests); reachable only with `worker_sim_echo_marker` set, unset by default.
    """
    at = prompt.rfind(marker)
    if at < 0:
        return None
    text = prompt[at + len(marker) :]
    pieces = [text[i : i + ECHO_PIECE_CHARS] for i in range(0, len(text), ECHO_PIECE_CHARS)]
    if len(pieces) > max_tokens:
        return Completion(tuple(pieces[:max_tokens]), max_tokens, "length")
    return Completion(tuple(pieces), len(pieces), "stop")
