"""`tokenbus models`: roll a model's variants out on a running deployment, and show where each
model's traffic goes.

`tokenbus models rollout NAME --variant V --percent P` sets variant V's share of model NAME's
conversations (the baseline takes what the variants leave) by writing the model's rollout to
the compacted variants topic, which every scheduler follows (ADR 0054); `--percent 0` rolls
it back. `tokenbus models status` prints each model's shares and the live workers of each
variant (from their heartbeats). `tokenbus models shadow NAME --gold G --percent P` also runs
P % of the model's requests not on variant G on G, and scores the answers' agreement
(shadow validation, ADR 0057; `--percent 0` turns it off).

The schedulers judge each variant against the baseline and roll a regressed one back
(ADR 0058): `status` shows each variant's window (requests, TTFT p99, errors, quality,
verdict) and why a variant was rolled back; `rollout` raises a share only on the evidence
of an `ok` verdict, unless `--force` (tokenbus/promotion.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from pydantic import ValidationError

from services.scheduler.variants import RolloutReader, Rollouts
from shared.kafka import (
    KafkaLoginRefused,
    encode,
    make_admin,
    make_consumer,
    make_producer,
    wait_for_broker,
)
from shared.logs import configure_logging
from shared.messages import Heartbeat, error_message
from shared.records import read
from shared.settings import TokenbusSettings
from shared.topics import Topics
from shared.variants import BASELINE, ModelRollout, Shadow, Variant
from shared.verdicts import ModelVerdicts, VariantEvidence
from tokenbus.promotion import evidence_line, read_verdicts, refusal

if TYPE_CHECKING:
    from tokenbus.commands import Subcommands

BROKER_TIMEOUT_S = 15.0
# Heartbeats this recent are read; a worker is live while its latest is younger than
# `MISSED_BEATS` of its intervals (as the scheduler counts, `scheduler_worker_missed_beats`).
HEARTBEAT_LOOKBACK_S = 30.0
MISSED_BEATS = 3
DESCRIBED = ("revision", "engine", "quantization", "worker_group")
CREATE_TOPICS = "run `tokenbus topics create` (it makes the missing topics)"


class TopicMissing(Exception):
    """A topic the command needs does not exist (`tokenbus topics create` makes it)."""


def register(commands: Subcommands) -> None:
    parser = commands.add_parser(
        "models", help="roll out a model's variants, show each model's traffic shares"
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    rollout = actions.add_parser(
        "rollout",
        help="set a variant's share of a model's conversations (0: roll it back); the"
        " baseline takes the rest",
    )
    rollout.add_argument("model", metavar="NAME", help="the served model name")
    rollout.add_argument(
        "--variant", required=True, help="the variant, as its workers' TOKENBUS_WORKER_VARIANT"
    )
    rollout.add_argument(
        "--percent", required=True, type=float, help="its share of conversations, 0-100"
    )
    for name in DESCRIBED:
        rollout.add_argument(
            "--" + name.replace("_", "-"),
            default=None,
            help=f"what sets the variant apart: its {name.replace('_', ' ')} (default: kept)",
        )
    rollout.add_argument(
        "--force",
        action="store_true",
        help="raise the share without the schedulers' evidence (a recent verdict with enough"
        " requests and no regression); says what it overrode",
    )
    rollout.set_defaults(handler=_rollout)
    shadow = actions.add_parser(
        "shadow",
        help="run a share of a model's requests not on its gold variant on the gold too, and"
        " score the answers' agreement (0: off)",
    )
    shadow.add_argument("model", metavar="NAME", help="the served model name")
    shadow.add_argument(
        "--gold", required=True, help=f"the reference variant ({BASELINE!r}: the baseline)"
    )
    shadow.add_argument(
        "--percent", required=True, type=float, help="share of its requests also run, 0-100"
    )
    shadow.set_defaults(handler=_shadow)
    status = actions.add_parser("status", help="each model's variants, shares and live workers")
    status.add_argument("model", metavar="NAME", nargs="?", help="only this model")
    status.add_argument("--json", action="store_true", help="print JSON instead of text")
    status.set_defaults(handler=_status)


@dataclass
class VariantStatus:
    name: str
    percent: float
    workers: list[str] = field(default_factory=list)
    described: dict[str, str] = field(default_factory=dict)
    evidence: dict[str, Any] | None = None  # its canary window (a VariantEvidence)
    rolled_back: str | None = None  # why a scheduler rolled it back


@dataclass
class ModelStatus:
    model: str
    variants: list[VariantStatus]
    updated_at: float | None = None
    shadow: Shadow | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "updated_at": self.updated_at,
            "variants": [v.__dict__ for v in self.variants],
            "shadow": None if self.shadow is None else self.shadow.model_dump(),
        }


def statuses(
    rollouts: Rollouts,
    beats: Sequence[Heartbeat],
    verdicts: Mapping[str, ModelVerdicts] | None = None,
) -> list[ModelStatus]:
    """Per model (of a rollout or a live worker), each variant's share, live workers and
    canary evidence; the baseline first, then the rollout's variants, then variants only
    workers name."""
    models = sorted({r.model for r in rollouts.all()} | {b.model for b in beats})
    out: list[ModelStatus] = []
    for model in models:
        rollout = rollouts.get(model) or ModelRollout(model=model, updated_at=0.0)
        rows = {BASELINE: VariantStatus(BASELINE, rollout.baseline_percent)}
        for v in rollout.variants:
            described = {k: str(getattr(v, k)) for k in DESCRIBED if getattr(v, k) is not None}
            rows[v.name] = VariantStatus(v.name, v.percent, described=described)
            if v.rolled_back is not None:
                rows[v.name].rolled_back = v.rolled_back.reason
        for beat in beats:
            if beat.model == model:
                name = beat.variant or BASELINE
                rows.setdefault(name, VariantStatus(name, 0.0)).workers.append(beat.worker_id)
        judged = (verdicts or {}).get(model)
        for row in rows.values():
            found = None if judged is None else judged.of(row.name)
            row.evidence = None if found is None else found.model_dump(mode="json")
        updated = rollout.updated_at if rollouts.get(model) is not None else None
        out.append(ModelStatus(model, list(rows.values()), updated, rollout.shadow))
    return out


def _rollout(args: argparse.Namespace) -> int:
    try:
        wanted = Variant(name=args.variant, percent=args.percent)
    except ValidationError as exc:
        print(f"tokenbus models rollout: {error_message(exc)}", file=sys.stderr)
        return 2
    settings = _settings()
    try:
        rollouts, beats = asyncio.run(read_deployment(settings))
        current = rollouts.get(args.model) or ModelRollout(model=args.model)
        old = next((v for v in current.variants if v.name == wanted.name), None)
        kept = {} if old is None else {k: getattr(old, k) for k in DESCRIBED}
        given = {k: getattr(args, k) for k in DESCRIBED if getattr(args, k) is not None}
        variant = Variant(name=wanted.name, percent=wanted.percent, **(kept | given))
        rollout = current.with_variant(variant, time.time())
        raising = wanted.percent > (0.0 if old is None else old.percent)
        judged = asyncio.run(read_verdicts(settings)).get(args.model) if raising else None
    except ValidationError as exc:
        print(f"tokenbus models rollout: {error_message(exc)}", file=sys.stderr)
        return 2
    except (TimeoutError, KafkaError, KafkaLoginRefused, TopicMissing) as exc:
        print(f"tokenbus models rollout: {exc}", file=sys.stderr)
        return 1
    # A promotion needs the schedulers' evidence (tokenbus/promotion.py, ADR 0058).
    why = refusal(args.model, old, variant.percent, judged, time.time())
    if why is not None:
        print(
            f"tokenbus models rollout: {'forced' if args.force else 'refused'}: {why}",
            file=sys.stderr,
        )
        if not args.force:
            return 2
    try:
        asyncio.run(_write(settings, rollout))
    except (TimeoutError, KafkaError) as exc:
        print(f"tokenbus models rollout: not stored: {exc}", file=sys.stderr)
        return 1
    was = 0.0 if old is None else old.percent
    print(f"{args.model}: {variant.name} {was:g} % -> {variant.percent:g} %", flush=True)
    rollouts.apply(rollout.model, rollout)
    _print(statuses(rollouts, beats))
    live = any(b.model == args.model and b.variant == variant.name for b in beats)
    if variant.percent > 0 and not live:
        print(
            f"note: no live worker runs {variant.name!r} of {args.model!r} yet: its share is"
            " served by the baseline until one does",
            file=sys.stderr,
        )
    return 0


def _shadow(args: argparse.Namespace) -> int:
    """Set the model's shadow validation (ADR 0057); 0 % turns it off."""
    try:
        wanted = Shadow(gold=args.gold, percent=args.percent)
    except ValidationError as exc:
        print(f"tokenbus models shadow: {error_message(exc)}", file=sys.stderr)
        return 2
    settings = _settings()
    try:
        rollouts, beats = asyncio.run(read_deployment(settings))
    except (TimeoutError, KafkaError, KafkaLoginRefused, TopicMissing) as exc:
        print(f"tokenbus models shadow: {exc}", file=sys.stderr)
        return 1
    current = rollouts.get(args.model) or ModelRollout(model=args.model)
    rollout = current.with_shadow(wanted if wanted.percent > 0 else None, time.time())
    try:
        asyncio.run(_write(settings, rollout))
    except (TimeoutError, KafkaError) as exc:
        print(f"tokenbus models shadow: not stored: {exc}", file=sys.stderr)
        return 1
    print(f"{args.model}: {shadow_line(rollout.shadow)}", flush=True)
    gold = None if wanted.gold == BASELINE else wanted.gold
    if rollout.shadow is not None and not any(
        b.model == args.model and b.variant == gold for b in beats
    ):
        print(
            f"note: no live worker runs {wanted.gold!r} of {args.model!r} yet: its gold runs"
            " wait for one (5 minutes at most each)",
            file=sys.stderr,
        )
    return 0


