"""Outside applications on a secured broker: each one is who its Kafka principal says.

One secured cluster (SASL_SSL, client certificates, ACLs: the session's `secured_cluster`,
tests/conftest.py, which tests/test_kafka_security.py shares) and one stack for the module; two
applications, `app` (A, the victim) and `app2` (B, the attacker), each logged in as its own
principal with only what `tokenbus topics create --acls --app app --app app2` grants. Each
test is B's attack, sent as B would send it: to the one requests topic B may write, or to
a topic it may not.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiokafka.errors import TopicAuthorizationFailedError

from deploy.kafka import launcher
from deploy.kafka import secure as secured
from services.ingest.admission import UNREAD_COPY_BYTES
from services.worker.engines.sim_text import complete
from shared.dead_letters import REASON, REPLY, SOURCE, TRUNCATED
from shared.kafka import key_of, make_admin, make_consumer, make_producer
from shared.settings import TokenbusSettings
from shared.topics import Topics
from tests.stack import SERVICES, Stack, new_prefix, read_records, settings_from_env
from tokenbus.app_quotas import (
    DEFAULT_APP_PRODUCE_BYTES_PER_S,
    PRODUCER_BYTE_RATE,
    set_app_quotas,
    user_quotas,
)
from tokenbus.topics import ensure_topics, grant_acls

pytestmark = pytest.mark.integration

A, B = secured.APPS  # the victim and the attacker, each its own SCRAM user
BURST_BYTES = 1_000_000
APP_PRODUCE_BYTES_PER_S = DEFAULT_APP_PRODUCE_BYTES_PER_S
BURST = 6  # ingest_app_burst here: B's flood goes over it, the other tests stay under it


@pytest.fixture(scope="module")
def cluster(secured_cluster: launcher.Cluster) -> launcher.Cluster:
    return secured_cluster


def settings_of(cluster: launcher.Cluster, user: str, prefix: str) -> TokenbusSettings:
    return settings_from_env(cluster.client_env(user), topic_prefix=prefix)


@dataclass(frozen=True)
class Letter:
    key: bytes | None
    value: bytes
    headers: dict[str, str]


@pytest.fixture(scope="module")
def stack(cluster: launcher.Cluster, log_dir: Path) -> Iterator[Stack]:
    """The four services, each as its own principal; ingest reads both apps' topics."""
    prefix = new_prefix()
    admin = settings_of(cluster, secured.ADMIN, prefix)
    principals = {role: f"User:{role}" for role in SERVICES}
    apps = {A: f"User:{A}", B: f"User:{B}"}

    async def provision() -> None:
        await ensure_topics(admin, replication=1, apps=apps)
        await grant_acls(admin, principals, apps)
        await set_app_quotas(admin, apps, APP_PRODUCE_BYTES_PER_S)  # as `topics create --acls`

    asyncio.run(provision())
    stack = Stack.logged_in(
        cluster,
        prefix,
        log_dir,
        env_overrides={
            "TOKENBUS_EDGE_LEASE_TTL_S": "60",
            "TOKENBUS_INGEST_APPS": f"{A},{B}",
            "TOKENBUS_INGEST_APP_RPS": "0.2",
            "TOKENBUS_INGEST_APP_BURST": str(BURST),
            # Bytes too: a megabyte at once, then a kilobyte a second (N6's flood is bytes).
            "TOKENBUS_INGEST_APP_BURST_BYTES": str(BURST_BYTES),
            "TOKENBUS_INGEST_APP_BYTES_PER_S": "1000",
        },
        ready_timeout_s=180,
    )
    try:
        yield stack.start()
    finally:
        stack.stop()


def as_app(cluster: launcher.Cluster, app: str, stack: Stack) -> TokenbusSettings:
    return settings_of(cluster, app, stack.prefix)


async def write(settings: TokenbusSettings, topic: str, *records: tuple[str, bytes]) -> None:
    """Write `(key, value)` records under `settings`' login; raises what the broker refuses."""
    producer = make_producer(settings, client_id=f"{settings.kafka_sasl_username}-writer")
    await producer.start()
    try:
        for key, value in records:
            await asyncio.wait_for(producer.send_and_wait(topic, value, key=key_of(key)), 60)
    finally:
        await producer.stop()


