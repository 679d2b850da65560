"""Network faults between Kafka clients and one broker node: a Toxiproxy server and its API.

A proxied cluster (`launcher.Cluster(proxied=True)`) tells clients to reach node i at its
`client_port`; `Toxiproxy.start(cluster)` listens there and forwards to the node's own
`port`. The brokers replicate and vote on listeners of their own, so a toxic on node i's
proxy reaches the clients' traffic to node i only, as a fault between the services and one
broker would. The server is the Go program `deploy/tools/build.sh` builds and caches.

Each fault method applies to one node's proxy and, unless told otherwise, to both
directions (`upstream`: client to broker, `downstream`: broker to client). Calling one
again replaces that fault's attributes; `clear(node)` removes every fault of the node.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

from pydantic import BaseModel

from deploy.kafka import launcher
from tests.built_tools import ToolNotBuilt, built
from tests.processes import free_port_run

START_TIMEOUT_S = 10.0
API_TIMEOUT_S = 5.0
# Adding or removing a toxic waits, under the proxy's lock, until every connection's toxic
# goroutine takes the change; one blocked writing to a peer that reads slowly (a 32 KB/s
# bandwidth toxic draining a big fetch answer) holds it for tens of seconds. The server
# finishes the change whatever the client does, so the client waits it out (chaos seed
# 294815970: a 5 s DELETE of `bandwidth_downstream` timed out and ended the run).
CHANGE_TIMEOUT_S = 120.0

Stream = Literal["upstream", "downstream"]
Direction = Literal["upstream", "downstream", "both"]
ToxicType = Literal["latency", "bandwidth", "timeout", "reset_peer", "slow_close"]


class ToxiproxyError(Exception):
    """Toxiproxy is missing, did not start, or refused a call; the message says which."""


class Toxic(BaseModel):
    """One active toxic of a proxy, as the API lists it."""

    name: str
    type: str
    stream: Stream
    toxicity: float
    attributes: dict[str, int]


def server_binary() -> Path:
    """The Toxiproxy server `deploy/tools/build.sh` builds, waiting for its build if one is
    under way (`make test` builds it first, in the background: about 25 s cold)."""
    try:
        return built("toxiproxy")
    except ToolNotBuilt as exc:
        raise ToxiproxyError(f"the Toxiproxy server: {exc}") from exc


@dataclass(frozen=True)
class _Link:
    """One node's proxy: clients connect to `listen`, the proxy forwards to `upstream`."""

    name: str
    listen: str
    upstream: str


def _links(cluster: launcher.Cluster) -> dict[int, _Link]:
    if not cluster.proxied:
        raise ToxiproxyError(
            "the cluster is not proxied: resolve it with proxied=True, so its nodes tell "
            "clients to connect through the proxies"
        )
    return {
        n.node_id: _Link(
            name=f"kafka-{n.node_id}",
            listen=f"{launcher.HOST}:{n.client_port}",
            upstream=f"{launcher.HOST}:{n.port}",
        )
        for n in cluster.nodes
    }


