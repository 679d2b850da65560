"""Structured logging setup: one event name per line, key=value context (or JSON)."""

from __future__ import annotations

import logging
import sys

import structlog

from shared.settings import LogFormat
from shared.telemetry import add_trace_ids


def configure_logging(
    service: str, level: str = "INFO", log_format: LogFormat = "console"
) -> structlog.stdlib.BoundLogger:
    """`console` renders `timestamp=… level=… event=… key=value…` (what people and tests
    grep); `json` one object per line with the same keys, for a log pipeline."""
    logging.basicConfig(stream=sys.stderr, level=level.upper(), format="%(message)s")
    # aiokafka is chatty at INFO; keep its warnings, and its group coordinator's joins,
    # syncs and assignments: a rebalance that never ends is otherwise silent.
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    logging.getLogger("aiokafka.consumer.group_coordinator").setLevel(logging.INFO)
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer(default=repr)
        if log_format == "json"
        else structlog.processors.KeyValueRenderer(
            key_order=["timestamp", "level", "event"], sort_keys=False
        )
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_trace_ids,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)
    log: structlog.stdlib.BoundLogger = structlog.get_logger()
    return log
