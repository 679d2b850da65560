"""The edge's background loops never end in silence (unit: fake loops, no Kafka).

ADR 0039: a stray CancelledError from inside the result reader ended it with no log line
and no restart, and the edge went on accepting requests it could no longer answer. A loop
that fails, returns, or is cancelled from within is logged and restarted; one the edge
itself cancels (shutdown) ends.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from pydantic import SecretStr
from structlog.testing import capture_logs

from services.edge import keys as keyfile
from services.edge import runtime
from services.edge.app import Edge
from services.edge.settings import EdgeSettings


@pytest.fixture
def edge(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Edge:
    keys, _, _ = keyfile.add_key(keyfile.KeysFile(), "acme", {}, 0.0)
    keyfile.save(tmp_path / "keys.json", keys)
    monkeypatch.setattr(runtime, "RESTART_MIN_S", 0.01)
    return Edge(
        EdgeSettings(
            edge_keys_file=tmp_path / "keys.json", resume_secret=SecretStr(secrets.token_hex(16))
        )
    )


def ends_once(how: str) -> tuple[Callable[[], Awaitable[None]], asyncio.Event]:
    """A loop that ends `how` on its first run and then runs until cancelled; the event is
    set when it runs again."""
    runs: list[int] = []
    again = asyncio.Event()

    async def loop() -> None:
        runs.append(1)
        if len(runs) == 1:
            if how == "raises":
                raise RuntimeError("boom")
            if how == "cancelled":
                raise asyncio.CancelledError  # from within, as a stale waiter's cancel would
            return
        again.set()
        await asyncio.Event().wait()

    return loop, again


@pytest.mark.parametrize("how", ["raises", "cancelled", "returns"])
async def test_a_loop_that_ends_is_logged_and_restarted(edge: Edge, how: str) -> None:
    loop, again = ends_once(how)
    with capture_logs() as logs:
        task = asyncio.create_task(runtime.supervised("edge-results", loop, edge.metrics))
        async with asyncio.timeout(5):
            await again.wait()
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    failed = [e for e in logs if e["event"] == "edge.task_failed"]
    assert [e["task"] for e in failed] == ["edge-results"]
    assert edge.metrics.task_restarts.labels("edge-results")._value.get() == 1


async def test_a_loop_the_edge_cancels_ends_without_a_restart(edge: Edge) -> None:
    started = asyncio.Event()

    async def loop() -> None:
        started.set()
        await asyncio.Event().wait()

    with capture_logs() as logs:
        task = asyncio.create_task(runtime.supervised("edge-sweeper", loop, edge.metrics))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert not [e for e in logs if e["event"] == "edge.task_failed"]


class FakeClient:
    """Stands in for a Kafka client: records start and stop; `fails` makes start raise."""

    def __init__(self, name: str, log: list[str], fails: bool = False) -> None:
        self.name, self.log, self.fails = name, log, fails

    async def start(self) -> None:
        if self.fails:
            raise ConnectionError(f"{self.name} cannot reach the broker")
        self.log.append(f"{self.name} started")

    async def stop(self) -> None:
        self.log.append(f"{self.name} stopped")

    async def close(self) -> None:
        await self.stop()


@pytest.mark.parametrize("failing", ["admin", "consumer"])
async def test_a_client_that_fails_to_start_leaves_none_started_behind(
    edge: Edge, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """The lifespan leaked its producer when a later client failed to start (issue 27)."""
    log: list[str] = []
    monkeypatch.setattr(runtime, "RenewingProducer", lambda _make: FakeClient("producer", log))
    monkeypatch.setattr(
        runtime, "make_admin", lambda *_, **__: FakeClient("admin", log, failing == "admin")
    )
    monkeypatch.setattr(
        runtime,
        "make_consumer",
        lambda *_, **__: FakeClient("consumer", log, failing == "consumer"),
    )
    with pytest.raises(ConnectionError, match=failing):
        async with edge.lifespan(None):  # type: ignore[arg-type]
            pytest.fail("the lifespan yielded although a client failed")
    started = [entry.split()[0] for entry in log if entry.endswith("started")]
    stopped = [entry.split()[0] for entry in log if entry.endswith("stopped")]
    assert stopped == list(reversed(started))  # every started client stopped, in reverse
    assert "producer" in started
    assert edge.gateway is None


async def test_the_lease_is_renewed_while_the_edge_is_still_starting(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stop 17's clean clone: the reader's start took 2.3 s against a 3 s lease, the lease was
    first renewed only once the edge served, and another edge took its partition. Keeping
    the lease starts as soon as it is held."""
    log: list[str] = []
    keeping = asyncio.Event()
    reader_started = asyncio.Event()

    class FakeKeeper:
        """Stands in for the lease keeper: says when its keeping began."""

        partition = 0

        def __init__(self, *_: object) -> None:
            pass

        async def keep(self) -> None:
            keeping.set()
            await asyncio.Event().wait()

        async def release(self) -> None:
            log.append("lease released")

    async def slow_reader_start(*_: object) -> None:
        await asyncio.wait_for(keeping.wait(), 5)  # a start that outlasts the lease
        reader_started.set()

    async def partitions(*_: object, **__: object) -> list[int]:
        return [0]

    async def leased(*_: object) -> int:
        return 0

    monkeypatch.setattr(runtime, "RenewingProducer", lambda _make: FakeClient("producer", log))
    monkeypatch.setattr(runtime, "make_admin", lambda *_, **__: FakeClient("admin", log))
    monkeypatch.setattr(runtime, "make_consumer", lambda *_, **__: FakeClient("consumer", log))
    monkeypatch.setattr(runtime, "topic_partitions", partitions)
    monkeypatch.setattr(runtime, "LeaseKeeper", FakeKeeper)
    monkeypatch.setattr(runtime, "lease_partition", leased)
    monkeypatch.setattr(runtime.ResultReader, "start", slow_reader_start)
    assert edge.settings.edge_result_topology == "partition"
    async with edge.lifespan(None):  # type: ignore[arg-type]
        assert reader_started.is_set()  # the reader started only once the lease was kept
    assert "lease released" in log
