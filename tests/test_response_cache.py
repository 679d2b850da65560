"""The response cache's pure parts: which requests it takes, their key, its bounds, replay."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from aiokafka.errors import KafkaConnectionError
from hypothesis import given
from hypothesis import strategies as st

import services.ingest.handling as handling_module
from services.ingest.admission import Admitted, Duplicate, admit
from services.ingest.handling import Ingest
from services.ingest.response_cache import (
    ResponseCache,
    cache_key,
    entry_size,
    replay,
)
from services.ingest.settings import IngestSettings
from services.ingest.telemetry import IngestTelemetry
from shared.kafka import encode
from shared.messages import (
    CacheEntry,
    DeltaResult,
    DoneResult,
    QueuedRequest,
    ReplyTo,
    RequestLimits,
    RequestRecord,
    Tier,
    Usage,
)
from shared.topics import Topics
from tests.test_ingest_handling import PREFIX, FakeAdmin, FakeProducer
from tests.test_ingest_handling import record as raw_record

BASE: dict[str, Any] = {
    "request_id": "r-1",
    "messages": [{"role": "user", "content": "why kafka?"}],
    "max_tokens": 32,
    "temperature": 0.0,
}


def record(**changes: Any) -> RequestRecord:
    return RequestRecord.model_validate({**BASE, **changes})


def queued(key: str | None = None, **changes: Any) -> QueuedRequest:
    request = QueuedRequest.from_record(
        record(**changes), tier=Tier.interactive, reply_to=ReplyTo(topic="tokenbus.results")
    )
    return request.model_copy(update={"cache_key": key or cache_key(request)})


def entry(key: str, text: str = "abc", stored_at: float = 1000.0, model: str = "m") -> CacheEntry:
    return CacheEntry(
        key=key,
        chunks=[text[:1], text[1:]],
        finish_reason="stop",
        usage=Usage(prompt_tokens=3, completion_tokens=2),
        model=model,
        request_id="first",
        stored_at=stored_at,
    )


def key(n: int) -> str:
    return f"{n:064x}"


# -- the key -------------------------------------------------------------------------------


def test_the_key_changes_with_every_field_that_decides_the_answer() -> None:
    changes: list[dict[str, Any]] = [
        {"messages": [{"role": "user", "content": "why kafka!"}]},
        {"messages": [{"role": "system", "content": "why kafka?"}]},
        {"messages": None, "prompt": "why kafka?"},
        {"max_tokens": 33},
        {"temperature": 0.5, "seed": 1},
        {"top_p": 0.9},
        {"stop": ["\n"]},
        {"seed": 2},
        {"tenant": "other"},
    ]
    keys = {cache_key(record(**c)) for c in changes} | {cache_key(record())}
    assert len(keys) == len(changes) + 1


@given(
    request_id=st.from_regex(r"[a-z0-9-]{1,20}", fullmatch=True),
    client_id=st.none() | st.text(max_size=10),
    priority=st.none() | st.sampled_from(list(Tier)),
    deadline_ms=st.none() | st.integers(1, 10**6),
    reply_to=st.none() | st.builds(ReplyTo, topic=st.just("app.replies"), partition=st.none()),
    created_at=st.floats(0, 2e9),
)
def test_the_key_ignores_who_asked_where_and_when(
    request_id: str,
    client_id: str | None,
    priority: Tier | None,
    deadline_ms: int | None,
    reply_to: ReplyTo | None,
    created_at: float,
) -> None:
    other = record(
        request_id=request_id,
        client_id=client_id,
        priority=priority,
        deadline_ms=deadline_ms,
        reply_to=reply_to,
        created_at=created_at,
    )
    assert cache_key(other) == cache_key(record())


def test_an_unset_max_tokens_is_a_key_of_its_own() -> None:
    # Unset, the answer runs to the end of the context: not the answer of the estimate's
    # number of tokens (ADR 0051).
    limits = RequestLimits(default_max_tokens=64)
    named = RequestRecord.model_validate({**BASE, "max_tokens": 64}, context={"limits": limits})
    unnamed = {k: v for k, v in BASE.items() if k != "max_tokens"}
    unset = RequestRecord.model_validate(unnamed, context={"limits": limits})
    assert unset.max_tokens is None
    assert cache_key(named) != cache_key(unset)
    again = RequestRecord.model_validate(unnamed, context={"limits": RequestLimits()})
    assert cache_key(again) == cache_key(unset)  # the estimate is no part of it


def test_only_deterministic_requests_that_did_not_opt_out_are_cacheable() -> None:
    assert record(temperature=0).cacheable
    assert record(temperature=0.8, seed=3).cacheable
    assert not record(temperature=0.8).cacheable
    assert not record(temperature=0, cache=False).cacheable
    assert not record(temperature=0.8, seed=3, cache=False).cacheable


def test_admission_keys_cacheable_requests_only_when_the_cache_is_on() -> None:
    topics, limits = Topics("t"), RequestLimits()

    def admitted(cache_on: bool, **changes: Any) -> QueuedRequest:
        decision = admit(encode(record(**changes)), None, topics, limits, set(), cache=cache_on)
        assert isinstance(decision, Admitted)
        return decision.request

    assert admitted(True).cache_key == cache_key(record())
    assert admitted(False).cache_key is None
    assert admitted(True, temperature=1.0).cache_key is None
    assert admitted(True, cache=False).cache_key is None


def test_the_cache_topic_is_no_reply_to() -> None:
    topics = Topics("t")
    decision = admit(
        encode(record(reply_to={"topic": topics.cache})), None, topics, RequestLimits(), set()
    )
    assert not isinstance(decision, Admitted)


# -- the bounded map -----------------------------------------------------------------------


def test_a_hit_needs_the_key_a_fresh_entry_and_the_model_named() -> None:
    now = [1000.0]
    cache = ResponseCache(10, 10_000, max_age_s=60, clock=lambda: now[0])
    request = queued()
    assert cache.get(request) is None
    cache.put(entry(request.cache_key or ""))
    assert cache.get(request) is not None
    assert cache.get(request.model_copy(update={"cache_key": None})) is None
    now[0] += 61
    assert cache.get(request) is None
    assert len(cache) == 0


def test_a_named_model_is_answered_only_by_its_own_answers() -> None:
    cache = ResponseCache(10, 10_000, max_age_s=60, clock=lambda: 1000.0)
    request = queued()
    cache.put(entry(request.cache_key or "", model="small"))
    # `model` is the models helper's field; any request type that carries one is checked.
    named = request.model_copy()
    object.__setattr__(named, "model", "large")
    assert cache.get(named) is None
    object.__setattr__(named, "model", "small")
    assert cache.get(named) is not None


def test_the_least_recently_used_go_first_within_count_and_bytes() -> None:
    cache = ResponseCache(2, 10_000, max_age_s=60, clock=lambda: 1000.0)
    a, b, c = (queued(key(n)) for n in range(3))
    cache.put(entry(key(0)))
    cache.put(entry(key(1)))
    assert cache.get(a) is not None  # b is now the least recently used
    cache.put(entry(key(2)))
    assert (cache.get(a) is not None, cache.get(b) is None, cache.get(c) is not None) == (
        True,
        True,
        True,
    )
    size = entry_size(entry(key(0), "x" * 100))
    by_bytes = ResponseCache(100, 2 * size, max_age_s=60, clock=lambda: 1000.0)
    for n in range(3):
        by_bytes.put(entry(key(n), "x" * 100))
    assert len(by_bytes) == 2
    assert by_bytes.bytes == 2 * size


def test_a_newer_answer_replaces_an_older_and_a_tombstone_drops_it() -> None:
    cache = ResponseCache(10, 10_000, max_age_s=60, clock=lambda: 1000.0)
    request = queued(key(7))
    cache.put(entry(key(7), "old"))
    cache.put(entry(key(7), "newer"))
    found = cache.get(request)
    assert found is not None
    assert "".join(found.chunks) == "newer"
    assert cache.bytes == entry_size(found)
    cache.drop(key(7))
    assert cache.get(request) is None
    assert cache.bytes == 0


def test_entries_past_the_age_bound_are_not_even_kept() -> None:
    cache = ResponseCache(10, 10_000, max_age_s=60, clock=lambda: 1000.0)
    cache.put(entry(key(1), stored_at=900.0))
    assert len(cache) == 0


# -- the replay ----------------------------------------------------------------------------


def test_a_replay_is_a_normal_stream_marked_cached() -> None:
    request = queued(key(3), created_at=990.0)
    stream = replay(request, entry(key(3), "hello"), now=1000.0)
    deltas = [r for r in stream if isinstance(r, DeltaResult)]
    assert [d.seq for d in deltas] == [0, 1]
    assert "".join(d.text for d in deltas) == "hello"
    done = stream[-1]
    assert isinstance(done, DoneResult)
    assert done.seq == 2
    assert done.cached
    assert done.request_id == request.request_id
    assert done.attempt == request.attempt
    assert done.usage.completion_tokens == 2
    assert done.timings.total_ms == 10_000.0


# -- ingest's handling of a hit (fakes for Kafka, as in test_ingest_handling.py) -------------


def hit_ingest(broker: FakeProducer, cache: ResponseCache) -> Ingest:
    settings = IngestSettings(
        topic_prefix=PREFIX, ingest_retry_backoff_ms=1, ingest_retry_backoff_max_ms=5
    )
    admin = FakeAdmin({f"{PREFIX}.results": 4})
    telemetry = IngestTelemetry(f"{PREFIX}.requests")
    # No tails consumer: its tests replace `recall`.
    return Ingest(settings, broker, admin, telemetry, cache, tails=None)  # type: ignore[arg-type]


async def test_a_hit_is_written_to_reply_to_whole_and_never_to_its_tier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:

    from tests.test_ingest_handling import FakeProducer

    async def no_recall(*args: object) -> int:
        return 0

    monkeypatch.setattr(handling_module, "recall", no_recall)
    body = {"request_id": "r2", "prompt": "hi", "temperature": 0, "max_tokens": 8}
    stored = cache_key(RequestRecord.model_validate(body))
    cache = ResponseCache(10, 10_000, max_age_s=3600)
    cache.put(entry(stored, "hello", stored_at=time.time()))
    # The first write to the results topic fails after it was queued: all is written again.
    broker = FakeProducer(late={"tb.results": [KafkaConnectionError()]})
    ingest = hit_ingest(broker, cache)
    await ingest.recall()
    [decision] = await ingest.handle_batch([raw_record(body)])
    assert isinstance(decision, Admitted)
    assert decision.answer is not None
    assert broker.on("tb.requests.interactive") == []
    written = [json.loads(p["value"]) for p in broker.on("tb.results")]
    assert [(r["kind"], r["seq"]) for r in written[-3:]] == [
        ("delta", 0),
        ("delta", 1),
        ("done", 2),
    ]
    assert written[-1]["cached"] is True
    assert all(p["key"] == b"r2" for p in broker.on("tb.results"))
    # Remembered once stored: the same record again is a duplicate, written nowhere.
    again = await ingest.handle(raw_record(body, offset=1))
    assert isinstance(again, Duplicate)
    # A miss of the same cache (another prompt) goes to its tier, keyed to be stored.
    [miss] = await ingest.handle_batch([raw_record({**body, "request_id": "r3", "prompt": "ho"})])
    assert isinstance(miss, Admitted)
    assert miss.answer is None
    [tier] = broker.on("tb.requests.interactive")
    assert miss.request.cache_key is not None
    assert json.loads(tier["value"])["cache_key"] == miss.request.cache_key
