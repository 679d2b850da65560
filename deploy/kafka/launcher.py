"""Run a single-node Apache Kafka (KRaft) from Maven Central on the local JVM, without Docker."""

# Stdlib only: this runs before any virtual environment exists (CI, `make test`), and it
# is the one place that knows how the broker is laid out on disk.

from __future__ import annotations

import argparse
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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

KAFKA_VERSION = "4.1.1"
HOST = "127.0.0.1"
DEFAULT_PORT = 9092
DEFAULT_STATE_DIR = ".tokenbus/kafka"
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0

_HERE = Path(__file__).resolve().parent
POM = _HERE / "pom.xml"
SERVER_TEMPLATE = _HERE / "server.properties"
LOG4J_CONFIG = _HERE / "log4j2.properties"
# One broker for a laptop or CI runner: a bounded heap and short GC pauses matter more
# than throughput.
JVM_OPTS = (
    "-Xms128m",
    "-Xmx768m",
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


class LauncherError(Exception):
    """A start or stop that cannot go on; the message says what to do about it."""


@dataclass(frozen=True)
class Broker:
    """Where one local broker listens and keeps its files."""

    port: int
    state_dir: Path

    @classmethod
    def resolve(cls, port: int | None = None, state_dir: str | Path | None = None) -> Broker:
        """Fill what the caller left out: argument, then environment, then defaults.

        The port also falls back to the one this state dir last ran with, so `stop` and
        `status` find a broker started with `--port` without being told again.
        """
        directory = Path(
            state_dir or os.environ.get("TOKENBUS_KAFKA_STATE_DIR") or DEFAULT_STATE_DIR
        ).resolve()
        if port is None:
            env_port = os.environ.get("TOKENBUS_KAFKA_PORT")
            port = int(env_port) if env_port else _recorded_port(directory) or DEFAULT_PORT
        return cls(port=port, state_dir=directory)

    @property
    def controller_port(self) -> int:
        return self.port + 1

    @property
    def bootstrap_servers(self) -> str:
        return f"{HOST}:{self.port}"

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


# Brokers this process started: held so they can be reaped (no zombie that `kill -0`
# would call alive) when `tokenbus up` starts and stops a broker in one process.
_spawned: dict[int, subprocess.Popen[bytes]] = {}


def start(broker: Broker, timeout_s: float = START_TIMEOUT_S) -> tuple[int, bool]:
    """Start the broker unless it already runs; return its pid and whether this call started it."""
    broker.state_dir.mkdir(parents=True, exist_ok=True)
    with _locked(broker):
        pid = running_pid(broker)
        if pid is not None:
            running_port = _recorded_port(broker.state_dir)
            if running_port != broker.port:
                raise LauncherError(
                    f"the broker of {broker.state_dir} already runs on port {running_port} "
                    f"(pid {pid}); stop it first to move it to {broker.port}"
                )
            _wait_until_ready(broker, pid, time.monotonic() + timeout_s)
            print(f"already running at {broker.bootstrap_servers} (pid {pid})", flush=True)
            return pid, False
        _check_ports_free(broker)
        java = _find_tool("java", "a Java 17+ runtime (apt-get install default-jre-headless)")
        classpath = resolve_classpath()
        _render_config(broker)
        _format_storage(broker, java, classpath)
        began = time.monotonic()
        pid = _spawn(broker, java, classpath)
        try:
            _wait_until_ready(broker, pid, began + timeout_s)
        except LauncherError:
            _terminate(pid, timeout_s=5.0)
            broker.pid_file.unlink(missing_ok=True)
            raise
        elapsed = time.monotonic() - began
        print(f"broker up at {broker.bootstrap_servers} in {elapsed:.1f} s (pid {pid})", flush=True)
        return pid, True


def stop(broker: Broker, timeout_s: float = STOP_TIMEOUT_S) -> bool:
    """Stop the broker (SIGTERM, SIGKILL after `timeout_s`); return whether one was running."""
    if not broker.state_dir.is_dir():
        return False
    with _locked(broker):
        pid = running_pid(broker)
        if pid is None:
            return False
        began = time.monotonic()
        print(f"stopping Kafka (pid {pid})…", flush=True)
        if not _terminate(pid, timeout_s):
            print(f"Kafka ignored SIGTERM for {timeout_s:.0f} s; killed it", flush=True)
        broker.pid_file.unlink(missing_ok=True)
        print(f"stopped in {time.monotonic() - began:.1f} s", flush=True)
        return True


def running_pid(broker: Broker) -> int | None:
    """The pid of this state dir's broker if it is alive; clears a stale pid file."""
    try:
        pid = int(broker.pid_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    if _alive(pid) and _is_our_broker(pid, broker):
        return pid
    broker.pid_file.unlink(missing_ok=True)
    return None


def answers(port: int, timeout_s: float = 2.0) -> bool:
    """Whether a Kafka broker on `port` serves metadata that lists at least one broker.

    A TCP connect is not enough: the socket opens before the broker has registered with
    the controller, and clients that connect then get no brokers to talk to.
    """
    header = struct.pack(">hhih", _METADATA_API_KEY, _METADATA_VERSION, 1, len(_CLIENT_ID))
    # topics = null (all topics), allow_auto_topic_creation = false
    request = header + _CLIENT_ID + struct.pack(">i?", -1, False)
    try:
        with socket.create_connection((HOST, port), timeout=timeout_s) as sock:
            sock.sendall(struct.pack(">i", len(request)) + request)
            (size,) = struct.unpack(">i", _recv_exact(sock, 4))
            response = _recv_exact(sock, min(size, 12))
    except OSError:
        return False
    if len(response) < 12:
        return False
    fields: tuple[int, int, int] = struct.unpack(">iii", response)
    correlation_id, _throttle_ms, broker_count = fields
    return correlation_id == 1 and broker_count >= 1


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


def _recorded_port(state_dir: Path) -> int | None:
    try:
        config = (state_dir / "server.properties").read_text()
    except FileNotFoundError:
        return None
    found = re.search(r"^listeners=PLAINTEXT://[^:]+:(\d+)", config, re.MULTILINE)
    return int(found.group(1)) if found else None


@contextlib.contextmanager
def _locked(broker: Broker) -> Iterator[None]:
    """Serialise start/stop on one state dir, so two racing starts launch one broker."""
    with open(broker.state_dir / "launcher.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _check_ports_free(broker: Broker) -> None:
    for port in (broker.port, broker.controller_port):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            # SO_REUSEADDR as the JVM sets it: a port in TIME_WAIT after a stop is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((HOST, port))
            except OSError as exc:
                raise LauncherError(
                    f"port {HOST}:{port} is in use by another process ({exc.strerror}); "
                    f"the broker needs {broker.port} and {broker.controller_port}: "
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


def _render_config(broker: Broker) -> None:
    template = string.Template(SERVER_TEMPLATE.read_text())
    broker.config_file.write_text(
        template.substitute(
            port=broker.port, controller_port=broker.controller_port, data_dir=broker.data_dir
        )
    )


def _format_storage(broker: Broker, java: str, classpath: str) -> None:
    if (broker.data_dir / "meta.properties").exists():
        return
    print(f"formatting storage in {broker.data_dir}…", flush=True)
    cluster_id = _run_tool(java, classpath, "random-uuid").strip()
    _run_tool(java, classpath, "format", "-t", cluster_id, "-c", str(broker.config_file))


def _run_tool(java: str, classpath: str, *args: str) -> str:
    # No log4j config here: log4j's default prints errors only, so stdout is the answer.
    result = subprocess.run(
        [java, "-cp", classpath, "kafka.tools.StorageTool", *args],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise LauncherError(
            f"kafka-storage {args[0]} failed (exit {result.returncode}):\n"
            + _tail(result.stdout + result.stderr)
        )
    return result.stdout


def _spawn(broker: Broker, java: str, classpath: str) -> int:
    if broker.log_file.exists():
        # One previous log is kept for the start that follows a crash.
        broker.log_file.replace(broker.log_file.with_name("server.log.1"))
    with open(broker.log_file, "ab") as log:
        process = subprocess.Popen(
            [java, *JVM_OPTS, f"-Dlog4j2.configurationFile={LOG4J_CONFIG}",
             "-cp", classpath, "kafka.Kafka", str(broker.config_file)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            cwd=broker.state_dir,
            # Own session: Ctrl-C in the terminal that ran `start` must not reach it.
            start_new_session=True,
        )  # fmt: skip
    _spawned[process.pid] = process
    broker.pid_file.write_text(f"{process.pid}\n")
    return process.pid


def _wait_until_ready(broker: Broker, pid: int, deadline: float) -> None:
    while not answers(broker.port):
        if not _alive(pid):
            raise LauncherError(
                f"Kafka (pid {pid}) exited during start; last lines of {broker.log_file}:\n"
                + _tail(_read(broker.log_file))
            )
        if time.monotonic() > deadline:
            raise LauncherError(
                f"Kafka (pid {pid}) did not answer on {broker.bootstrap_servers} in time; "
                f"last lines of {broker.log_file}:\n" + _tail(_read(broker.log_file))
            )
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
    return True


def _is_our_broker(pid: int, broker: Broker) -> bool:
    """Guard against a recycled pid: the process must be Kafka run on this state dir."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except FileNotFoundError:
        return not Path("/proc/self").exists()  # No procfs (macOS): trust the pid.
    return b"kafka.Kafka" in cmdline and str(broker.config_file).encode() in cmdline


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
        help=f"broker port; the controller uses PORT+1 "
        f"(default: $TOKENBUS_KAFKA_PORT, the last one used, or {DEFAULT_PORT})",
    )  # fmt: skip
    parser.add_argument(
        "--state-dir", default=None,
        help=f"data, config, log and pid file "
        f"(default: $TOKENBUS_KAFKA_STATE_DIR or ./{DEFAULT_STATE_DIR})",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Carry out a parsed `start|stop|status`; the exit code follows `status` conventions."""
    broker = Broker.resolve(args.port, args.state_dir)
    try:
        if args.action == "start":
            start(broker)
            return 0
        if args.action == "stop":
            if not stop(broker):
                print(f"not running (state dir {broker.state_dir})", flush=True)
            return 0
        pid = running_pid(broker)
        if pid is not None and answers(broker.port):
            print(f"running at {broker.bootstrap_servers} (pid {pid})")
            return 0
        state = "not answering" if pid is not None else "not running"
        print(f"{state} (port {broker.port}, state dir {broker.state_dir})")
        return 1
    except LauncherError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.kafka.launcher",
        description=f"Local single-node Apache Kafka {KAFKA_VERSION} (KRaft) on the JVM.",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