async def read(settings: TokenbusSettings, topic: str, partitions: int) -> list[Letter]:
    """Every record of `topic` now, read under `settings`' login (no group: READ only)."""
    records = await read_records(settings, topic, partitions, client_id="identity-reader")
    return [
        Letter(r.key, r.value or b"", {k: (v or b"").decode() for k, v in r.headers})
        for r in records
    ]


async def until(
    fetch: Callable[[], Any], done: Callable[[list[Letter]], bool], what: str, timeout: float = 60
) -> list[Letter]:
    """Poll `fetch()` until `done` holds of what it read (a deadline, never a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while True:
        letters: list[Letter] = await fetch()
        if done(letters):
            return letters
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.5)


def bodies(letters: list[Letter]) -> list[dict[str, Any]]:
    return [json.loads(letter.value) for letter in letters]


def of_request(letters: list[Letter], request_id: str) -> list[dict[str, Any]]:
    return [b for b in bodies(letters) if b.get("request_id") == request_id]


def ended(request_id: str) -> Callable[[list[Letter]], bool]:
    return lambda letters: any(
        b["kind"] in ("done", "error") for b in of_request(letters, request_id)
    )


def request(request_id: str, prompt: str, **fields: Any) -> tuple[str, bytes]:
    body = {"request_id": request_id, "prompt": prompt, "max_tokens": 8, **fields}
    return request_id, json.dumps(body).encode()


def new_id() -> str:
    return "r-" + uuid.uuid4().hex[:10]


class Apps:
    """A's and B's logins and topics in one stack."""

    def __init__(self, cluster: launcher.Cluster, stack: Stack) -> None:
        self.topics: Topics = stack.topics
        self.admin = stack.settings
        self.login = {app: as_app(cluster, app, stack) for app in (A, B)}

    async def send(self, app: str, *records: tuple[str, bytes]) -> None:
        await write(self.login[app], self.topics.app_requests(app), *records)

    async def replies(self, app: str) -> list[Letter]:
        """The app's own reply topic, read as the app itself."""
        return await read(self.login[app], self.topics.app_replies(app), 4)

    async def dead_letters(self) -> list[Letter]:
        return await read(self.admin, self.topics.dlq, 1)


@pytest.fixture(scope="module")
def apps(cluster: launcher.Cluster, stack: Stack) -> Apps:
    return Apps(cluster, stack)


def dead_letter_of(letters: list[Letter], request_id: str) -> Letter | None:
    return next((x for x in letters if x.key == request_id.encode()), None)


async def test_claiming_another_apps_tenant_is_dead_lettered_with_its_reason(apps: Apps) -> None:
    rid = new_id()
    await apps.send(B, request(rid, "as if I were A", tenant=A))
    letters = await until(
        apps.dead_letters, lambda ls: dead_letter_of(ls, rid) is not None, "B's dead letter"
    )
    letter = dead_letter_of(letters, rid)
    assert letter is not None
    assert letter.headers[REASON] == "tenant_forbidden"
    assert letter.headers[SOURCE].startswith(apps.topics.app_requests(B) + "/")
    assert letter.headers[REPLY] == "delivered"
    # B is told, on its own reply topic, under its own scope of the id.
    mine = await until(lambda: apps.replies(B), ended(f"{B}:{rid}"), "B's error")
    [error] = of_request(mine, f"{B}:{rid}")
    assert (error["kind"], error["code"]) == ("error", "unauthorized")


async def test_naming_another_apps_reply_topic_is_refused(apps: Apps) -> None:
    rid = new_id()
    await apps.send(
        B, request(rid, "answer A, not me", reply_to={"topic": apps.topics.app_replies(A)})
    )
    letters = await until(
        apps.dead_letters, lambda ls: dead_letter_of(ls, rid) is not None, "B's dead letter"
    )
    letter = dead_letter_of(letters, rid)
    assert letter is not None
    assert letter.headers[REASON] == "reply_to_forbidden"
    mine = await until(lambda: apps.replies(B), ended(f"{B}:{rid}"), "B's error")
    assert of_request(mine, f"{B}:{rid}")[0]["kind"] == "error"
    # Nothing of B's request reached A's reply topic.
    theirs = await apps.replies(A)
    assert not [b for b in bodies(theirs) if rid in b.get("request_id", "")]


