"""Run Apache Kafka (KRaft, one node or a local cluster) from Maven Central on the JVM."""

# Stdlib only: this runs before any virtual environment exists (CI, `make test`), and it
# is the one place that knows how the broker is laid out on disk.

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import signal
import socket
import string
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from deploy import test_ledger
from deploy.kafka import secure as secured

KAFKA_VERSION = "4.1.1"
HOST = "127.0.0.1"
DEFAULT_PORT = 9092
DEFAULT_STATE_DIR = ".tokenbus/kafka"
# Generous: three JVMs starting on a loaded 2-core machine are slow (ADR 0016 has the times).
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0

_HERE = Path(__file__).resolve().parent
POM = _HERE / "pom.xml"
SERVER_TEMPLATE = _HERE / "server.properties"
LOG4J_CONFIG = _HERE / "log4j2.properties"
# Nodes for a laptop or CI runner: a bounded heap (set per cluster size by `_jvm_options`)
# and short GC pauses matter more than throughput.
JVM_OPTS = (
    "-Xms128m",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
)

# Kafka's wire protocol: Metadata v4 is the oldest version Kafka 4.x still serves
# (KIP-896) and the newest one without tagged fields, so it is a few fixed bytes.
_METADATA_API_KEY = 3
_METADATA_VERSION = 4
_CLIENT_ID = b"tokenbus-launcher"
# What kafka.server.KafkaRaftServer logs (INFO, see log4j2.properties) once a node serves.
_STARTED_LINE = "Kafka Server started"


class LauncherError(Exception):
    """A start or stop that cannot go on; the message says what to do about it."""


def min_insync_replicas(replication_factor: int) -> int:
    """Two in-sync copies before acks=all succeeds once there are three; else every copy."""
    return 2 if replication_factor >= 3 else 1


# The inter-broker listener of a proxied cluster: replication and the brokers' own links
# bypass the clients' proxies, so a fault played on a proxy reaches clients only.
BROKER_LISTENER = "BROKER"


def ports_per_node(proxied: bool = False) -> int:
    """How many adjacent ports a node uses from its first: `free_port_run(size * this)`."""
    return 4 if proxied else 2


@dataclass(frozen=True)
class Node:
    """One KRaft node of a local cluster: a broker and a controller in one JVM.

    The broker serves clients on `port` and its controller on `port + 1`. In a proxied
    cluster it also serves the other brokers on `broker_port` (`port + 2`), and tells
    clients to reach it at `client_port` (`port + 3`), where a proxy (tests/chaos/
    toxiproxy.py) forwards to `port`; otherwise `client_port` is `port`.
    """

    node_id: int
    port: int
    state_dir: Path
    proxied: bool = False

    @property
    def controller_port(self) -> int:
        return self.port + 1

    @property
    def broker_port(self) -> int:
        """The inter-broker listener of a proxied cluster (unused otherwise)."""
        return self.port + 2

    @property
    def client_port(self) -> int:
        """Where clients are told to reach this node: the proxy's port in a proxied cluster."""
        return self.port + 3 if self.proxied else self.port

    @property
    def bootstrap_server(self) -> str:
        return f"{HOST}:{self.client_port}"

    @property
    def config_file(self) -> Path:
        return self.state_dir / "server.properties"

    @property
    def data_dir(self) -> Path:
        return self.state_dir / "data"

    @property
    def log_file(self) -> Path:
        return self.state_dir / "server.log"

    @property
    def pid_file(self) -> Path:
        return self.state_dir / "kafka.pid"


