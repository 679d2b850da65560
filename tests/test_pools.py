"""`tokenbus up --workers`: the pools parsed, each worker with its model, the services told."""

from __future__ import annotations

import argparse

import pytest

from deploy.kafka import launcher
from tokenbus.pools import PoolWorker, parse_pools, pool_workers, served_models_env
from tokenbus.up import Deployment, UpSettings


def test_pools_parse_in_order() -> None:
    assert parse_pools("big=2, small=1") == {"big": 2, "small": 1}
    assert parse_pools("org/model:q4=1") == {"org/model:q4": 1}


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("big", "expected MODEL=N"),
        ("=2", "expected MODEL=N"),
        ("big=0", "a whole number from 1 to 32"),
        ("big=two", "a whole number from 1 to 32"),
        ("big=33", "a whole number from 1 to 32"),
        ("big=1,big=2", "model big is named twice"),
        ("big=1,", "expected MODEL=N"),
    ],
)
def test_a_bad_pool_says_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=says):
        parse_pools(text)


def test_each_pool_worker_has_its_model() -> None:
    assert pool_workers({"big": 2, "small": 1}) == [
        PoolWorker("worker-big-1", "big", 1),
        PoolWorker("worker-big-2", "big", 2),
        PoolWorker("worker-small-1", "small", 1),
    ]
    assert served_models_env({"big": 2, "small": 1}) == {
        "TOKENBUS_SERVED_MODELS": '["big", "small"]'
    }


def test_up_runs_each_pool_worker_with_its_model_on_a_port_of_its_own() -> None:
    cluster = launcher.Cluster.resolve(None, nodes=1)
    deployment = Deployment(UpSettings(), cluster, pools={"big": 2, "small": 1})
    services = deployment.services
    expected = ["ingest", "scheduler", "worker-big-1", "worker-big-2", "worker-small-1", "edge"]
    assert list(services) == expected
    workers = [s for s in services.values() if s.module == "worker"]
    assert [s.env["TOKENBUS_WORKER_MODEL"] for s in workers] == ["big", "big", "small"]
    # The first keeps the worker's default health port; the others each get a port.
    ports = [s.env.get("TOKENBUS_METRICS_PORT") for s in workers]
    assert ports[0] is None
    assert None not in ports[1:]
    assert len(set(ports)) == 3
    plain = Deployment(UpSettings(), cluster)
    assert [s.module for s in plain.services.values()] == ["ingest", "scheduler", "worker", "edge"]