def shadow_line(shadow: Shadow | None) -> str:
    """How `status` says a model's shadow validation."""
    if shadow is None:
        return "shadow validation off"
    return f"shadow: {shadow.percent:g} % of requests not on {shadow.gold} also run on it"


def _status(args: argparse.Namespace) -> int:
    settings = _settings()
    try:
        rollouts, beats = asyncio.run(read_deployment(settings))
        verdicts = asyncio.run(read_verdicts(settings))
    except (TimeoutError, KafkaError, KafkaLoginRefused, TopicMissing) as exc:
        print(f"tokenbus models status: {exc}", file=sys.stderr)
        return 1
    found = [s for s in statuses(rollouts, beats, verdicts) if args.model in (None, s.model)]
    if args.json:
        print(json.dumps([s.as_json() for s in found], indent=2))
    elif not found:
        print("no model has a rollout or a live worker")
    else:
        _print(found)
    return 0


def _settings() -> TokenbusSettings:
    """The deployment's settings; the readers' logs to stderr, warnings only (stdout is the
    command's answer)."""
    configure_logging("tokenbus-models", level="WARNING")
    return TokenbusSettings()


def _print(found: Sequence[ModelStatus]) -> None:
    for s in found:
        print(f"model {s.model}")
        if s.shadow is not None:
            print(f"  {shadow_line(s.shadow)}")
        for v in s.variants:
            what = " ".join(f"{k}={val}" for k, val in v.described.items())
            workers = ", ".join(v.workers) or "none live"
            print(f"  {v.name:<20} {v.percent:6.2f} %  workers: {workers}  {what}".rstrip())
            if v.evidence is not None:
                print(f"  {'':<20} {evidence_line(VariantEvidence.model_validate(v.evidence))}")
            if v.rolled_back is not None:
                print(f"  {'':<20} rolled back: {v.rolled_back}")


