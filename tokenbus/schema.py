"""`tokenbus schema`: the Kafka contract, generated from the pydantic models.

Writes JSON Schema of the records a producer or consumer outside tokenbus meets
(`docs/schema/request.json`, `result.json`, `control.json`) and an AsyncAPI 3 document of
every topic (`docs/asyncapi.yaml`): its key, headers, payload, and which service sends or
receives it. `--check` fails when the checked-in files differ from what the models say.

`--release`, at each release: a copy of those files and a corpus of every kind of record,
written by this release with every feature on (tokenbus/corpus.py), under
`docs/schema/released/`; the next release's contract check (tests/test_contract_compat.py)
holds its own contract and records to them (ADR 0072).
"""

from __future__ import annotations

import argparse
import json
import subprocess
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import TypeAdapter
from pydantic.json_schema import JsonSchemaMode

from services.edge.leases import LeaseRecord
from shared.batch_jobs import BatchCancel, BatchJob, LineOutcome
from shared.dead_letters import HEADERS as DEAD_LETTER_HEADERS
from shared.dead_letters import REQUIRED as DEAD_LETTER_REQUIRED
from shared.files import StoredFile
from shared.messages import (
    LEAVING_HEADER,
    Batch,
    CacheEntry,
    ControlRecord,
    Heartbeat,
    QueuedRequest,
    RequestRecord,
    ResultRecord,
    Tier,
)
from shared.shadows import ShadowScore
from shared.telemetry import SENT_AT_HEADER
from shared.topics import Topics
from shared.variants import ModelRollout
from shared.verdicts import ModelVerdicts
from tokenbus import corpus

if TYPE_CHECKING:
    from tokenbus.commands import Subcommands

DEFAULT_OUT = Path("docs")
# Under the docs directory: the previous release's contract and records (`--release`).
RELEASED = Path("schema") / "released"
KAFKA_BINDING = "0.5.0"
TRACE_HEADERS = {
    "traceparent": "W3C trace context: the span this record continues (optional for "
    "external producers; tokenbus starts a trace when it is absent).",
    "tracestate": "W3C trace state, passed on unchanged (optional).",
}
# "operator": a person or script running the `tokenbus` command (`tokenbus models rollout`).
Service = Literal[
    "edge", "ingest", "scheduler", "worker", "external producer", "external app", "operator"
]


@dataclass(frozen=True)
class Message:
    """One kind of record: its payload model, key and headers."""

    name: str
    title: str
    summary: str
    payload: str  # a component schema name (`SCHEMAS`)
    key: str  # what the record key holds
    headers: dict[str, str] = field(default_factory=lambda: dict(TRACE_HEADERS))
    required_headers: frozenset[str] = frozenset()  # on every record of the kind


@dataclass(frozen=True)
class Channel:
    """One topic (or a family of topics named by a parameter)."""

    name: str
    address: str | None
    description: str
    messages: tuple[Message, ...]
    sends: tuple[Service, ...]
    receives: tuple[Service, ...]
    partitions: int | None = None
    parameters: dict[str, str] = field(default_factory=dict)
    groups: dict[str, str] = field(default_factory=dict)  # receiving service -> consumer group


# The three files under docs/schema/: what tokenbus accepts (validation mode, defaults
# optional) and what it writes (serialization mode, every field present).
JSON_SCHEMAS: dict[str, tuple[Any, JsonSchemaMode, str]] = {
    "request": (
        RequestRecord,
        "validation",
        "A request record on tokenbus.requests, as the edge or an external producer writes it.",
    ),
    "result": (
        ResultRecord,
        "serialization",
        "A result record on a request's reply_to topic (delta, done, error or reset).",
    ),
    "control": (
        ControlRecord,
        "serialization",
        "A record on tokenbus.control: a cancel, or a stream resumed on another edge.",
    ),
}

