"""Shared fixtures: a real broker for the session, a default service stack for the session; and the
test tiers: the unit tier marked `unit`, guarded from starting processes (tests/tiers.py)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import signal
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import services.ingest.handling as ingest_handling
from deploy.kafka import launcher
from deploy.kafka import secure as secured
from shared.topics import Topics
from tests.chaos.toxiproxy import ProxiedCluster, Toxiproxy
from tests.kafka_env import kafka_bootstrap
from tests.processes import free_port_pair, free_port_run, running
from tests.stack import (
    FAULT_STACK_ENV,
    SERVICES,
    Stack,
    new_prefix,
    settings_from_env,
    wait_until,
)
from tests.tenants import SHARED_STACK_ENV, SHARED_STACK_TENANTS
from tests.tiers import UNIT, ProcessGuard, is_unit
from tokenbus.acls import create_acls, service_acls

# The real-engine suite runs in the vLLM worker's own environment (deploy/test.sh runs it
# there, after this run); the services' environment has no vLLM to serve it with.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["real_engine"]

_guard = ProcessGuard()


# The session's three-node cluster: the tests that use it run last, the chaos check last of
# all (it kills nodes), so that the cluster lives only while they run.
THREE_NODES = "three_nodes"
# The session's faultable broker: the tests that hang or stop it run together, after the
# plain ones and before the three-node ones, and it stops when the last of them ends.
FAULTABLE = "faultable_broker"
SECURED = "secured_cluster"
# Set on the tests of the three-node cluster: `make test` runs them (the chaos check among
# them) after the rest, alone on the machine.
CLUSTER = "cluster"
_FAULTABLE_CLUSTER = pytest.StashKey[launcher.Cluster]()
_FAULT_STACK = pytest.StashKey[Stack]()


# First, so that `-m unit` / `-m "not unit"` see the mark when they deselect.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if is_unit(fixtures, (mark.name for mark in item.iter_markers())):
            item.add_marker(UNIT)
        if THREE_NODES in fixtures:
            item.add_marker(CLUSTER)
    if config.pluginmanager.hasplugin("xdist"):
        groups = _groups(items)
        for item in items:
            item.add_marker(pytest.mark.xdist_group(groups[_module(item.nodeid)]))
    items.sort(key=_runs_late)  # stable: the order within each group stays


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _groups(items: Iterable[pytest.Item]) -> dict[str, str]:
    """The tests one worker of `pytest -n` runs together (`--dist loadgroup`, deploy/test.sh),
    by module: a module's tests together (its module fixtures start once), and every module
    with a test of a session fixture that must start once (the faultable broker, the secured
    broker, the three-node cluster) in that fixture's group."""
    groups: dict[str, str] = {}
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        # The faultable broker is the secured one (one JVM node fewer): one group for both.
        shared = next((f for f in (SECURED, FAULTABLE, THREE_NODES) if f in fixtures), None)
        module = _module(item.nodeid)
        if shared is not None:
            groups[module] = shared
        else:
            groups.setdefault(module, module)
    return groups


def _runs_late(item: pytest.Item) -> tuple[bool, bool, bool]:
    return (
        THREE_NODES in getattr(item, "fixturenames", ()),
        item.get_closest_marker("chaos") is not None,
        FAULTABLE in getattr(item, "fixturenames", ()),
    )