@pytest.mark.parametrize(
    ("field", "value"),
    [("variant", "no-worker-declares-this"), ("created_at", 4102444800.0)],
    ids=["variant", "created_at"],
)
async def test_an_app_cannot_pin_a_variant_or_set_its_own_clock(
    apps: Apps, field: str, value: object
) -> None:
    """Issue 37, N3 and N7. B pins a variant no worker declares: before, ingest admitted it
    and the scheduler held it for ever (no deadline), keeping its tier partition's commit
    behind it until, 16,000 records later, the partition paused for every tenant. B stamps
    its own `created_at` (the year 2100): before, admitted with a deadline that never comes
    and a TTFT that a canary's verdict reads. Now each is dead-lettered with its reason, B
    is told on its own topic, and A's request sent after it is answered."""
    rid, victim = new_id(), new_id()
    await apps.send(B, request(rid, "hold the partition", **{field: value}))
    await apps.send(A, request(victim, "the victim's question"))
    letters = await until(
        apps.dead_letters, lambda ls: dead_letter_of(ls, rid) is not None, "B's dead letter"
    )
    letter = dead_letter_of(letters, rid)
    assert letter is not None
    assert letter.headers[REASON] == f"{field}_forbidden"
    assert letter.headers[REPLY] == "delivered"
    mine = await until(lambda: apps.replies(B), ended(f"{B}:{rid}"), "B's error")
    [error] = of_request(mine, f"{B}:{rid}")
    assert (error["kind"], error["code"]) == ("error", "unauthorized")
    assert error["message"].startswith(f"{field}: ")
    theirs = await until(lambda: apps.replies(A), ended(f"{A}:{victim}"), "A's answer", 90)
    assert of_request(theirs, f"{A}:{victim}")[-1]["kind"] == "done"


async def test_an_app_cannot_read_another_apps_replies(apps: Apps) -> None:
    theirs = apps.topics.app_replies(A)
    # The broker hides the topic from B...
    admin = make_admin(apps.login[B], client_id="snooping-admin")
    await admin.start()
    try:
        (described,) = await admin.describe_topics([theirs])
    finally:
        await admin.close()
    assert described["error_code"] == TopicAuthorizationFailedError.errno
    # ...and a subscription to it, under a group B may use, is refused by name.
    consumer = make_consumer(
        apps.login[B], theirs, group_id=f"{apps.topics.app_replies(B)}.snoop", client_id="snoop"
    )
    try:
        with pytest.raises(TopicAuthorizationFailedError, match=theirs):
            await asyncio.wait_for(consumer.start(), 60)
    finally:
        await consumer.stop()
    # A itself reads it: the refusal is B's, not the topic's.
    await apps.replies(A)


@pytest.mark.parametrize("topic_of", ["A's requests topic", "the shared requests topic"])
async def test_an_app_cannot_write_as_another_app_or_as_the_edge(apps: Apps, topic_of: str) -> None:
    topic = apps.topics.app_requests(A) if topic_of.startswith("A") else apps.topics.requests
    with pytest.raises(TopicAuthorizationFailedError):
        await write(apps.login[B], topic, request(new_id(), "pretending", tenant=A))


async def test_reusing_another_apps_request_id_does_not_take_its_answer(apps: Apps) -> None:
    rid = new_id()
    # B goes first with A's (guessed or seen) next id, then A sends its own request.
    await apps.send(B, request(rid, "the attacker's words"))
    await apps.send(A, request(rid, "the victim's own question"))
    theirs = await until(lambda: apps.replies(A), ended(f"{A}:{rid}"), "A's answer", 90)
    answer = of_request(theirs, f"{A}:{rid}")
    assert answer[-1]["kind"] == "done", answer[-1]
    text = "".join(str(b["text"]) for b in answer if b["kind"] == "delta")
    assert text == complete("the victim's own question", 8).text
    assert text != complete("the attacker's words", 8).text
    # B got its own answer, under its own scope, on its own topic.
    mine = await until(lambda: apps.replies(B), ended(f"{B}:{rid}"), "B's answer", 90)
    assert of_request(mine, f"{B}:{rid}")[-1]["kind"] == "done"