# Component schemas of the AsyncAPI document: name -> (type, mode).
SCHEMAS: dict[str, tuple[Any, JsonSchemaMode]] = {
    "RequestRecord": (RequestRecord, "validation"),
    "QueuedRequest": (QueuedRequest, "serialization"),
    "Batch": (Batch, "serialization"),
    "ResultRecord": (ResultRecord, "serialization"),
    "ControlRecord": (ControlRecord, "serialization"),
    "Heartbeat": (Heartbeat, "serialization"),
    "LeaseRecord": (LeaseRecord, "serialization"),
    "CacheEntry": (CacheEntry, "serialization"),
    "ModelRollout": (ModelRollout, "serialization"),
    "ShadowScore": (ShadowScore, "serialization"),
    "ModelVerdicts": (ModelVerdicts, "serialization"),
    "StoredFile": (StoredFile, "serialization"),
    "BatchJob": (BatchJob, "serialization"),
    "BatchCancel": (BatchCancel, "serialization"),
    "LineOutcome": (LineOutcome, "serialization"),
}

REQUEST = Message(
    "request",
    "Chat request",
    "A chat request to admit, classify and run.",
    "RequestRecord",
    "request_id (UTF-8).",
)
QUEUED = Message(
    "queuedRequest",
    "Admitted request",
    "A validated request with its tier, token estimate and attempt.",
    "QueuedRequest",
    "request_id (UTF-8).",
)
DEAD_LETTER = Message(
    "deadLetter",
    "Dead letter",
    "A record nobody could handle, copied as read (its bytes need not be JSON; a copy over"
    " 1 MB is truncated). Ingest, the scheduler and the workers write one header set"
    " (shared/dead_letters.py): the required ones on every letter, the others when they apply.",
    "DeadLetter",
    "The key of the record as read (absent if it had none or it was over 1 KiB).",
    headers=DEAD_LETTER_HEADERS,
    required_headers=DEAD_LETTER_REQUIRED,
)
BATCH = Message(
    "batch",
    "Batch",
    "Requests that ride together, addressed to one worker by partition.",
    "Batch",
    "batch_id (UTF-8).",
)
RESULT = Message(
    "result",
    "Result",
    "One step of a request's result stream: delta, done, error, or reset (a new attempt).",
    "ResultRecord",
    "request_id (UTF-8).",
    headers={
        **TRACE_HEADERS,
        SENT_AT_HEADER: "On a request's final record: when the worker wrote it (Unix seconds).",
    },
)
CONTROL = Message(
    "control",
    "Control",
    "A cancel (workers stop the request and free its slot) or a resumed stream (edges).",
    "ControlRecord",
    "request_id (UTF-8).",
    headers={},
)
HEARTBEAT = Message(
    "heartbeat",
    "Heartbeat",
    "What a worker can take now, and what it holds.",
    "Heartbeat",
    "worker_id (UTF-8).",
    headers={
        LEAVING_HEADER: "On a drained worker's last heartbeat: `1`. It has handed back what it"
        " held and exits: schedulers take it as gone at once, not as dead after its silence.",
    },
)
LEASE = Message(
    "lease",
    "Results-partition lease",
    "An edge claims, renews or releases a partition of the shared results topic.",
    "LeaseRecord",
    "The leased partition number, as text.",
    headers={},
)
CACHE_ENTRY = Message(
    "cacheEntry",
    "Cached answer",
    "A complete deterministic answer (temperature 0 or a seed), stored by the worker that"
    " answered it; ingest replays it to a later request with the same key, marked `cached`.",
    "CacheEntry",
    "The cache key: SHA-256 (hex) of the fields that decide the answer.",
    headers={},
)
FILE_RECORD = Message(
    "storedFile",
    "Uploaded file",
    "One file of the Files API: OpenAI's file object, its tenant, its line count and"
    " digest, and the partition and offsets of its chunks; a tombstone deletes it.",
    "StoredFile",
    "The file id (UTF-8).",
    headers={},
)
FILE_CHUNK = Message(
    "fileChunk",
    "File chunk",
    "Up to 512 KiB of a file's bytes, as uploaded; a tombstone deletes it.",
    "FileChunk",
    "`<file id>/<n>`, n the chunk's number, six digits (UTF-8).",
    headers={},
)
BATCH_JOB = Message(
    "batchJob",
    "Batch",
    "One batch of the Batch API: OpenAI's batch object (its status, request_counts and"
    " files as they are now), its tenant and plan. Written by the edge that creates it, then"
    " only by the edge running it; a Kafka application may follow a batch's progress here.",
    "BatchJob",
    "The batch id (UTF-8).",
    headers={},
)
BATCH_CANCEL = Message(
    "batchCancel",
    "Batch cancel",
    "A cancel of the batch its key names: the runner stops the batch's lines and ends it"
    " `cancelled`.",
    "BatchCancel",
    "`<batch id>/cancel` (UTF-8), on the batch record's partition.",
    headers={},
)
LINE_OUTCOME = Message(
    "lineOutcome",
    "Batch line outcome",
    "One line of a batch answered: its line of the output file (`ok`) or of the error file,"
    " in OpenAI's shape (`custom_id`, `response` with `status_code` and `body`, `error`)."
    " The latest record of a key is the line's outcome.",
    "LineOutcome",
    "`<batch id>/<line>`, line its place in the input from 0, six digits (UTF-8).",
    headers={},
)
ROLLOUT = Message(
    "modelRollout",
    "Model rollout",
    "One model's variants and their shares of its conversations (the baseline takes the"
    " rest); the latest record per model is the rollout every scheduler routes by.",
    "ModelRollout",
    "The served model name (UTF-8).",
    headers={},
)
VERDICTS = Message(
    "modelVerdicts",
    "Canary verdicts",
    "A scheduler's latest judgement of one model's variants against its baseline (each"
    " window's requests, TTFT p99, error rate, quality and verdict); the latest per model is"
    " what `tokenbus models status` shows and a promotion is checked against.",
    "ModelVerdicts",
    "The served model name (UTF-8).",
    headers={},
)
SCORE = Message(
    "shadowScore",
    "Shadow score",
    "One answer of a model's variant scored against its gold variant's answer to the same"
    " request (exact match, token F1, ROUGE-L, quality), by the gold's worker.",
    "ShadowScore",
    "The served model name (UTF-8).",
    headers={},
)
RESULT_SENDERS: tuple[Service, ...] = ("worker", "scheduler", "ingest")