# Under `pytest -n`, on the controller: the workers that ran each module's tests.
_workers_of: dict[str, set[str]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    node = getattr(report, "node", None)  # the worker that sent it (pytest-xdist)
    if node is not None and report.when == "setup":
        _workers_of.setdefault(_module(report.nodeid), set()).add(node.gateway.id)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A module whose tests ran on two workers started its fixtures twice: `_groups` did not
    take (pytest-xdist's loadgroup reads it from the test's id; ADR 0067). Fails the run."""
    split = sorted(module for module, workers in _workers_of.items() if len(workers) > 1)
    if split:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                f"\nconftest: {len(split)} modules ran on more than one worker (their groups did "
                f"not take; ADR 0067): {', '.join(split[:5])}",
                red=True,
            )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    if item.get_closest_marker(UNIT) is None:
        return (yield)
    with _guard.watching(item.nodeid):
        return (yield)


@pytest.hookimpl(wrapper=True, trylast=True)  # innermost: inside the output's capture
def pytest_runtest_teardown(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, object, None]:
    """Stops the faultable broker once the last test that uses it is torn down (they run
    together: `_runs_late`), not at the session's end; a later test would start it again."""
    try:
        yield
    finally:
        uses = [FAULTABLE in getattr(i, "fixturenames", ()) for i in (item, nextitem)]
        if uses == [True, False] and (cluster := item.config.stash.get(_FAULTABLE_CLUSTER, None)):
            if (stack := item.config.stash.get(_FAULT_STACK, None)) is not None:
                del item.config.stash[_FAULT_STACK]
                stack.stop()  # before its broker goes
            launcher.stop(cluster)


@pytest.fixture(scope="session")
def bootstrap() -> Iterator[str]:
    try:
        with kafka_bootstrap() as servers:
            yield servers
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("service-logs")


@pytest.fixture(scope="session")
def secured_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[launcher.Cluster]:
    """One secured broker (SASL_SSL, client certificates, ACLs) for the session's security
    modules: each provisions its own topic prefix and grants, so they share it."""
    state = tmp_path_factory.mktemp("secured-kafka")
    started, _ = launcher.start_cluster(
        nodes=1, port=free_port_pair(), state_dir=state, secure=True
    )
    try:
        yield started
    finally:
        launcher.stop(started)


@pytest.fixture(scope="session")
def three_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxiedCluster]:
    """One proxied three-node cluster for the session (issue 36), with a Toxiproxy proxy
    between the clients and each node: the cluster, Toxiproxy and chaos modules share it.
    Each test takes it `whole()` (every node up, no toxic) and names its topics by a prefix
    of its own. Waits for the Toxiproxy server if `make test` is still building it."""
    state = tmp_path_factory.mktemp("three-nodes")
    cluster = launcher.Cluster.resolve(
        free_port_run(3 * launcher.ports_per_node(proxied=True)),
        state / "kafka",
        nodes=3,
        proxied=True,
    )
    try:
        with Toxiproxy.start(cluster, log_file=state / "toxiproxy.log") as proxy:
            launcher.start(cluster)
            yield ProxiedCluster(cluster, proxy)
    finally:
        pids = launcher.running_pids(cluster).values()
        launcher.stop(cluster)
        # The launcher's stop of a three-node cluster, checked here (tests/test_launcher.py).
        left = [pid for pid in pids if running(pid)]
        assert not left, f"the launcher's stop left nodes of the three running: {left}"