async def test_a_lone_surrogate_record_is_answered_on_its_reply_topic(apps: Apps) -> None:
    rid = new_id()
    raw = b'{"request_id": "' + rid.encode() + b'", "prompt": "a\\ud800b", "max_tokens": 2}'
    await apps.send(B, (rid, raw))
    mine = await until(lambda: apps.replies(B), ended(f"{B}:{rid}"), "B's error", 60)
    [error] = of_request(mine, f"{B}:{rid}")
    assert (error["kind"], error["code"]) == ("error", "invalid_request")
    assert "JSON" in error["message"]


# Last: the floods leave A's and B's buckets empty; every record is charged, a bad one too.
async def test_flooding_over_the_quota_is_refused_with_a_retry_hint(apps: Apps) -> None:
    ids = [new_id() for _ in range(3 * BURST)]
    await apps.send(B, *(request(rid, "flood") for rid in ids))
    scoped = [f"{B}:{rid}" for rid in ids]

    def all_ended(letters: list[Letter]) -> bool:
        return all(ended(rid)(letters) for rid in scoped)

    mine = await until(lambda: apps.replies(B), all_ended, "an end for each flood request", 90)
    limited = [
        b for b in bodies(mine) if b.get("request_id") in scoped and b.get("code") == "rate_limited"
    ]
    assert len(limited) >= len(ids) - BURST - 1, len(limited)  # 0.2/s refills ~1 meanwhile
    assert all(b["kind"] == "error" and b["retry_after_ms"] > 0 for b in limited)
    letters = await apps.dead_letters()
    assert {x.headers[REASON] for x in letters if x.key in {r.encode() for r in ids}} == {
        "rate_limited"
    }


async def test_a_flood_of_big_records_is_refused_unread_and_dead_lettered_short(
    apps: Apps,
) -> None:
    """Issue 37, N6: past its bytes quota an app's records are refused before ingest parses
    them, each answered `rate_limited` and dead-lettered as its first KiB (before: parsed
    whole, then copied whole to the DLQ, a megabyte a record for as long as the flood ran)."""
    ids = [new_id() for _ in range(3)]
    prompt = "x" * (BURST_BYTES * 6 // 10)  # two of them are over the burst
    raws = {rid: request(rid, prompt)[1] for rid in ids}
    await apps.send(A, *raws.items())
    scoped = {f"{A}:{rid}": rid for rid in ids}

    def all_ended(letters: list[Letter]) -> bool:
        return all(ended(rid)(letters) for rid in scoped)

    mine = await until(lambda: apps.replies(A), all_ended, "an end for each big record", 90)
    limited = {b["request_id"] for b in bodies(mine) if b.get("code") == "rate_limited"} & set(
        scoped
    )
    assert len(limited) >= 2, limited
    letters = await until(
        apps.dead_letters,
        lambda got: all(dead_letter_of(got, scoped[rid]) for rid in limited),
        "the refused records' dead letters",
    )
    for rid in limited:
        letter = dead_letter_of(letters, scoped[rid])
        assert letter is not None
        assert letter.headers[REASON] == "rate_limited"
        assert letter.value == raws[scoped[rid]][:UNREAD_COPY_BYTES]
        assert letter.headers[TRUNCATED] == str(len(raws[scoped[rid]]))


async def test_each_apps_principal_has_a_kafka_produce_quota(
    cluster: launcher.Cluster, stack: Stack
) -> None:
    """Issue 37, N6: ingest charges an app's records before it parses them, but only the
    broker can bound how fast they reach its disks. `tokenbus topics create --acls --app`
    sets a produce quota for each app's principal (Kafka's `producer_byte_rate`, enforced
    by the broker by delaying the app's produce responses); before, none was set. Read back
    from the secured broker under the admin's login."""
    admin = settings_of(cluster, secured.ADMIN, stack.prefix)
    for app in (A, B):
        quotas = await user_quotas(admin, f"User:{app}")
        assert quotas == {PRODUCER_BYTE_RATE: APP_PRODUCE_BYTES_PER_S}, (app, quotas)
    assert await user_quotas(admin, "User:ingest") == {}  # the services' own are not limited