def channels(topics: Topics) -> tuple[Channel, ...]:
    """Every topic tokenbus reads or writes (`Topics.partitions()` and the dynamic ones)."""
    parts = topics.partitions()
    tiers = tuple(
        Channel(
            f"{tier.value}Requests",
            topics.tier(tier),
            f"Admitted {tier.value} requests, waiting for a bus: from ingest, or from the"
            " edge straight for a request the response cache cannot answer (ADR 0041)."
            " Hand-backs of a dead or draining worker come back here as the next attempt.",
            (QUEUED,),
            ("edge", "ingest", "scheduler", "worker"),
            ("scheduler",),
            parts[topics.tier(tier)],
            groups={"scheduler": f"{topics.prefix}.scheduler"},
        )
        for tier in Tier
    )
    return (
        Channel(
            "requests",
            topics.requests,
            "Chat requests from any producer (`kcat`, applications) and the edge's requests"
            " the response cache may answer (temperature 0 or a seed). A request without"
            " reply_to gets its results on the results topic, keyed by request_id.",
            (REQUEST,),
            ("edge", "external producer"),
            ("ingest",),
            parts[topics.requests],
            groups={"ingest": f"{topics.prefix}.ingest"},
        ),
        Channel(
            "deadLetters",
            topics.dlq,
            "Records that could not be handled, with why in their headers; read by operators.",
            (DEAD_LETTER,),
            ("ingest", "scheduler", "worker"),
            (),
            parts[topics.dlq],
        ),
        *tiers,
        Channel(
            "batches",
            topics.batches,
            "Batches, each written to the partition its worker reads (from its heartbeat).",
            (BATCH,),
            ("scheduler",),
            ("worker",),
            parts[topics.batches],
            groups={"worker": f"{topics.prefix}.worker.<worker_id>"},
        ),
        Channel(
            "results",
            topics.results,
            "Result streams, one partition per edge (leased); external producers that name"
            " no reply_to read theirs here by request_id.",
            (RESULT,),
            RESULT_SENDERS,
            ("edge", "external app"),
            parts[topics.results],
        ),
        Channel(
            "requestResults",
            topics.request_results("{request_id}"),
            "One request's result stream (the edge's `topic` result topology), deleted after"
            " a retention window.",
            (RESULT,),
            RESULT_SENDERS,
            ("edge",),
            parameters={"request_id": "The request's id."},
        ),
        Channel(
            "replyTo",
            None,
            "Any topic a request names in reply_to (e.g. under `tokenbus.replies.`), read by"
            " the application that wrote the request.",
            (RESULT,),
            RESULT_SENDERS,
            ("external app",),
        ),
        Channel(
            "resultLeases",
            topics.result_leases,
            "Compacted log of which edge holds which results partition.",
            (LEASE,),
            ("edge",),
            ("edge",),
            parts[topics.result_leases],
        ),
        Channel(
            "responseCache",
            topics.cache,
            "Compacted, and bounded in age and size, log of complete deterministic answers:"
            " every ingest replica reads all of it (docs/decisions/0036-response-cache.md).",
            (CACHE_ENTRY,),
            ("worker",),
            ("ingest",),
            parts[topics.cache],
        ),
        Channel(
            "files",
            topics.files,
            "Compacted: one record per uploaded file, read whole by every edge; its chunks'"
            " offsets say where its content is (docs/decisions/0074-files-live-on-kafka-in-"
            "chunks-found-by-offset.md).",
            (FILE_RECORD,),
            ("edge",),
            ("edge",),
            parts[topics.files],
        ),
        Channel(
            "fileChunks",
            topics.file_chunks,
            "Compacted: the uploaded files' content, each file's chunks on one partition,"
            " read by offset (ADR 0074).",
            (FILE_CHUNK,),
            ("edge",),
            ("edge",),
            parts[topics.file_chunks],
        ),
        Channel(
            "batchJobs",
            topics.batch_jobs,
            "Compacted: one record per batch, and its cancel; the edges share its partitions"
            " out as the group `tokenbus.batch-runners`, and the holder of one runs its batches"
            " (docs/decisions/0075-batches-run-by-the-edges-from-records-on-the-bus.md).",
            (BATCH_JOB, BATCH_CANCEL),
            ("edge",),
            ("edge",),
            parts[topics.batch_jobs],
        ),
        Channel(
            "batchOutcomes",
            topics.batch_outcomes,
            "Compacted: each batch line's outcome, on its batch's partition number; the"
            " output and error files are written from it when the batch ends (ADR 0075).",
            (LINE_OUTCOME,),
            ("edge",),
            ("edge",),
            parts[topics.batch_outcomes],
        ),
        Channel(
            "variants",
            topics.variants,
            "Compacted log of each model's rollout, written by `tokenbus models rollout` and"
            " by a scheduler rolling a regressed canary back; every scheduler reads all of it"
            " (docs/decisions/0054-model-variants-and-sticky-canaries.md).",
            (ROLLOUT,),
            ("operator", "scheduler"),
            ("scheduler",),
            parts[topics.variants],
        ),
        Channel(
            "verdicts",
            topics.verdicts,
            "Compacted log of each model's canary verdicts, written by the schedulers when one"
            " changes and every few seconds; read by `tokenbus models` (docs/decisions/0058-"
            "canary-verdicts-and-automatic-rollback.md).",
            (VERDICTS,),
            ("scheduler",),
            ("operator",),
            parts[topics.verdicts],
        ),
        Channel(
            "scores",
            topics.scores,
            "Shadow validation's scores, written by the gold variant's workers; every scheduler"
            " reads those written since it started into per-variant quality metrics and its"
            " canary windows"
            " (docs/decisions/0057-shadow-validation.md).",
            (SCORE,),
            ("worker",),
            ("scheduler",),
            parts[topics.scores],
        ),
        Channel(
            "shadow",
            topics.shadow,
            "The streams of shadow validation's gold runs (their reply_to): read by nobody, as"
            " the gold's worker scores its answer itself; kept an hour.",
            (RESULT,),
            ("worker", "scheduler"),
            (),
            parts[topics.shadow],
        ),
        Channel(
            "workers",
            topics.workers,
            "Worker heartbeats: each beat on every partition (single copies, one per node).",
            (HEARTBEAT,),
            ("worker",),
            ("scheduler",),
            parts[topics.workers],
        ),
        Channel(
            "control",
            topics.control,
            "Cancels and resumed streams; every worker and edge reads all of it.",
            (CONTROL,),
            ("edge",),
            ("worker", "edge"),
            parts[topics.control],
        ),
    )


