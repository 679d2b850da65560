"""The canary evidence behind `tokenbus models`: the schedulers' latest verdicts (read from the
compacted verdicts topic), shown by `status`, and the rule `rollout` applies before it
raises a variant's share (ADR 0058).

A promotion needs evidence: a variant's share may go up only while the schedulers' latest
verdict on it (at most `FRESH_S` old) has the minimum sample and no regression. Starting a
canary (from 0 %, never rolled back) needs none, since its evidence comes from that share;
lowering a share never needs any. `--force` raises it anyway, and says what it overrode.
"""

from __future__ import annotations

import contextlib

import structlog
from aiokafka import TopicPartition
from pydantic import ValidationError

from shared.kafka import make_admin, make_consumer
from shared.records import read
from shared.settings import TokenbusSettings
from shared.topics import Topics
from shared.variants import Variant
from shared.verdicts import ModelVerdicts, VariantEvidence

# A verdict older than this is no evidence: the schedulers publish every few seconds
# (TOKENBUS_SCHEDULER_CANARY_PUBLISH_S) while a model has variants.
FRESH_S = 60.0
FETCH_MS = 500

log = structlog.get_logger()


def refusal(
    model: str, old: Variant | None, percent: float, verdicts: ModelVerdicts | None, now: float
) -> str | None:
    """Why raising `old`'s share to `percent` needs `--force`; None when it may go ahead."""
    was = 0.0 if old is None else old.percent
    if percent <= was:
        return None  # lowering (or keeping) a share never needs evidence
    name = "?" if old is None else old.name
    if was == 0.0:
        if old is None or old.rolled_back is None:
            return None  # a start: its evidence comes from the share it gets now
        note = old.rolled_back
        return (
            f"{name} of {model} was rolled back ({note.reason}); raising it again needs"
            " --force once the cause is fixed"
        )
    found = None if verdicts is None or now - verdicts.judged_at > FRESH_S else verdicts.of(name)
    if found is None:
        return (
            f"no recent verdict on {name} of {model} from the schedulers (they publish one every"
            " few seconds while it has a share); --force raises it without evidence"
        )
    if found.verdict == "regressed":
        return f"{name} of {model} has regressed: {'; '.join(found.reasons)}"
    if found.verdict != "ok":
        wanting = "; ".join(found.reasons) or "too few requests in the window"
        return f"not enough evidence on {name} of {model} yet ({wanting}); wait, or --force"
    return None


def evidence_line(found: VariantEvidence) -> str:
    """One variant's window, as `tokenbus models status` prints it under the variant."""
    ttft = "-" if found.ttft_p99_ms is None else f"{found.ttft_p99_ms:.0f} ms"
    errors = "-" if found.error_rate is None else f"{found.error_rate:.1%}"
    quality = "-" if found.quality is None else f"{found.quality:.2f} ({found.scores} scores)"
    verdict = "" if found.verdict == "reference" else f"  verdict: {found.verdict}"
    return (
        f"requests {found.requests}  TTFT p99 {ttft}  errors {errors}  quality {quality}{verdict}"
    )


async def read_verdicts(settings: TokenbusSettings) -> dict[str, ModelVerdicts]:
    """Each model's latest verdicts, read whole from the verdicts topic (none if it does not
    exist yet: `tokenbus topics create` makes it)."""
    topic = Topics(settings.topic_prefix).verdicts
    admin = make_admin(settings, client_id="tokenbus-models")
    consumer = make_consumer(settings, group_id=None, client_id="tokenbus-models-verdicts")
    out: dict[str, ModelVerdicts] = {}
    async with contextlib.AsyncExitStack() as stack:
        await admin.start()
        stack.push_async_callback(admin.close)
        await consumer.start()
        stack.push_async_callback(consumer.stop)
        described = await admin.describe_topics([topic])
        tps = [
            TopicPartition(topic, p["partition"])
            for t in described
            if t.get("error_code") == 0
            for p in t["partitions"]
        ]
        if not tps:
            return out
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        todo = [tp for tp in tps if ends[tp] > 0]
        while todo:
            fetched = await consumer.getmany(*todo, timeout_ms=FETCH_MS)
            for records in fetched.values():
                for record in records:
                    try:
                        verdicts = read(ModelVerdicts, record.value or b"")
                    except ValidationError as exc:
                        log.warning("verdicts.invalid", offset=record.offset, error=str(exc))
                        continue
                    out[verdicts.model] = verdicts
            todo = [tp for tp in todo if await consumer.position(tp) < ends[tp]]
    return out