async def read_deployment(settings: TokenbusSettings) -> tuple[Rollouts, list[Heartbeat]]:
    """Every model's rollout, and the latest heartbeat of each live worker."""
    await wait_for_broker(settings, timeout_s=BROKER_TIMEOUT_S)
    topics = Topics(settings.topic_prefix)
    rollouts = Rollouts()
    admin = make_admin(settings, client_id="tokenbus-models")
    consumer = make_consumer(settings, group_id=None, client_id="tokenbus-models")
    async with contextlib.AsyncExitStack() as stack:
        await admin.start()
        stack.push_async_callback(admin.close)
        await consumer.start()
        stack.push_async_callback(consumer.stop)
        if not await RolloutReader(consumer, rollouts, admin, topics.variants).load():
            raise TopicMissing(f"topic {topics.variants} does not exist: {CREATE_TOPICS}")
        beats = await _recent_beats(consumer, await _partitions(admin, topics.workers))
    return rollouts, beats


async def _recent_beats(consumer: AIOKafkaConsumer, tps: list[TopicPartition]) -> list[Heartbeat]:
    """The latest heartbeat of each worker heard in the last `HEARTBEAT_LOOKBACK_S`, if it
    is still live."""
    now = time.time()
    consumer.assign(tps)
    since = int((now - HEARTBEAT_LOOKBACK_S) * 1000)
    found = await consumer.offsets_for_times({tp: since for tp in tps})
    ends = await consumer.end_offsets(tps)
    todo: list[TopicPartition] = []
    for tp in tps:
        at = found.get(tp)
        if at is not None and at.offset < ends[tp]:
            consumer.seek(tp, at.offset)
            todo.append(tp)
    latest: dict[str, Heartbeat] = {}
    while todo:
        fetched = await consumer.getmany(*todo, timeout_ms=500)
        for records in fetched.values():
            for record in records:
                beat = _beat(record.value)
                if beat is not None:
                    latest[beat.worker_id] = beat
        todo = [tp for tp in todo if await consumer.position(tp) < ends[tp]]
    now = time.time()
    return [b for b in latest.values() if now - b.sent_at <= MISSED_BEATS * b.interval_ms / 1000.0]


def _beat(value: bytes | None) -> Heartbeat | None:
    try:
        return read(Heartbeat, value or b"")
    except ValidationError:
        return None  # not this command's to judge: the schedulers dead-letter it


async def _partitions(admin: AIOKafkaAdminClient, topic: str) -> list[TopicPartition]:
    described = await admin.describe_topics([topic])
    found = [
        TopicPartition(topic, p["partition"])
        for t in described
        if t.get("error_code") == 0
        for p in t["partitions"]
    ]
    if not found:
        raise TopicMissing(f"topic {topic} does not exist: {CREATE_TOPICS}")
    return found


async def _write(settings: TokenbusSettings, rollout: ModelRollout) -> None:
    """Store the model's rollout, keyed by its name (acks=all)."""
    topic = Topics(settings.topic_prefix).variants
    producer = make_producer(settings, client_id="tokenbus-models")
    await producer.start()
    try:
        await producer.send_and_wait(topic, encode(rollout), key=rollout.model.encode())
    finally:
        await producer.stop()