@dataclass(frozen=True)
class Cluster:
    """Where a local cluster of `size` nodes listens and keeps its files.

    Node i (1-based) listens on `port + 2(i-1)` and its controller one port above. A
    one-node cluster keeps its files directly in `state_dir` (the layout of every earlier
    version); a larger one gives each node `state_dir/node-<i>`.

    A proxied cluster (`proxied=True`) gives each node four ports from `port + 4(i-1)`
    (see `Node`): clients are told to reach node i at its `client_port`, where a proxy
    must forward to its `port`, while the brokers replicate and the controllers vote
    directly. `bootstrap_servers` then names the proxies' ports: nothing answers there
    until the proxies run. Not with `secure`.
    """

    port: int
    state_dir: Path
    size: int = 1
    # Clients on SASL_SSL with ACLs instead of PLAINTEXT (deploy/kafka/secure.py).
    secure: bool = False
    # Clients reach each node through a proxy of its own (fault injection, tests/chaos/).
    proxied: bool = False

    @classmethod
    def resolve(
        cls,
        port: int | None = None,
        state_dir: str | Path | None = None,
        nodes: int | None = None,
        secure: bool | None = None,
        proxied: bool | None = None,
    ) -> Cluster:
        """Fill what the caller left out: argument, then environment, then defaults.

        Port, size, security and proxying also fall back to what this state dir last ran
        with, so `stop` and `status` find a cluster started with `--port`/`--nodes`/
        `--secure` (or `proxied=True`) without being told again.
        """
        directory = Path(
            state_dir or os.environ.get("TOKENBUS_KAFKA_STATE_DIR") or DEFAULT_STATE_DIR
        ).resolve()
        if port is None:
            env_port = os.environ.get("TOKENBUS_KAFKA_PORT")
            port = int(env_port) if env_port else _recorded_port(directory) or DEFAULT_PORT
        if nodes is None:
            env_nodes = os.environ.get("TOKENBUS_KAFKA_NODES")
            nodes = int(env_nodes) if env_nodes else _recorded_size(directory) or 1
        if nodes < 1:
            raise LauncherError(f"a cluster needs at least one node, not {nodes}")
        if secure is None:
            secure = bool(_recorded_secure(directory))
        if proxied is None:
            proxied = bool(_recorded_proxied(directory))
        if secure and proxied:
            raise LauncherError("a proxied cluster serves PLAINTEXT only: drop secure or proxied")
        return cls(port=port, state_dir=directory, size=nodes, secure=secure, proxied=proxied)

    def node(self, node_id: int) -> Node:
        if not 1 <= node_id <= self.size:
            raise LauncherError(
                f"node ids of this cluster run from 1 to {self.size}, not {node_id}"
            )
        directory = self.state_dir if self.size == 1 else self.state_dir / f"node-{node_id}"
        first = self.port + ports_per_node(self.proxied) * (node_id - 1)
        return Node(node_id=node_id, port=first, state_dir=directory, proxied=self.proxied)

    @property
    def nodes(self) -> tuple[Node, ...]:
        return tuple(self.node(i) for i in range(1, self.size + 1))

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(n.bootstrap_server for n in self.nodes)

    @property
    def replication_factor(self) -> int:
        return min(3, self.size)

    @property
    def secure_files(self) -> secured.SecureFiles:
        """CA, certificates, passwords and per-user client settings of a secured cluster."""
        return secured.SecureFiles(self.state_dir / "secure")

    def client_env(self, user: str, mechanism: str = secured.MECHANISM) -> dict[str, str]:
        """`KAFKA_BOOTSTRAP_SERVERS` and the `TOKENBUS_KAFKA_*` login of `user` (secured)."""
        if not self.secure:
            return {"KAFKA_BOOTSTRAP_SERVERS": self.bootstrap_servers}
        return secured.client_env(self.secure_files, user, self.bootstrap_servers, mechanism)


class Running(NamedTuple):
    """A started cluster: node id -> pid, and whether this call started any node."""

    pids: dict[int, int]
    started: bool


# Nodes this process started: held so they can be reaped (no zombie that `kill -0` would
# call alive) when `tokenbus up` or a test starts and stops nodes in one process.
_spawned: dict[int, subprocess.Popen[bytes]] = {}


def start(cluster: Cluster, timeout_s: float = START_TIMEOUT_S) -> Running:
    """Start every node that does not run yet; return all pids once every node serves."""
    return _start_nodes(cluster, cluster.nodes, timeout_s)


def start_node(cluster: Cluster, node_id: int, timeout_s: float = START_TIMEOUT_S) -> int:
    """(Re)start one node on its own ports and data, unless it runs; return its pid."""
    return _start_nodes(cluster, (cluster.node(node_id),), timeout_s).pids[node_id]