@dataclass(frozen=True)
class FaultableBroker:
    """A single-node broker a test may hang (SIGSTOP) or stop and start again on the same
    port and state dir (topics and offsets are kept): `faultable_broker`."""

    cluster: launcher.Cluster

    @property
    def bootstrap(self) -> str:
        return self.cluster.bootstrap_servers

    @property
    def pid(self) -> int:
        return launcher.running_pids(self.cluster)[1]

    def hang(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def wake(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def stop(self) -> None:
        assert launcher.stop(self.cluster), "the faultable broker was not running"

    def start(self) -> None:
        launcher.start(self.cluster)

    def whole(self) -> FaultableBroker:
        """Running, not hung, and serving, whatever a test did to it (started again if it
        was stopped, which counts a JVM start)."""
        for pid in launcher.running_pids(self.cluster).values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        launcher.start(self.cluster)
        return self


@pytest.fixture(scope="session")
def _faultable_node(
    request: pytest.FixtureRequest, secured_cluster: launcher.Cluster
) -> Iterator[FaultableBroker]:
    # The secured broker (issue 36: one JVM node, not two): its modules run first, then the
    # fault tests take it away; it stops after the last of them (pytest_runtest_teardown).
    request.config.stash[_FAULTABLE_CLUSTER] = secured_cluster
    broker = FaultableBroker(secured_cluster)
    try:
        yield broker.whole()
    finally:
        with contextlib.suppress(KeyError, ProcessLookupError):
            broker.wake()


@pytest.fixture
def faultable_broker(_faultable_node: FaultableBroker) -> Iterator[FaultableBroker]:
    """The session's secured single-node broker, for its fault tests once its security
    modules are done (issue 36): never the shared broker, which no test stops. A test may
    hang it or stop it; it is whole when the test begins and again when it ends, pass or
    fail, and it stops after the last of them (they run together, after every other test
    of their worker but the three-node ones). Its clients log in (`Stack.settings`)."""
    try:
        yield _faultable_node.whole()
    finally:
        _faultable_node.whole()


@pytest.fixture(scope="session")
def _fault_stack(
    request: pytest.FixtureRequest, _faultable_node: FaultableBroker, log_dir: Path
) -> Iterator[Stack]:
    cluster, prefix = _faultable_node.cluster, new_prefix()
    admin = settings_from_env(cluster.client_env(secured.ADMIN), topic_prefix=prefix)
    asyncio.run(create_acls(admin, service_acls(Topics(prefix))))  # each service its own login
    stack = Stack.logged_in(
        cluster,
        prefix,
        log_dir,
        env_overrides=dict(FAULT_STACK_ENV),
        ready_timeout_s=240,  # a loaded machine's broker elects the new topics' leaders slowly
    )
    request.config.stash[_FAULT_STACK] = stack
    try:
        yield stack.start()
    finally:
        if request.config.stash.get(_FAULT_STACK, None) is stack:  # not stopped with its broker
            del request.config.stash[_FAULT_STACK]
            stack.stop()


@pytest.fixture
def fault_stack(_fault_stack: Stack, faultable_broker: FaultableBroker) -> Stack:
    """The fault tests' stack (issue 36): one for the session on the faultable broker, with
    FAULT_STACK_ENV. Each test hangs or stops the broker under it and asserts that every
    service rides it out in place; the next test finds it whole and serving again, which
    it checks before it begins (a service that exited fails it: none is restarted by hand).
    Tests isolate by request id and tenant, not by topic: they read their own records."""
    wait_until(_fault_stack.edge_ready, 240, "the fault stack's edge ready again")
    for key in SERVICES:
        ready = lambda k=key: _fault_stack.health(k, "/readyz")[0] == 200  # noqa: E731
        wait_until(ready, 120, f"the fault stack's {key} ready again")
    return _fault_stack


def _default_stack(bootstrap: str, log_dir: Path) -> Iterator[Stack]:
    # Every tenant and test-only sim marker a module on the shared stack uses (tests/tenants.py):
    # a superset of the default stack's, which changes nothing for a request that uses none.
    s = Stack(
        bootstrap=bootstrap,
        prefix=new_prefix(),
        log_dir=log_dir,
        tenant_limits=SHARED_STACK_TENANTS,
        env_overrides=dict(SHARED_STACK_ENV),
    )
    try:
        yield s.start()
    finally:
        s.stop()


@pytest.fixture(scope="session")
def stack(bootstrap: str, log_dir: Path) -> Iterator[Stack]:
    """The default stack, one for the session (issue 36): the modules that ask for it
    isolate their tests by request id, prompt and tenant, and leave every service running
    (a module may add a service of its own, an edge, and stop and remove it again). Its
    keys file has every tenant of tests/tenants.py, and its sim the test-only markers.
    A module that restarts a service or reads a whole shared topic (the DLQ) takes its own:
    it names `own_stack` in a `stack` fixture of its own."""
    yield from _default_stack(bootstrap, log_dir)


@pytest.fixture(scope="module")
def own_stack(bootstrap: str, log_dir: Path) -> Iterator[Stack]:
    """A default stack for one module alone."""
    yield from _default_stack(bootstrap, log_dir)


@pytest.fixture
def no_recall(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ingest's handling recalls nothing from the DLQ (`recall` answers 0 at once): for its
    unit tests, whose producer is a fake and which have no broker to read."""

    async def fake_recall(*args: object) -> int:
        return 0

    monkeypatch.setattr(ingest_handling, "recall", fake_recall)
