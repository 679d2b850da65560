"""Issue 37 (Low): label values read from requests are bounded.

The scheduler labelled its metrics with each request's model and variant as written: a
client naming a new model per request (ingest does not ask whether a worker serves it) made
a new time series each time, kept for ever by the process and every scraper. Now the first
64 values of each label are shown and the rest read as `other`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from services.scheduler.telemetry import SchedulerTelemetry
from shared.messages import Tier
from shared.metrics import OTHER, LabelValues, SchedulerMetrics


def series(registry: CollectorRegistry, name: str) -> set[tuple[tuple[str, str], ...]]:
    return {
        tuple(sorted(sample.labels.items()))
        for metric in registry.collect()
        for sample in metric.samples
        if sample.name.startswith(name)
    }


def test_a_model_per_request_does_not_grow_the_series_without_bound() -> None:
    registry = CollectorRegistry()
    telemetry = SchedulerTelemetry(
        topic="t.batches",
        max_batch_size={t: 8 for t in Tier},
        metrics=SchedulerMetrics.build(registry),
    )
    for i in range(1000):
        telemetry.variant_chosen(f"model-{i}", f"variant-{i}")
        telemetry.waiting_by_model({f"model-{i}": 1, None: 2})
    requests = series(registry, "tokenbus_scheduler_variant_requests_total")
    models = {dict(labels)["model"] for labels in requests}
    assert len(models) <= 64 + 1, len(models)
    assert OTHER in models
    depth = series(registry, "tokenbus_scheduler_model_queue_depth")
    assert len(depth) <= 64 + 1, len(depth)


def test_the_first_values_are_kept_as_they_are() -> None:
    label = LabelValues(limit=2)
    assert [label(v) for v in ("a", "b", "c", "a", "d", "b")] == ["a", "b", OTHER, "a", OTHER, "b"]
