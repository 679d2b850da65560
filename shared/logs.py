"""Structured logging setup: one event name per line, key=value context."""

from __future__ import annotations

import logging
import sys

import structlog

from shared.telemetry import add_trace_ids


def configure_logging(service: str, level: str = "INFO") -> structlog.stdlib.BoundLogger:
    logging.basicConfig(stream=sys.stderr, level=level.upper(), format="%(message)s")
    # aiokafka is chatty at INFO about group joins; keep its warnings.
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_trace_ids,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.KeyValueRenderer(
                key_order=["timestamp", "level", "event"], sort_keys=False
            ),
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
