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


def natural_tokens(
    prompt: str,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int | None = None,
    at_least: int = 0,
) -> list[str]:
    """The full answer the model 'wants' to give, before max_tokens and stop apply.

    `seed` picks another sample of the same request (None: the one sample the request has
    always had). `at_least`: the answer goes on past its natural end to this many tokens
    (`min_tokens`, `ignore_eos`: the end-of-sequence is suppressed).
    """
    key = f"{prompt}\x00{temperature!r}\x00{top_p!r}"
    if seed is not None:
        key += f"\x00{seed}"
    rng = random.Random(hashlib.sha256(key.encode()).digest())
    length = max(rng.randint(24, 120), at_least)
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
    temperature: float | None = 1.0,
    top_p: float | None = 1.0,
    *,
    seed: int | None = None,
    min_tokens: int = 0,
    ignore_eos: bool = False,
) -> Completion:
    """Apply `max_tokens` and `stop` to the natural answer, as a real engine would; no stop
    string ends it before `min_tokens` (vLLM's rule), nor its natural end."""
    pieces: list[str] = []
    emitted = ""
    at_least = max_tokens if ignore_eos else min_tokens
    # Unset: the sim model's own defaults.
    natural = natural_tokens(
        prompt,
        1.0 if temperature is None else temperature,
        1.0 if top_p is None else top_p,
        seed,
        at_least,
    )
    for count, token in enumerate(natural, start=1):
        candidate = emitted + token
        # Only text new since the last check (and a stop string's length before it) is
        # searched: a stop string held off by min_tokens does not end the answer later.
        since = max(0, len(emitted) - max((len(s) for s in stop), default=0) + 1)
        hit = _first_stop(candidate, stop, since) if count > min_tokens else None
        if hit is not None:
            # The stop string is not part of the output; the token that completed it counts.
            pieces.append(candidate[:hit][len(emitted) :])
            return Completion(tuple(pieces), count, "stop")
        pieces.append(token)
        emitted = candidate
        if count >= max_tokens:
            return Completion(tuple(pieces), count, "length")
    return Completion(tuple(pieces), len(pieces), "stop")


def _first_stop(text: str, stop: tuple[str, ...], since: int = 0) -> int | None:
    hits = [i for s in stop if (i := text.find(s, since)) >= 0]
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