def _asyncapi_schema(node: Any) -> Any:
    """Pydantic's JSON Schema as an AsyncAPI Schema Object, whose `discriminator` is the
    property name alone (OpenAPI's mapping form is not part of it)."""
    if isinstance(node, dict):
        out = {k: _asyncapi_schema(v) for k, v in node.items()}
        if isinstance(out.get("discriminator"), dict):
            out["discriminator"] = out["discriminator"]["propertyName"]
        return out
    if isinstance(node, list):
        return [_asyncapi_schema(v) for v in node]
    return node


def component_schemas() -> dict[str, Any]:
    """Every payload schema and everything they refer to, referenced in place."""
    adapters = [(name, mode, TypeAdapter(t)) for name, (t, mode) in SCHEMAS.items()]
    tops, defs = TypeAdapter.json_schemas(adapters, ref_template="#/components/schemas/{model}")
    schemas: dict[str, Any] = dict(defs.get("$defs", {}))
    for (name, _mode), schema in tops.items():
        if "$ref" in schema:  # a model: named after itself among the defs already
            target = schema["$ref"].rsplit("/", 1)[-1]
            if target != name:
                schemas[name] = schema
        else:
            schemas[name] = {"title": name, **schema}
    schemas["DeadLetter"] = {
        "description": "The dead-lettered record's value exactly as read (any bytes)."
    }
    schemas["FileChunk"] = {"description": "Bytes of an uploaded file, as uploaded (any bytes)."}
    return {k: _asyncapi_schema(schemas[k]) for k in sorted(schemas)}


