"""Whether an answer passes a route's verifiers (shared/cascades.py): pure checks of its text.

`failing` names the first verifier an answer fails (the reason a cascade escalates it), or
None when it passes them all. Each check is a plain function of the answer:

- `json_schema`: the text parses as JSON and is valid against the schema (`jsonschema`);
- `regex`: a search finds the pattern in the text, within `REGEX_TIMEOUT_S` (the `regex`
  package, which can stop a search and releases the GIL while it runs: a pattern that
  backtracks catastrophically on an answer a tenant steers neither blocks the worker nor
  runs on; an answer not shown to match in time fails the verifier);
- `length`: characters of the text, or its generated tokens, within [min, max];
- `refusal`: the text does not open with one of the phrases (case-insensitive, after any
  leading whitespace, quotes and markdown emphasis; a curly apostrophe reads as `'`);
- `logprob`: the mean log-probability of its tokens is at least `min_mean`. Only an answer
  with log-probs is judged (vLLM gives them when the request asks; the sim engine has none
  and refuses the field): without them this verifier passes it, and `unjudged` says so.

`judge` runs them in a thread, off the worker's event loop (heartbeats, other runs): a JSON
parse and a schema validation of a long answer take their time too (issue 37, N9). JSON
nested past the parser's depth is not valid JSON, never an error that escapes.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import regex
from jsonschema.validators import validator_for

from shared.cascades import (
    JsonSchemaVerifier,
    LengthVerifier,
    LogprobVerifier,
    RefusalVerifier,
    RegexVerifier,
    Verifier,
)

# The longest a regex verifier searches one answer (it checks its clock as it goes).
REGEX_TIMEOUT_S = 0.5

# What may come before a refusal's first word: whitespace, quotes, markdown emphasis.
_LEAD = " \t\r\n\"'`*_>#-"


@dataclass(frozen=True)
class Answer:
    """What a verifier sees of an answer."""

    text: str
    completion_tokens: int
    logprobs: Sequence[float] | None = None  # one per generated token; None: none given


async def judge(verifiers: Sequence[Verifier], answer: Answer) -> str | None:
    """`failing`, in a thread: the event loop goes on meanwhile."""
    return await asyncio.to_thread(failing, verifiers, answer)


def failing(verifiers: Sequence[Verifier], answer: Answer) -> str | None:
    """The kind of the first verifier `answer` fails, or None if it passes every one."""
    for verifier in verifiers:
        if not passes(verifier, answer):
            return verifier.kind
    return None


def unjudged(verifiers: Sequence[Verifier], answer: Answer) -> bool:
    """Whether a verifier could not judge the answer (a logprob one, without log-probs)."""
    return not answer.logprobs and any(isinstance(v, LogprobVerifier) for v in verifiers)


def passes(verifier: Verifier, answer: Answer) -> bool:
    if isinstance(verifier, JsonSchemaVerifier):
        return valid_json(verifier.json_schema, answer.text)
    if isinstance(verifier, RegexVerifier):
        return searches(verifier.pattern, answer.text)
    if isinstance(verifier, LengthVerifier):
        return within(verifier, answer)
    if isinstance(verifier, RefusalVerifier):
        return not refuses(answer.text, verifier.phrases)
    return mean_logprob_at_least(verifier.min_mean, answer.logprobs)


def searches(pattern: str, text: str) -> bool:
    """Whether `pattern` is found in `text` within `REGEX_TIMEOUT_S`."""
    try:
        found = _compiled(pattern).search(text, timeout=REGEX_TIMEOUT_S, concurrent=True)
    except TimeoutError:
        return False  # not shown to match in time
    return found is not None


def valid_json(schema: dict[str, Any], text: str) -> bool:
    try:
        instance = json.loads(text)
        return bool(_validator(json.dumps(schema, sort_keys=True)).is_valid(instance))
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return False


def within(bound: LengthVerifier, answer: Answer) -> bool:
    size = len(answer.text) if bound.unit == "chars" else answer.completion_tokens
    if bound.min is not None and size < bound.min:
        return False
    return bound.max is None or size <= bound.max


def refuses(text: str, phrases: Sequence[str]) -> bool:
    """Whether `text` opens with one of `phrases` (case-insensitive)."""
    opening = text.replace("\u2019", "'").lstrip(_LEAD).casefold()
    return any(opening.startswith(p.replace("\u2019", "'").casefold()) for p in phrases)


def mean_logprob_at_least(min_mean: float, logprobs: Sequence[float] | None) -> bool:
    if not logprobs:
        return True  # not judged: see the module's docstring
    return sum(logprobs) / len(logprobs) >= min_mean


@functools.lru_cache(maxsize=256)
def _compiled(pattern: str) -> regex.Pattern[str]:
    return regex.compile(pattern)


@functools.lru_cache(maxsize=64)
def _validator(schema_json: str) -> Any:  # a jsonschema Validator (the package has no types)
    schema = json.loads(schema_json)
    return validator_for(schema)(schema)