def start_cluster(
    nodes: int = 3,
    port: int | None = None,
    state_dir: str | Path | None = None,
    timeout_s: float = START_TIMEOUT_S,
    secure: bool = False,
    proxied: bool = False,
) -> tuple[Cluster, Running]:
    """The Python API of `start --nodes N [--secure]`: the cluster (its `bootstrap_servers`,
    `client_env(user)`) and pids. `proxied`: see `Cluster`."""
    cluster = Cluster.resolve(port, state_dir, nodes, secure, proxied)
    return cluster, start(cluster, timeout_s)


def kill_node(cluster: Cluster, node_id: int) -> int | None:
    """SIGKILL one node, as a crash would, and wait until it is gone; return the pid killed."""
    node = cluster.node(node_id)
    with _locked(cluster):
        pid = running_pid(node)
        if pid is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        while _alive(pid):
            time.sleep(0.05)
        node.pid_file.unlink(missing_ok=True)
        return pid


def stop_node(cluster: Cluster, node_id: int, timeout_s: float = STOP_TIMEOUT_S) -> bool:
    """Stop one node by controlled shutdown (SIGTERM: it hands its leaderships over first),
    SIGKILL after `timeout_s`; return whether it went on SIGTERM (True if not running)."""
    node = cluster.node(node_id)
    with _locked(cluster):
        pid = running_pid(node)
        if pid is None:
            return True
        clean = _terminate(pid, timeout_s)
        node.pid_file.unlink(missing_ok=True)
        return clean


def stop(cluster: Cluster, timeout_s: float = STOP_TIMEOUT_S) -> bool:
    """Stop every node (SIGTERM, SIGKILL after `timeout_s`); return whether any was running."""
    if not cluster.state_dir.is_dir():
        return False
    with _locked(cluster):
        return _stop(list(cluster.nodes), timeout_s)


def running_pids(cluster: Cluster) -> dict[int, int]:
    """Node id -> pid of the nodes of this cluster that are alive."""
    return {n.node_id: pid for n in cluster.nodes if (pid := running_pid(n)) is not None}


def exit_status(pid: int) -> int | None:
    """How a node this process started ended (negative: the signal); None while it runs or
    when another process started it."""
    process = _spawned.get(pid)
    return None if process is None else process.poll()


