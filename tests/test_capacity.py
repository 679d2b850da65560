"""docs/capacity.md's tables are what deploy/capacity.py computes from its inputs."""

from __future__ import annotations

import itertools

from deploy.capacity import FIGURES, GPUS, WORKLOAD, plan, with_tables
from tests.stack import ROOT


def test_the_capacity_tables_are_current() -> None:
    doc = (ROOT / "docs" / "capacity.md").read_text()
    assert doc == with_tables(doc), (
        "docs/capacity.md is stale: run `python -m deploy.capacity --update docs/capacity.md`"
    )


def test_more_gpus_never_need_less() -> None:
    for cpu in FIGURES:
        plans = [plan(g, cpu) for g in GPUS]
        for small, big in itertools.pairwise(plans):
            assert big.requests_s > small.requests_s
            for field in ("edges", "ingest", "schedulers", "brokers"):
                assert getattr(big, field) >= getattr(small, field), (cpu.label, field)
            assert big.partitions["results"] >= big.edges
            assert big.partitions["requests"] >= big.ingest
            assert big.partitions["requests.<tier>"] >= big.schedulers


def test_a_cheaper_service_needs_fewer_replicas() -> None:
    measured, target = FIGURES
    assert plan(64, target).edges < plan(64, measured).edges
    assert WORKLOAD.replication == 3