def _message(m: Message) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": m.name,
        "title": m.title,
        "summary": m.summary,
        "contentType": "application/json",
    }
    if m.headers:
        doc["headers"] = {
            "type": "object",
            "properties": {k: {"type": "string", "description": v} for k, v in m.headers.items()},
        }
        if m.required_headers:
            doc["headers"]["required"] = [k for k in m.headers if k in m.required_headers]
    doc["payload"] = {"$ref": f"#/components/schemas/{m.payload}"}
    doc["bindings"] = {
        "kafka": {"key": {"type": "string", "description": m.key}, "bindingVersion": KAFKA_BINDING}
    }
    return doc


def _operation_id(service: str, action: str, channel: str) -> str:
    who = "".join(w.capitalize() for w in service.split())
    return f"{who[0].lower()}{who[1:]}{action.capitalize()}s{channel[0].upper()}{channel[1:]}"


def asyncapi(topics: Topics | None = None) -> dict[str, Any]:
    """The AsyncAPI 3 document of every topic."""
    topics = topics or Topics()
    chans = channels(topics)
    doc_channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    messages: dict[str, Any] = {}
    for ch in chans:
        entry: dict[str, Any] = {"address": ch.address, "description": ch.description}
        entry["messages"] = {
            m.name: {"$ref": f"#/components/messages/{m.name}"} for m in ch.messages
        }
        if ch.parameters:
            entry["parameters"] = {k: {"description": v} for k, v in ch.parameters.items()}
        if ch.address is not None and "{" not in ch.address:
            binding: dict[str, Any] = {"topic": ch.address}
            if ch.partitions is not None:
                binding["partitions"] = ch.partitions
            entry["bindings"] = {"kafka": {**binding, "bindingVersion": KAFKA_BINDING}}
        doc_channels[ch.name] = entry
        for m in ch.messages:
            messages[m.name] = _message(m)
        for action, services in (("send", ch.sends), ("receive", ch.receives)):
            for service in services:
                op: dict[str, Any] = {
                    "action": action,
                    "channel": {"$ref": f"#/channels/{ch.name}"},
                    "summary": f"{service} {action}s {ch.address or 'reply_to topics'}",
                    "messages": [
                        {"$ref": f"#/channels/{ch.name}/messages/{m.name}"} for m in ch.messages
                    ],
                    "tags": [{"name": service}],
                }
                if action == "receive" and service in ch.groups:
                    op["bindings"] = {
                        "kafka": {
                            "groupId": {"type": "string", "const": ch.groups[service]},
                            "bindingVersion": KAFKA_BINDING,
                        }
                    }
                operations[_operation_id(service, action, ch.name)] = op
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "tokenbus Kafka contract",
            "version": version("tokenbus"),
            "description": (
                "Every topic of a tokenbus deployment with the default topic prefix"
                " (`TOKENBUS_TOPIC_PREFIX=tokenbus`): key, headers, payload, and which service"
                " sends or receives it. Generated from the pydantic models by `tokenbus"
                " schema`; do not edit by hand. Values are UTF-8 JSON; the JSON Schema of the"
                " request, result and control records is also in docs/schema/."
            ),
        },
        "defaultContentType": "application/json",
        "servers": {
            "local": {
                "host": "127.0.0.1:9092",
                "protocol": "kafka",
                "description": "`tokenbus up` / `make run` (the compose file's host listener too).",
            }
        },
        "channels": doc_channels,
        "operations": operations,
        "components": {"messages": messages, "schemas": component_schemas()},
    }


