"""A sim model that answers a set share of prompts wrongly (tests and drills of shadow
validation and canary rollback).

With `worker_sim_wrong_share` at `share` > 0, the sim engine answers a prompt for which
`answers_wrong(prompt, share)` holds with the text it would give another prompt (the same
prompt, salted): as long and as fluent as its usual answer, but other words, so a gold
variant's answer disagrees with it. Chosen by a hash of the prompt, so a prompt is always
right or always wrong on such a worker, and a test can tell which answers must score low.
"""

from __future__ import annotations

import hashlib

_SALT = "tokenbus-sim-wrong\x00"


def answers_wrong(prompt: str, share: float) -> bool:
    """Whether a worker answering `share` (0-1) of prompts wrongly gets this one wrong."""
    if share <= 0.0:
        return False
    digest = hashlib.blake2b((_SALT + prompt).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < share


def answered_as(prompt: str, share: float) -> str:
    """The prompt whose answer the sim gives to `prompt`: itself, or a salted one."""
    return _SALT + prompt if answers_wrong(prompt, share) else prompt