def running_pid(node: Node) -> int | None:
    """The pid of this node if it is alive; clears a stale pid file."""
    try:
        pid = int(node.pid_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    if _alive(pid) and _is_our_broker(pid, node):
        return pid
    node.pid_file.unlink(missing_ok=True)
    return None


def broker_ids(port: int, timeout_s: float = 2.0) -> frozenset[int] | None:
    """The ids of the live (unfenced) brokers the node on `port` knows; None if it does not answer.

    A TCP connect is not enough: the socket opens before the broker has registered with
    the controller, and clients that connect then get no brokers to talk to.
    """
    header = struct.pack(">hhih", _METADATA_API_KEY, _METADATA_VERSION, 1, len(_CLIENT_ID))
    # topics = [] (none: only the brokers), allow_auto_topic_creation = false
    request = header + _CLIENT_ID + struct.pack(">i?", 0, False)
    try:
        with socket.create_connection((HOST, port), timeout=timeout_s) as sock:
            sock.sendall(struct.pack(">i", len(request)) + request)
            (size,) = struct.unpack(">i", _recv_exact(sock, 4))
            response = _recv_exact(sock, size)
        return _parse_brokers(response)
    except (OSError, struct.error, ValueError):
        return None


def answers(port: int, timeout_s: float = 2.0) -> bool:
    """Whether a Kafka broker on `port` serves metadata that lists at least one broker."""
    return bool(broker_ids(port, timeout_s))


def _serves(cluster: Cluster, node: Node, expected: frozenset[int]) -> bool:
    """Whether `node` serves clients, listing at least the brokers of `expected`.

    A secured listener serves metadata only after a TLS handshake and a SCRAM login, which
    this stdlib probe does not speak: there the broker's own "started" line (written once
    it is registered and unfenced) plus a TLS handshake with our CA stand in for it.
    """
    if not cluster.secure:
        ids = broker_ids(node.port)
        return bool(ids) and expected <= (ids or frozenset())
    return _STARTED_LINE in _read(node.log_file) and secured.accepts_tls(
        cluster.secure_files, HOST, node.port
    )


def _parse_brokers(response: bytes) -> frozenset[int]:
    # correlation_id, throttle_time_ms, then brokers: [node_id, host, port, rack?]
    correlation_id, _throttle_ms, count = struct.unpack_from(">iii", response, 0)
    if correlation_id != 1:
        raise ValueError(f"correlation id {correlation_id}, expected 1")
    offset, ids = 12, set()
    for _ in range(count):
        (node_id, host_len) = struct.unpack_from(">ih", response, offset)
        offset += 6 + host_len + 4  # host, then port
        (rack_len,) = struct.unpack_from(">h", response, offset)
        offset += 2 + max(rack_len, 0)
        ids.add(node_id)
    return frozenset(ids)


def resolve_classpath() -> str:
    """The broker's runtime classpath, resolved by Maven once per version of pom.xml."""
    digest = hashlib.sha256(POM.read_bytes()).hexdigest()[:16]
    cached = _cache_dir() / f"classpath-{digest}.txt"
    if cached.exists():
        classpath = cached.read_text().strip()
        # A cleaned ~/.m2 leaves the cache pointing at nothing: resolve again.
        if classpath and all(Path(jar).exists() for jar in classpath.split(os.pathsep)):
            return classpath
    mvn = _find_tool("mvn", "Apache Maven (apt-get install maven)")
    print(f"resolving Kafka {KAFKA_VERSION} with Maven…", flush=True)
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=cached.parent, suffix=".tmp", delete=False) as tmp:
        tmp_path = Path(tmp.name)
    try:
        result = subprocess.run(
            [mvn, "-q", "-B", "-Dstyle.color=never", "-f", str(POM),
             "dependency:build-classpath", f"-Dmdep.outputFile={tmp_path}"],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False,
        )  # fmt: skip
        if result.returncode != 0:
            raise LauncherError(
                f"Maven could not resolve Kafka {KAFKA_VERSION} (exit {result.returncode}):\n"
                + _tail(result.stdout + result.stderr)
            )
        # Rename, not write in place: a concurrent start never reads half a classpath.
        tmp_path.replace(cached)
    finally:
        tmp_path.unlink(missing_ok=True)
    return cached.read_text().strip()


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tokenbus" / "kafka"


def _recorded_listeners(state_dir: Path) -> str | None:
    """The `listeners=` value this state dir's cluster was last configured with (node 1's
    in a larger cluster); None if it was never configured."""
    for config_file in (
        state_dir / "server.properties",
        state_dir / "node-1" / "server.properties",
    ):
        with contextlib.suppress(FileNotFoundError):
            found = re.search(r"^listeners=(\S*)", config_file.read_text(), re.MULTILINE)
            return found.group(1) if found else ""
    return None


def _recorded_port(state_dir: Path) -> int | None:
    found = re.match(r"\w+://[^:]+:(\d+)", _recorded_listeners(state_dir) or "")
    return int(found.group(1)) if found else None


def _recorded_secure(state_dir: Path) -> bool | None:
    """Whether this state dir's cluster was last configured secured, if it was configured."""
    listeners = _recorded_listeners(state_dir)
    return None if listeners is None else listeners.startswith(f"{secured.CLIENT_LISTENER}://")


def _recorded_proxied(state_dir: Path) -> bool | None:
    """Whether this state dir's cluster was last configured proxied, if it was configured."""
    listeners = _recorded_listeners(state_dir)
    return None if listeners is None else f"{BROKER_LISTENER}://" in listeners


def _recorded_size(state_dir: Path) -> int | None:
    """How many nodes this state dir was last configured for, if any."""
    if (state_dir / "server.properties").exists():
        return 1
    nodes = [d for d in state_dir.glob("node-*") if (d / "server.properties").exists()]
    return len(nodes) or None


