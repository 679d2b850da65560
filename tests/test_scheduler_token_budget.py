"""A request no batch could hold is refused at ingest, with a clear error, against the budgets
the scheduler uses (both read the same `TOKENBUS_SCHEDULER_*_MAX_BATCH_TOKENS`)."""

from __future__ import annotations

import json

import pytest

from services.ingest.admission import Admitted, RecentIds, Rejected, admit
from services.ingest.settings import IngestSettings
from services.scheduler.settings import SchedulerSettings
from services.worker.engines.sim_profiles import SimProfile
from shared.messages import ErrorCode
from shared.tokens import prompt_token_bound
from shared.topics import Topics

TOPICS = Topics("tb")


def decide(body: dict[str, object], settings: IngestSettings) -> object:
    return admit(json.dumps(body).encode(), b"r1", TOPICS, settings.limits(), RecentIds())


def test_ingest_refuses_a_request_above_the_largest_tier_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TOKENBUS_SCHEDULER_INTERACTIVE_MAX_BATCH_TOKENS", "300")
    monkeypatch.setenv("TOKENBUS_SCHEDULER_BACKGROUND_MAX_BATCH_TOKENS", "500")
    ingest = IngestSettings()
    assert ingest.limits().max_request_tokens == 500
    assert SchedulerSettings().policy_config().largest_token_budget == 500

    fits = decide({"request_id": "r1", "prompt": "hello", "max_tokens": 450}, ingest)
    assert isinstance(fits, Admitted)
    assert fits.request.token_cost <= 500

    big = decide({"request_id": "r2", "prompt": "hello", "max_tokens": 500}, ingest)
    assert isinstance(big, Rejected)
    assert big.code is ErrorCode.invalid_request
    assert "above the largest batch token budget of 500" in big.message
    error = big.error_result()
    assert error is not None
    assert error.request_id == "r2"  # the requester is told, on its reply_to


def test_by_default_every_valid_ascii_request_fits_a_batch() -> None:
    settings = IngestSettings()
    limits = settings.limits()
    # A request is charged its prompt's UTF-8 bytes plus a template allowance (ADR 0046): the
    # longest ASCII prompt fits; one of multi-byte characters that long may not, and is
    # refused where it enters rather than left waiting.
    # No max_tokens cap by default: the model's context is the cap (ADR 0051); the default
    # sim's context (8192) stands for it.
    largest = prompt_token_bound("a" * settings.max_prompt_chars) + SimProfile().context_length
    assert limits.max_request_tokens is not None
    assert largest <= limits.max_request_tokens
