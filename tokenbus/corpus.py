"""Every kind of record tokenbus writes, built through today's models with every feature on:
the corpus a release publishes (`tokenbus schema --release`) and the contract check reads.

A field added to a model is added here too, set: tests/test_contract_compat.py fails while
some field of a record model is set in none of these records. Times are fixed, so that the
corpus of a release is the same bytes each time it is written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, TypeAdapter

from services.edge.leases import LeaseRecord
from shared.batch_jobs import (
    BatchCancel,
    BatchError,
    BatchErrors,
    BatchJob,
    BatchObject,
    LineOutcome,
    RequestCounts,
)
from shared.files import FileObject, StoredFile
from shared.kafka import encode
from shared.messages import (
    OUTCOME_TTFT_BOUNDS_S,
    Batch,
    BatchRef,
    CacheEntry,
    CancelRecord,
    Capabilities,
    ChatMessage,
    ControlRecord,
    DeltaResult,
    DoneResult,
    ErrorCode,
    ErrorResult,
    FunctionCall,
    FunctionDefinition,
    FunctionName,
    Heartbeat,
    JsonSchemaFormat,
    Judged,
    NamedToolChoice,
    Outcomes,
    QueuedRequest,
    ReplyTo,
    RequestRecord,
    ResetResult,
    ResponseFormat,
    ResultRecord,
    StreamResumed,
    Tier,
    Timings,
    TokenLogprob,
    Tool,
    ToolCall,
    TopLogprob,
    Usage,
)
from shared.shadows import ShadowScore
from shared.variants import ModelRollout, Shadow, Variant
from shared.verdicts import ModelVerdicts, RolledBack, VariantEvidence

AT = 1767225600.0  # 2026-01-01T00:00:00Z: every time in the corpus counts from it
_RESULTS: TypeAdapter[Any] = TypeAdapter(ResultRecord)
_CONTROL: TypeAdapter[Any] = TypeAdapter(ControlRecord)


@dataclass(frozen=True)
class Kind:
    """One kind of record: its payload in docs/asyncapi.yaml, and how today's readers parse
    it. `strict`: applications write it too, so its reader refuses fields it does not know
    (ADR 0072); every other kind is written by tokenbus services only, and read through
    shared/records.py."""

    name: str
    payload: str  # a component schema of the AsyncAPI document (tokenbus/schema.py SCHEMAS)
    reader: type[BaseModel] | TypeAdapter[Any]
    strict: bool = False


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind("request", "RequestRecord", RequestRecord, strict=True),
        Kind("queued_request", "QueuedRequest", QueuedRequest),
        Kind("batch", "Batch", Batch),
        Kind("delta", "ResultRecord", _RESULTS),
        Kind("done", "ResultRecord", _RESULTS),
        Kind("error", "ResultRecord", _RESULTS),
        Kind("reset", "ResultRecord", _RESULTS),
        Kind("cancel", "ControlRecord", _CONTROL),
        Kind("resumed", "ControlRecord", _CONTROL),
        Kind("heartbeat", "Heartbeat", Heartbeat),
        Kind("lease", "LeaseRecord", LeaseRecord),
        Kind("cache_entry", "CacheEntry", CacheEntry),
        Kind("rollout", "ModelRollout", ModelRollout),
        Kind("verdicts", "ModelVerdicts", ModelVerdicts),
        Kind("shadow_score", "ShadowScore", ShadowScore),
        Kind("stored_file", "StoredFile", StoredFile),
        Kind("batch_job", "BatchJob", BatchJob),
        Kind("batch_cancel", "BatchCancel", BatchCancel),
        Kind("line_outcome", "LineOutcome", LineOutcome),
    )
}


@dataclass(frozen=True)
class Sample:
    """One record of the corpus, and its kind."""

    kind: Kind
    record: BaseModel

    def line(self) -> str:
        """Its line of records.jsonl: the record as its writer encodes it."""
        record = json.loads(encode(self.record))
        return json.dumps({"kind": self.kind.name, "record": record}, ensure_ascii=False)


def samples() -> list[Sample]:
    """Every kind, every feature on. A kind has more than one record only where fields
    exclude each other (a prompt or messages; a response format or a named tool choice)."""
    chat, prompt, named = _queued_requests()
    records: list[tuple[str, BaseModel]] = [
        ("request", _request_record(chat)),
        ("request", _request_record(prompt)),
        ("queued_request", chat),
        ("batch", _batch([chat, prompt, named])),
        ("delta", _delta()),
        ("done", _done()),
        ("error", _error()),
        ("reset", _reset()),
        (
            "cancel",
            CancelRecord(kind="cancel", request_id="req-1", reason="disconnect", sent_at=AT),
        ),
        (
            "resumed",
            StreamResumed(kind="resumed", request_id="req-1", edge_id="edge-b", sent_at=AT),
        ),
        ("heartbeat", _heartbeat()),
        (
            "lease",
            LeaseRecord(kind="claim", partition=3, holder="edge-a", epoch=7, ttl_ms=10_000),
        ),
        ("cache_entry", _cache_entry()),
        ("rollout", _rollout()),
        ("verdicts", _verdicts()),
        ("shadow_score", _shadow_score()),
        ("stored_file", _stored_file()),
        ("batch_job", _batch_job()),
        ("batch_cancel", BatchCancel(at=int(AT))),
        ("line_outcome", _line_outcome()),
    ]
    return [Sample(KINDS[name], record) for name, record in records]


def lines() -> str:
    """records.jsonl: one sample a line."""
    return "".join(f"{s.line()}\n" for s in samples())


_USAGE = Usage(prompt_tokens=42, completion_tokens=17)
_CALL = ToolCall(
    id="call-1",
    type="function",
    function=FunctionCall(name="get_weather", arguments='{"city": "Lisbon"}'),
)
_WEATHER = Tool(
    type="function",
    function=FunctionDefinition(
        name="get_weather",
        description="The weather in a city.",
        parameters={"type": "object", "properties": {"city": {"type": "string"}}},
        strict=True,
    ),
)


def _messages() -> list[ChatMessage]:
    return [
        ChatMessage(role="system", content="Answer briefly."),
        ChatMessage(role="user", content="Weather in Lisbon?"),
        ChatMessage(role="assistant", content="", tool_calls=[_CALL]),
        ChatMessage(role="tool", content='{"sky": "clear"}', tool_call_id="call-1"),
    ]


def _sampling() -> dict[str, Any]:
    """Every sampling field of a request, set off its neutral value."""
    return {
        "max_tokens": 64,
        "temperature": 0.0,
        "top_p": 0.9,
        "stop": ["\n\n"],
        "seed": 7,
        "top_k": 40,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "logit_bias": {50256: -100.0},
        "min_tokens": 2,
        "ignore_eos": True,
        "stop_token_ids": [2],
        "logprobs": 2,
        "delta_tokens": True,
    }


def _queued(request_id: str, **fields: Any) -> QueuedRequest:
    return QueuedRequest(
        request_id=request_id,
        client_id="client-1",
        **_sampling(),
        priority=Tier.interactive,
        model="llama3-8b",
        fallback_model="llama3-1b",
        cache=False,
        conversation_id="conv-1",
        variant="canary",
        batch_line=BatchRef(batch_id="batch_1a", custom_id="req-4"),
        deadline_ms=30_000,
        tenant="acme",
        reply_to=ReplyTo(topic="tokenbus.results", partition=1),
        created_at=AT,
        plan="pro",
        tier=Tier.interactive,
        prompt_tokens=24,
        attempt=2,
        accepted_at=AT + 0.01,
        trace={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
        cascade_step=1,
        cache_key="0" * 64,
        shadow_gold="baseline",
        judged=Judged(request_id="req-0", model="llama3-8b", variant="canary", text="Clear."),
        continues="The sky",
        requeued=1,
        **fields,
    )


def _queued_requests() -> tuple[QueuedRequest, QueuedRequest, QueuedRequest]:
    """A chat with tools and a JSON-schema answer; a prompt; a chat with a named tool."""
    chat = _queued(
        "req-1",
        messages=_messages(),
        tools=[_WEATHER],
        tool_choice="auto",
        parallel_tool_calls=False,
        response_format=ResponseFormat(
            type="json_schema",
            json_schema=JsonSchemaFormat(
                name="weather",
                description="The answer as JSON.",
                json_schema={"type": "object", "properties": {"sky": {"type": "string"}}},
                strict=True,
            ),
        ),
    )
    prompt = _queued("req-2", prompt="Summarise the bus rule.")
    named = _queued(
        "req-3",
        messages=_messages(),
        tools=[_WEATHER],
        tool_choice=NamedToolChoice(type="function", function=FunctionName(name="get_weather")),
    )
    return chat, prompt, named


def _request_record(queued: QueuedRequest) -> RequestRecord:
    """The request as the edge wrote it to the requests topic (its own fields only)."""
    return RequestRecord(**{name: getattr(queued, name) for name in RequestRecord.model_fields})


def _batch(requests: list[QueuedRequest]) -> Batch:
    return Batch(
        batch_id="batch-1",
        tier=Tier.interactive,
        requests=requests,
        reason="full",
        formed_at=AT + 0.02,
        worker_id="worker-a",
    )


def _delta() -> DeltaResult:
    top = [TopLogprob(token=" Sun", logprob=-1.5)]
    return DeltaResult(
        request_id="req-1",
        attempt=2,
        seq=0,
        kind="delta",
        text=" Clear",
        logprobs=[TokenLogprob(token=" Clear", logprob=-0.25, top=top)],
        tokens=1,
        prompt_tokens=12,
    )


def _done() -> DoneResult:
    return DoneResult(
        request_id="req-1",
        attempt=2,
        seq=1,
        kind="done",
        finish_reason="stop",
        usage=_USAGE,
        timings=Timings(queue_ms=3.5, batch_size=4, ttft_ms=120.0, total_ms=480.0),
        model="llama3-8b",
        cached=True,
        tool_calls=[_CALL],
        content="Let me look.",
        variant="canary",
    )


def _error() -> ErrorResult:
    return ErrorResult(
        request_id="req-1",
        attempt=2,
        seq=1,
        kind="error",
        code=ErrorCode.overloaded,
        message="every worker is busy",
        retry_after_ms=500,
        usage=_USAGE,
    )


def _reset() -> ResetResult:
    return ResetResult(
        request_id="req-1", attempt=3, seq=0, kind="reset", reason="verifier", usage=_USAGE
    )


def _heartbeat() -> Heartbeat:
    ttft = [0] * (len(OUTCOME_TTFT_BOUNDS_S) + 1)
    ttft[10] = 5
    return Heartbeat(
        worker_id="worker-a",
        model="llama3-8b",
        total_slots=8,
        free_slots=5,
        running=3,
        queued_tokens=900,
        utilisation=0.375,
        sent_at=AT,
        batch_partition=0,
        batches_consumed=12,
        held=[("req-1", 2)],
        interval_ms=1000.0,
        started_at=AT - 60,
        batch_mode="continuous",
        prefix_cache_hit_rate=0.5,
        queued=1,
        kv_cache_usage=0.25,
        max_model_len=8192,
        # One field: a set's order in JSON varies from process to process.
        capabilities=Capabilities(engine="vllm", sampling=frozenset({"logprobs"})),
        variant="canary",
        load_s=12.5,
        outcomes=Outcomes(answered=5, failed=1, ttft=ttft),
    )


def _stored_file() -> StoredFile:
    return StoredFile(
        file=FileObject(
            id="file-1",
            object="file",
            status="processed",
            bytes=2048,
            created_at=int(AT),
            filename="requests.jsonl",
            purpose="batch",
            expires_at=int(AT) + 86400,
            status_details="validated: 12 requests",
        ),
        tenant="acme",
        lines=12,
        sha256="e" * 64,
        partition=2,
        offsets=[40, 41],
        tokens=3200,
    )


def _batch_job() -> BatchJob:
    at = int(AT)
    return BatchJob(
        batch=BatchObject(
            id="batch_1",
            object="batch",
            endpoint="/v1/chat/completions",
            errors=BatchErrors(
                object="list",
                data=[
                    BatchError(code="invalid_file", message="gone", param="input_file_id", line=3)
                ],
            ),
            input_file_id="file-1",
            completion_window="24h",
            status="completed",
            output_file_id="file-1-output",
            error_file_id="file-1-errors",
            created_at=at,
            in_progress_at=at + 1,
            expires_at=at + 86400,
            finalizing_at=at + 60,
            completed_at=at + 61,
            failed_at=at + 62,
            expired_at=at + 63,
            cancelling_at=at + 64,
            cancelled_at=at + 65,
            request_counts=RequestCounts(total=12, completed=11, failed=1),
            metadata={"job": "nightly"},
        ),
        tenant="acme",
        plan="gold",
        tokens=3200,
    )


def _line_outcome() -> LineOutcome:
    return LineOutcome(
        line=4,
        ok=True,
        output={
            "id": "batch_req_1",
            "custom_id": "req-4",
            "response": {"status_code": 200, "request_id": "r1", "body": {"object": "x"}},
            "error": None,
        },
    )


def _cache_entry() -> CacheEntry:
    return CacheEntry(
        key="f" * 64,
        chunks=[" Clear", " skies."],
        finish_reason="stop",
        usage=_USAGE,
        model="llama3-8b",
        request_id="req-1",
        stored_at=AT,
    )


def _evidence(variant: str) -> VariantEvidence:
    return VariantEvidence(
        variant=variant,
        answered=40,
        failed=2,
        ttft_p99_ms=310.0,
        error_rate=0.05,
        quality=0.8,
        scores=12,
        verdict="regressed",
        regressed=["errors"],
        reasons=["errors: 4.8 % against 0.0 %"],
    )


def _rollout() -> ModelRollout:
    rolled_back = RolledBack(
        reason="errors: 4.8 % against 0.0 %",
        checks=["errors"],
        at=AT,
        scheduler_id="scheduler-a",
        evidence=[_evidence("canary"), _evidence("baseline")],
    )
    canary = Variant(
        name="canary",
        percent=0.0,
        revision="rev-2",
        engine="vllm",
        quantization="fp8",
        worker_group="gpu-b",
        rolled_back=rolled_back,
    )
    return ModelRollout(
        model="llama3-8b",
        variants=[canary],
        updated_at=AT,
        shadow=Shadow(gold="baseline", percent=5.0),
    )


def _verdicts() -> ModelVerdicts:
    return ModelVerdicts(
        model="llama3-8b",
        scheduler_id="scheduler-a",
        judged_at=AT,
        window_s=300.0,
        variants=[_evidence("baseline"), _evidence("canary")],
    )


def _shadow_score() -> ShadowScore:
    return ShadowScore(
        model="llama3-8b",
        variant="canary",
        gold="baseline",
        request_id="req-1",
        exact=False,
        f1=0.75,
        rouge_l=0.7,
        embedding=0.9,
        quality=0.9,
        deterministic=False,
        scored_at=AT,
        tenant="acme",
    )
