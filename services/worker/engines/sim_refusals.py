"""A sim model that declines a set share of prompts (tests and benches of cascades).

With `worker_sim_refuse_share` at `share` > 0, the sim engine answers a prompt with
`REFUSAL_TEXT` instead of its usual text when `refuses(prompt, share)`: chosen by a hash of
the prompt, so a prompt is always declined or always answered by such a worker, and a
test can tell which prompts a cascade must escalate. The text opens with a phrase the
refusal verifier knows (shared/cascades.py `REFUSAL_PHRASES`).
"""

from __future__ import annotations

import hashlib
import re

from services.worker.engines.sim_text import Completion

REFUSAL_TEXT = "I'm sorry, but I can't help with that request."
_SALT = b"tokenbus-sim-refuse\x00"
_PIECE = re.compile(r"\s*(?:\w+|[^\w\s])")  # a sim token with the space before it


def refuses(prompt: str, share: float) -> bool:
    """Whether a worker declining `share` (0-1) of prompts declines this one."""
    if share <= 0.0:
        return False
    digest = hashlib.blake2b(_SALT + prompt.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < share


def refusal(max_tokens: int) -> Completion:
    """The refusal as the sim generates it, cut at `max_tokens` like any answer."""
    pieces = _PIECE.findall(REFUSAL_TEXT)
    if len(pieces) > max_tokens:
        return Completion(tuple(pieces[:max_tokens]), max_tokens, "length")
    return Completion(tuple(pieces), len(pieces), "stop")