def json_schema(name: str) -> dict[str, Any]:
    model, mode, description = JSON_SCHEMAS[name]
    schema = TypeAdapter(model).json_schema(mode=mode)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": schema.pop("title", name),
        "description": description,
        **schema,
    }


def render() -> dict[Path, str]:
    """Every generated file, relative to the docs directory, with its text."""
    files = {
        Path("schema") / f"{name}.json": json.dumps(json_schema(name), indent=2) + "\n"
        for name in JSON_SCHEMAS
    }
    files[Path("asyncapi.yaml")] = "# Generated by `tokenbus schema` from shared/messages.py.\n" + (
        yaml.safe_dump(asyncapi(), sort_keys=False, allow_unicode=True, width=100)
    )
    return files


def released(commit: str, date: str) -> dict[Path, str]:
    """The released copy of the contract, relative to the docs directory: every file
    `render` writes, the corpus of records (records.jsonl), and RELEASE naming the commit
    and the date it was taken from."""
    files = {RELEASED / rel.name: text for rel, text in render().items()}
    files[RELEASED / "records.jsonl"] = corpus.lines()
    files[RELEASED / "RELEASE"] = f"commit: {commit}\ndate: {date}\n"
    return files


def _head_commit(where: Path) -> str | None:
    """The commit checked out where the docs are, or None outside a git work tree."""
    try:
        found = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return found.stdout.strip()


def stale(out: Path) -> list[Path]:
    """The generated files under `out` that are missing or differ from `render()`."""
    return [
        out / rel
        for rel, text in render().items()
        if not (out / rel).exists() or (out / rel).read_text() != text
    ]


def register(commands: Subcommands) -> None:
    parser = commands.add_parser(
        "schema",
        help="write the Kafka contract: JSON Schema of the records, and an AsyncAPI document",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="docs directory")
    action = parser.add_mutually_exclusive_group()
    action.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if a file is stale"
    )
    action.add_argument(
        "--release",
        action="store_true",
        help=f"write the released copy of the contract and its records under --out/{RELEASED}",
    )
    parser.add_argument(
        "--commit", help="the release's commit, for --release (default: git rev-parse HEAD)"
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    out: Path = args.out
    if args.check:
        behind = stale(out)
        for path in behind:
            print(f"stale: {path} (run `tokenbus schema`)")
        return 1 if behind else 0
    if args.release:
        commit = args.commit or _head_commit(out)
        if commit is None:
            print(f"no git commit checked out at {out}: name the release's with --commit")
            return 1
        files = released(commit, datetime.now(UTC).date().isoformat())
    else:
        files = render()
    for rel, text in files.items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    return 0
