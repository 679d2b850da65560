"""`tokenbus trace`: where a request's time went, as a waterfall in the terminal.

`tokenbus trace <request_id>` prints the request's spans across all services (service, span,
start offset, duration, key attributes) and its stages; `tokenbus trace --slowest N` lists
the slowest recent requests. Spans come from the JSON-lines files of `tokenbus up`
(`TOKENBUS_TRACE_DIR`, default `.tokenbus/traces`) or from Jaeger (`--jaeger URL`).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
from pathlib import Path
from typing import TYPE_CHECKING

from shared.telemetry import DEFAULT_TRACE_DIR, TelemetrySettings
from tokenbus import waterfall
from tokenbus.trace_sources import JaegerSource, JsonLinesSource, SpanSource

if TYPE_CHECKING:
    from tokenbus.commands import Subcommands


def register(commands: Subcommands) -> None:
    parser = commands.add_parser(
        "trace",
        help="print a request's trace as a waterfall, or list the slowest requests",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("request_id", nargs="?", help="the request to show")
    parser.add_argument("--slowest", type=int, metavar="N", help="list the N slowest requests")
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help=f"span files directory (default: $TOKENBUS_TRACE_DIR or {DEFAULT_TRACE_DIR})",
    )
    parser.add_argument(
        "--jaeger",
        metavar="URL",
        help="read from Jaeger's query API v3, e.g. http://localhost:16686",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.set_defaults(handler=_trace)


def _source(args: argparse.Namespace) -> SpanSource:
    if args.jaeger:
        return JaegerSource(args.jaeger)
    directory = args.dir or TelemetrySettings().trace_dir or DEFAULT_TRACE_DIR
    return JsonLinesSource(directory)


def _trace(args: argparse.Namespace) -> int:
    if (args.request_id is None) == (args.slowest is None):
        print("tokenbus trace: give a request_id or --slowest N", file=sys.stderr)
        return 2
    source = _source(args)
    try:
        if args.slowest is not None:
            return _print_slowest(source, args.slowest, args.json)
        return _print_request(source, args.request_id, args.json)
    except (urllib.error.URLError, OSError) as exc:
        print(f"tokenbus trace: cannot read spans: {exc}", file=sys.stderr)
        return 1


def _print_request(source: SpanSource, request_id: str, as_json: bool) -> int:
    found = waterfall.build(request_id, source.request_spans(request_id))
    if found is None:
        print(f"tokenbus trace: no spans name request {request_id}", file=sys.stderr)
        return 1
    print(json.dumps(found.as_json(), indent=2) if as_json else waterfall.render(found))
    return 0


def _print_slowest(source: SpanSource, n: int, as_json: bool) -> int:
    rows = waterfall.slowest(source.recent_spans(max(n * 20, 200)), n)
    if as_json:
        print(json.dumps([r.__dict__ for r in rows], indent=2))
    else:
        print(waterfall.render_slowest(rows))
    return 0