def _check_layout(cluster: Cluster) -> None:
    recorded = _recorded_size(cluster.state_dir)
    if recorded is not None and recorded != cluster.size:
        raise LauncherError(
            f"{cluster.state_dir} holds a {recorded}-node cluster, not {cluster.size}: "
            f"start it with --nodes {recorded}, or stop it and use another --state-dir"
        )
    # SCRAM users are written when the storage is formatted: a cluster cannot change sides.
    was_secure = _recorded_secure(cluster.state_dir)
    if was_secure is not None and was_secure != cluster.secure:
        kind = "secured" if was_secure else "PLAINTEXT"
        raise LauncherError(
            f"{cluster.state_dir} holds a {kind} cluster: start it "
            f"{'with' if was_secure else 'without'} --secure, or use another --state-dir"
        )


@contextlib.contextmanager
def _locked(cluster: Cluster) -> Iterator[None]:
    """Serialise start/stop on one state dir, so two racing starts launch one cluster."""
    cluster.state_dir.mkdir(parents=True, exist_ok=True)
    with open(cluster.state_dir / "launcher.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _start_nodes(cluster: Cluster, wanted: Sequence[Node], timeout_s: float) -> Running:
    """Start the nodes of `wanted` that do not run; wait until every running node serves."""
    with _locked(cluster):
        _check_layout(cluster)
        pids = running_pids(cluster)
        running_port = _recorded_port(cluster.state_dir)
        if pids and running_port != cluster.port:
            raise LauncherError(
                f"the cluster of {cluster.state_dir} already runs on port {running_port} "
                f"(pids {_pid_list(pids)}); stop it first to move it to {cluster.port}"
            )
        if pids and _recorded_proxied(cluster.state_dir) != cluster.proxied:
            raise LauncherError(
                f"the cluster of {cluster.state_dir} runs "
                f"{'' if cluster.proxied else 'proxied '}(pids {_pid_list(pids)}); "
                f"stop it first to start it {'proxied' if cluster.proxied else 'unproxied'}"
            )
        missing = [n for n in wanted if n.node_id not in pids]
        if not missing:
            _wait_until_ready(cluster, pids, time.monotonic() + timeout_s)
            print(f"already running at {cluster.bootstrap_servers} ({_pid_list(pids)})", flush=True)
            return Running(pids, started=False)
        for node in missing:
            _check_ports_free(node)
        java = _find_tool("java", "a Java 17+ runtime (apt-get install default-jre-headless)")
        classpath = resolve_classpath()
        if cluster.secure:
            try:
                secured.ensure(cluster.secure_files)
            except secured.SecureError as exc:
                raise LauncherError(str(exc)) from exc
            secured.write_env_files(cluster.secure_files, cluster.bootstrap_servers)
        for node in missing:
            node.state_dir.mkdir(parents=True, exist_ok=True)
            node.config_file.write_text(render_config(cluster, node))
            if cluster.secure:  # it holds the admin's and every PLAIN user's password
                node.config_file.chmod(0o600)
        _format_storage(cluster, missing, java, classpath)
        began = time.monotonic()
        spawned = {n.node_id: _spawn(n, java, classpath, _jvm_options(cluster)) for n in missing}
        pids.update(spawned)
        try:
            _wait_until_ready(cluster, pids, began + timeout_s)
        except LauncherError:
            for node_id, pid in spawned.items():
                _terminate(pid, timeout_s=5.0)
                cluster.node(node_id).pid_file.unlink(missing_ok=True)
            raise
        elapsed = time.monotonic() - began
        for node_id in spawned:  # a line per node: a node started again is a restart
            test_ledger.note(test_ledger.JVM_NODE, 1, str(cluster.node(node_id).state_dir))
        what = "broker" if cluster.size == 1 else f"{len(spawned)} of {cluster.size} nodes"
        print(f"{what} up at {cluster.bootstrap_servers} in {elapsed:.1f} s "
              f"({_pid_list(spawned)})", flush=True)  # fmt: skip
        if cluster.secure:
            print(secured.usage(cluster.secure_files), flush=True)
        return Running(pids, started=True)


def _stop(nodes: Sequence[Node], timeout_s: float) -> bool:
    """SIGTERM every node at once (a quorum stops faster together), SIGKILL stragglers."""
    pids = {n: pid for n in nodes if (pid := running_pid(n)) is not None}
    if not pids:
        return False
    began = time.monotonic()
    print(f"stopping Kafka ({_pid_list({n.node_id: p for n, p in pids.items()})})…", flush=True)
    for pid in pids.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    for node, pid in pids.items():
        if not _terminate(pid, max(0.0, began + timeout_s - time.monotonic())):
            print(f"Kafka node {node.node_id} ignored SIGTERM for {timeout_s:.0f} s; killed it")
        node.pid_file.unlink(missing_ok=True)
    print(f"stopped in {time.monotonic() - began:.1f} s", flush=True)
    return True


def _pid_list(pids: dict[int, int]) -> str:
    if list(pids) == [1]:
        return f"pid {pids[1]}"
    return "pids " + ", ".join(f"{node}:{pid}" for node, pid in sorted(pids.items()))


def _check_ports_free(node: Node) -> None:
    # Not the client port of a proxied node: its proxy may listen there already.
    bound = (node.port, node.controller_port, *((node.broker_port,) if node.proxied else ()))
    for port in bound:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            # SO_REUSEADDR as the JVM sets it: a port in TIME_WAIT after a stop is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((HOST, port))
            except OSError as exc:
                raise LauncherError(
                    f"port {HOST}:{port} is in use by another process ({exc.strerror}); "
                    f"node {node.node_id} needs {' and '.join(map(str, bound))}: "
                    "stop that process or choose another --port"
                ) from exc


def _find_tool(name: str, what: str) -> str:
    if name == "java" and (java_home := os.environ.get("JAVA_HOME")):
        candidate = Path(java_home) / "bin" / "java"
        if candidate.exists():
            return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise LauncherError(f"`{name}` not found on PATH: install {what}")
    return found


def render_config(cluster: Cluster, node: Node) -> str:
    """One node's server.properties: the one place that says what a node listens on.

    Listeners are named here (name -> port, name -> protocol): a further listener, such
    as SASL_SSL for clients, is one more entry in each map. A secured cluster serves
    clients (and its brokers' links) on SASL_SSL instead of PLAINTEXT, on the same port.
    A proxied one advertises its proxy's port to clients, and links its brokers on a
    listener of their own, advertised directly.
    """
    client = secured.CLIENT_LISTENER if cluster.secure else "PLAINTEXT"
    controller = secured.CONTROLLER_PROTOCOL if cluster.secure else "PLAINTEXT"
    listeners = {client: node.port, "CONTROLLER": node.controller_port}
    advertised = {client: node.client_port}
    protocols = {client: client, "CONTROLLER": controller}
    inter_broker = client
    if cluster.proxied:
        inter_broker = BROKER_LISTENER
        listeners[inter_broker] = advertised[inter_broker] = node.broker_port
        protocols[inter_broker] = "PLAINTEXT"
    template = string.Template(SERVER_TEMPLATE.read_text())
    extra = secured.server_properties(cluster.secure_files) if cluster.secure else ""
    rendered = template.substitute(
        inter_broker_listener=inter_broker,
        node_id=node.node_id,
        voters=",".join(f"{n.node_id}@{HOST}:{n.controller_port}" for n in cluster.nodes),
        listeners=",".join(f"{name}://{HOST}:{port}" for name, port in listeners.items()),
        advertised_listeners=",".join(
            f"{name}://{HOST}:{port}" for name, port in advertised.items()
        ),
        protocol_map=",".join(f"{name}:{protocol}" for name, protocol in protocols.items()),
        data_dir=node.data_dir,
        replication_factor=cluster.replication_factor,
        min_insync_replicas=min_insync_replicas(cluster.replication_factor),
    )
    return rendered + extra


def _format_storage(cluster: Cluster, nodes: Sequence[Node], java: str, classpath: str) -> None:
    """Format the nodes that have no storage yet, all with the cluster's one id, in parallel."""
    blank = [n for n in nodes if not (n.data_dir / "meta.properties").exists()]
    if not blank:
        return
    cluster_id = _existing_cluster_id(cluster) or _new_cluster_id()
    print(f"formatting storage of {len(blank)} node(s) in {cluster.state_dir}…", flush=True)
    scram_users: list[str] = []
    argfile = cluster.secure_files.directory / "format.args"
    if cluster.secure:  # the SCRAM users' passwords: in a private file, not on the command line
        secured.write_format_argfile(cluster.secure_files, argfile)
        scram_users = [f"@{argfile}"]
    try:
        # No log4j config here: log4j's default prints errors only, so stdout is the answer.
        runs = [
            (node, subprocess.Popen(
                [java, "-cp", classpath, "kafka.tools.StorageTool",
                 "format", "-t", cluster_id, "-c", str(node.config_file), *scram_users],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True,
            ))
            for node in blank
        ]  # fmt: skip
        for node, run in runs:
            output, _ = run.communicate()
            if run.returncode != 0:
                raise LauncherError(
                    f"kafka-storage format of node {node.node_id} failed "
                    f"(exit {run.returncode}):\n" + _tail(output)
                )
    finally:
        argfile.unlink(missing_ok=True)


def _existing_cluster_id(cluster: Cluster) -> str | None:
    for node in cluster.nodes:
        meta = _read(node.data_dir / "meta.properties")
        if found := re.search(r"^cluster\.id=(\S+)", meta, re.MULTILINE):
            return found.group(1)
    return None


def _new_cluster_id() -> str:
    """A Kafka cluster id (`kafka-storage random-uuid` without starting a JVM for it)."""
    while True:
        cluster_id = base64.urlsafe_b64encode(os.urandom(16)).decode().rstrip("=")
        if not cluster_id.startswith("-"):  # Kafka avoids these: they read as CLI flags
            return cluster_id


def _jvm_options(cluster: Cluster) -> tuple[str, ...]:
    if cluster.size == 1:
        return ("-Xmx768m", *JVM_OPTS)
    # Several JVMs start at once on a laptop: each gets a smaller heap, and the C1 JIT only,
    # which cuts the CPU a node burns to start (measured: ADR 0016) at some cost to
    # steady-state throughput that a local failure-testing cluster does not need.
    return ("-Xmx512m", "-XX:TieredStopAtLevel=1", *JVM_OPTS)


def _spawn(node: Node, java: str, classpath: str, jvm_options: Sequence[str]) -> int:
    if node.log_file.exists():
        # One previous log is kept for the start that follows a crash.
        node.log_file.replace(node.log_file.with_name("server.log.1"))
    with open(node.log_file, "ab") as log:
        process = subprocess.Popen(
            [java, *jvm_options, f"-Dlog4j2.configurationFile={LOG4J_CONFIG}",
             "-cp", classpath, "kafka.Kafka", str(node.config_file)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            cwd=node.state_dir,
            # Own session: Ctrl-C in the terminal that ran `start` must not reach it.
            start_new_session=True,
        )  # fmt: skip
    _spawned[process.pid] = process
    node.pid_file.write_text(f"{process.pid}\n")
    return process.pid


def _wait_until_ready(cluster: Cluster, pids: dict[int, int], deadline: float) -> None:
    """Wait until every running node serves metadata listing every running node.

    So a client that bootstraps from any node sees all of them, and a topic created next
    can be placed on as many replicas as there are nodes.
    """
    expected = frozenset(pids)
    waiting = dict(pids)
    while waiting:
        for node_id, pid in list(waiting.items()):
            node = cluster.node(node_id)
            if not _alive(pid):
                raise LauncherError(
                    f"Kafka node {node_id} (pid {pid}) exited during start; "
                    f"last lines of {node.log_file}:\n" + _tail(_read(node.log_file))
                )
            if _serves(cluster, node, expected):
                del waiting[node_id]
        if waiting and time.monotonic() > deadline:
            node = cluster.node(min(waiting))
            raise LauncherError(
                f"Kafka node {node.node_id} (pid {waiting[node.node_id]}) did not list nodes "
                f"{sorted(expected)} on {HOST}:{node.port} in time; "
                f"last lines of {node.log_file}:\n" + _tail(_read(node.log_file))
            )
        if waiting:
            time.sleep(0.2)


def _terminate(pid: int, timeout_s: float) -> bool:
    """SIGTERM, then SIGKILL after `timeout_s`; return whether it went on SIGTERM."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _alive(pid):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            while _alive(pid):
                time.sleep(0.05)
            return False
        time.sleep(0.1)
    return True


def _alive(pid: int) -> bool:
    if pid in _spawned:
        return _spawned[pid].poll() is None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """Whether `pid` has exited and only waits for its parent to reap it: a broker another
    process started (`tokenbus up`, a test's fixture) and this one stopped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False  # no /proc (not Linux): os.kill answered
    return stat[stat.rindex(")") + 2 :].startswith("Z")


def _is_our_broker(pid: int, node: Node) -> bool:
    """Guard against a recycled pid: the process must be Kafka run on this state dir."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except FileNotFoundError:
        return not Path("/proc/self").exists()  # No procfs (macOS): trust the pid.
    return b"kafka.Kafka" in cmdline and str(node.config_file).encode() in cmdline


def _recv_exact(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise ConnectionError("connection closed mid-response")
        data += chunk
    return data


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join("    " + line for line in text.rstrip().splitlines()[-lines:])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `start|stop|status` arguments, shared with `tokenbus kafka`."""
    parser.add_argument("action", choices=("start", "stop", "status"))
    parser.add_argument(
        "--port", type=int, default=None,
        help=f"first node's port; node i listens on PORT+2(i-1), its controller one above "
        f"(default: $TOKENBUS_KAFKA_PORT, the last one used, or {DEFAULT_PORT})",
    )  # fmt: skip
    parser.add_argument(
        "--state-dir", default=None,
        help=f"data, config, log and pid files "
        f"(default: $TOKENBUS_KAFKA_STATE_DIR or ./{DEFAULT_STATE_DIR})",
    )  # fmt: skip
    parser.add_argument(
        "--secure", action="store_true", default=None,
        help="clients on SASL_SSL (SCRAM-SHA-512, client certificates) with ACLs; CA, "
        "certificates and per-service logins under STATE_DIR/secure (default: as last run)",
    )  # fmt: skip
    parser.add_argument(
        "--nodes", type=int, default=None,
        help="nodes of the KRaft cluster, each a broker and a controller voter "
        "(default: $TOKENBUS_KAFKA_NODES, the number last used, or 1)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Carry out a parsed `start|stop|status`; the exit code follows `status` conventions."""
    try:
        cluster = Cluster.resolve(args.port, args.state_dir, args.nodes, args.secure)
        if args.action == "start":
            start(cluster)
            return 0
        if args.action == "stop":
            if not stop(cluster):
                print(f"not running (state dir {cluster.state_dir})", flush=True)
            return 0
        return _status(cluster)
    except LauncherError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1


def _status(cluster: Cluster) -> int:
    pids = running_pids(cluster)
    serving = {i: p for i, p in pids.items() if _serves(cluster, cluster.node(i), frozenset())}
    if len(serving) == cluster.size:
        print(f"running at {cluster.bootstrap_servers} ({_pid_list(serving)})")
        return 0
    if cluster.size > 1:
        for node in cluster.nodes:
            pid = pids.get(node.node_id)
            state = (
                "not running" if pid is None
                else "serving" if node.node_id in serving else "not answering"
            )  # fmt: skip
            print(f"  node {node.node_id} at {node.bootstrap_server}: {state}"
                  + (f" (pid {pid})" if pid else ""))  # fmt: skip
    state = "not answering" if pids else "not running"
    if pids and cluster.size > 1:
        state = f"{len(serving)} of {cluster.size} nodes serving"
    print(f"{state} (port {cluster.port}, state dir {cluster.state_dir})")
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.kafka.launcher",
        description=f"Local Apache Kafka {KAFKA_VERSION} (KRaft, 1 or more nodes) on the JVM.",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
