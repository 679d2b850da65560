"""Ports drawn for a test's processes: below the ephemeral range, one band per xdist worker."""

from __future__ import annotations

import itertools
import socket

from bench import ports


def test_each_xdist_worker_draws_from_its_own_band_below_the_ephemeral_range() -> None:
    top = ports.ephemeral_range()[0]
    bands = [
        ports.band({"PYTEST_XDIST_WORKER": f"gw{i}", "PYTEST_XDIST_WORKER_COUNT": "3"})
        for i in range(3)
    ]
    assert bands[0][0] == ports.LOWEST
    assert all(high <= top for _, high in bands)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(bands)), bands
    assert ports.band({}) == (ports.LOWEST, top)  # no xdist: the whole range
    assert ports.band({"PYTEST_XDIST_WORKER": "master"}) == (ports.LOWEST, top)


def test_a_port_is_free_in_this_workers_band_and_not_handed_out_twice() -> None:
    low, high = ports.band()
    drawn = [ports.free_port() for _ in range(50)] + [ports.free_port_run(4)]
    assert all(low <= port < high for port in drawn)
    assert len(set(drawn)) == len(drawn)
    run = drawn[-1]
    assert not set(range(run, run + 4)) & set(drawn[:-1])
    with socket.socket() as s:  # it is bindable as drawn
        s.bind(("127.0.0.1", drawn[0]))