class Toxiproxy:
    """A running Toxiproxy server with one proxy per node of a proxied cluster.

    Owns the server process: `stop()` (or leaving the `with` block) ends it, and with it
    every proxied connection.
    """

    def __init__(self, process: subprocess.Popen[bytes], api: str, links: Mapping[int, _Link]):
        self._process = process
        self._api = api
        self._links = dict(links)

    @classmethod
    def start(
        cls, cluster: launcher.Cluster, log_file: Path | None = None, binary: Path | None = None
    ) -> Toxiproxy:
        """Start a server on a free API port and create one proxy per node of `cluster`.

        The proxies may start before or after the cluster: a proxy connects to its node
        only when a client connects to it. The server's log goes to `log_file` if given.
        """
        links = _links(cluster)
        api_port = free_port_run(1)
        log = open(log_file, "ab") if log_file else None  # noqa: SIM115 - closed below
        try:
            process = subprocess.Popen(
                [str(binary or server_binary()), "-host", launcher.HOST, "-port", str(api_port)],
                stdin=subprocess.DEVNULL,
                stdout=log or subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
        finally:
            if log:
                log.close()  # the child holds its own descriptor
        proxy = cls(process, f"http://{launcher.HOST}:{api_port}", links)
        try:
            proxy._wait_until_serving(time.monotonic() + START_TIMEOUT_S)
            for link in links.values():
                proxy._call(
                    "POST",
                    "/proxies",
                    {"name": link.name, "listen": link.listen, "upstream": link.upstream},
                )
        except BaseException:
            proxy.stop()
            raise
        return proxy

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    # Faults: each applies to node `node`'s proxy, replacing the same fault played before.

    def latency(
        self,
        node: int,
        ms: int = 100,
        jitter_ms: int = 0,
        direction: Direction = "both",
        toxicity: float = 1.0,
    ) -> None:
        """Delay data by `ms` ± `jitter_ms` in each direction chosen: with "both" a request
        and its answer wait about twice `ms` in all."""
        _check_at_least(0, ms=ms, jitter_ms=jitter_ms)
        self._add(node, "latency", direction, toxicity, latency=ms, jitter=jitter_ms)

    def bandwidth(
        self, node: int, kb_per_s: int, direction: Direction = "both", toxicity: float = 1.0
    ) -> None:
        """Limit each connection to `kb_per_s` kilobytes per second in each direction chosen."""
        _check_at_least(0, kb_per_s=kb_per_s)
        self._add(node, "bandwidth", direction, toxicity, rate=kb_per_s)

    def black_hole(self, node: int, direction: Direction = "both", toxicity: float = 1.0) -> None:
        """Drop every byte, keeping connections open (the `timeout` toxic with timeout 0),
        as a partitioned or hung node looks to its clients. New connections still open: the
        proxy accepts them. Dropped data is lost, and `clear` closes the connections it held.
        """
        self._add(node, "timeout", direction, toxicity, timeout=0)

    def reset_peer(
        self, node: int, after_ms: int = 0, direction: Direction = "both", toxicity: float = 1.0
    ) -> None:
        """Reset (TCP RST) each connection `after_ms` after data next flows on it, new
        connections included, until cleared."""
        _check_at_least(0, after_ms=after_ms)
        self._add(node, "reset_peer", direction, toxicity, timeout=after_ms)

    def slow_close(
        self, node: int, delay_ms: int, direction: Direction = "both", toxicity: float = 1.0
    ) -> None:
        """Hold each connection's close for `delay_ms` once either side closes it."""
        _check_at_least(0, delay_ms=delay_ms)
        self._add(node, "slow_close", direction, toxicity, delay=delay_ms)

    def clear(self, node: int) -> None:
        """Remove every toxic of `node`'s proxy: its traffic flows freely again."""
        link = self._link(node)
        for toxic in self.toxics(node):
            self._call(
                "DELETE", f"/proxies/{link.name}/toxics/{toxic.name}", timeout_s=CHANGE_TIMEOUT_S
            )

    def clear_all(self) -> None:
        """Remove every toxic of every proxy."""
        for node in self._links:
            self.clear(node)

    def toxics(self, node: int) -> list[Toxic]:
        """The toxics active on `node`'s proxy."""
        listed = self._call("GET", f"/proxies/{self._link(node).name}/toxics")
        if not isinstance(listed, list):
            raise ToxiproxyError(f"Toxiproxy listed toxics as {listed!r}, not a list")
        return [Toxic.model_validate(t) for t in listed]

    def stop(self) -> None:
        """End the server (SIGTERM, SIGKILL after 5 s) and every connection it proxied."""
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    # The HTTP API.

    def _add(
        self,
        node: int,
        kind: ToxicType,
        direction: Direction,
        toxicity: float,
        **attributes: int,
    ) -> None:
        if not 0.0 <= toxicity <= 1.0:
            raise ValueError(f"toxicity is a probability from 0 to 1, not {toxicity}")
        link = self._link(node)
        for stream in _streams(direction):
            toxic = {
                "name": f"{kind}_{stream}",
                "type": kind,
                "stream": stream,
                "toxicity": toxicity,
                "attributes": attributes,
            }
            try:
                self._call(
                    "POST", f"/proxies/{link.name}/toxics", toxic, timeout_s=CHANGE_TIMEOUT_S
                )
            except _Conflict:  # played before: the same toxic with new attributes
                self._call(
                    "POST",
                    f"/proxies/{link.name}/toxics/{toxic['name']}",
                    toxic,
                    timeout_s=CHANGE_TIMEOUT_S,
                )

    def _link(self, node: int) -> _Link:
        if node not in self._links:
            raise ValueError(f"no proxy for node {node}: the nodes are {sorted(self._links)}")
        return self._links[node]

    def _call(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        timeout_s: float = API_TIMEOUT_S,
    ) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self._api + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace").strip()
            if exc.code == 409:
                raise _Conflict(detail) from exc
            raise ToxiproxyError(f"Toxiproxy refused {method} {path}: {exc.code} {detail}") from exc
        except OSError as exc:
            raise ToxiproxyError(f"Toxiproxy did not answer {method} {path}: {exc}") from exc
        return json.loads(text) if text.strip() else None

    def _wait_until_serving(self, deadline: float) -> None:
        while True:
            if (code := self._process.poll()) is not None:
                raise ToxiproxyError(f"the Toxiproxy server exited during start (exit {code})")
            with contextlib.suppress(ToxiproxyError):
                self._call("GET", "/version")
                return
            if time.monotonic() > deadline:
                raise ToxiproxyError(f"the Toxiproxy server did not answer at {self._api} in time")
            time.sleep(0.05)


class _Conflict(ToxiproxyError):
    """The API's 409: a toxic of that name exists already."""


def _streams(direction: Direction) -> Iterator[Stream]:
    if direction not in ("upstream", "downstream", "both"):
        raise ValueError(f"direction is upstream, downstream or both, not {direction!r}")
    if direction in ("upstream", "both"):
        yield "upstream"
    if direction in ("downstream", "both"):
        yield "downstream"


def _check_at_least(low: int, **values: int) -> None:
    for name, value in values.items():
        if value < low:
            raise ValueError(f"{name} must be at least {low}, not {value}")


@dataclass(frozen=True)
class ProxiedCluster:
    """A proxied three-node cluster with its Toxiproxy server: the session's one
    (`three_nodes` in tests/conftest.py), which the cluster, Toxiproxy and chaos modules
    share."""

    cluster: launcher.Cluster
    proxy: Toxiproxy

    def whole(self) -> ProxiedCluster:
        """Every node running and no toxic left, whatever an earlier test did to it."""
        self.proxy.clear_all()
        for node in self.cluster.nodes:
            pid = launcher.running_pid(node)
            if pid is not None:
                os.kill(pid, signal.SIGCONT)  # a hang a failed test left behind
        launcher.start(self.cluster)
        return self
