"""Every span attribute, span name and stage name tokenbus emits, in one place.

Names follow the OpenTelemetry semantic conventions where one exists (messaging: Kafka and
batch receive; GenAI: request, usage, response), and live under `tokenbus.` where none does.
"""

from __future__ import annotations

from typing import Final

# --- OpenTelemetry messaging conventions -------------------------------------------------
MESSAGING_SYSTEM: Final = "messaging.system"
MESSAGING_SYSTEM_KAFKA: Final = "kafka"
MESSAGING_DESTINATION_NAME: Final = "messaging.destination.name"
MESSAGING_DESTINATION_PARTITION_ID: Final = "messaging.destination.partition.id"
MESSAGING_OPERATION_TYPE: Final = "messaging.operation.type"  # send | receive | process
MESSAGING_OPERATION_NAME: Final = "messaging.operation.name"
MESSAGING_BATCH_MESSAGE_COUNT: Final = "messaging.batch.message_count"
MESSAGING_KAFKA_MESSAGE_KEY: Final = "messaging.kafka.message.key"
MESSAGING_KAFKA_OFFSET: Final = "messaging.kafka.offset"
MESSAGING_CONSUMER_GROUP_NAME: Final = "messaging.consumer.group.name"

# --- OpenTelemetry GenAI conventions -----------------------------------------------------
GEN_AI_OPERATION_NAME: Final = "gen_ai.operation.name"  # "chat"
GEN_AI_SYSTEM: Final = "gen_ai.system"
GEN_AI_REQUEST_MODEL: Final = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS: Final = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE: Final = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P: Final = "gen_ai.request.top_p"
GEN_AI_RESPONSE_ID: Final = "gen_ai.response.id"
GEN_AI_RESPONSE_FINISH_REASONS: Final = "gen_ai.response.finish_reasons"
GEN_AI_RESPONSE_MODEL: Final = "gen_ai.response.model"  # the model that answered (a cascade's)
GEN_AI_USAGE_INPUT_TOKENS: Final = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS: Final = "gen_ai.usage.output_tokens"
ERROR_TYPE: Final = "error.type"

# --- tokenbus ----------------------------------------------------------------------------
SERVICE_NAME: Final = "service.name"  # resource attribute, copied onto exported spans
REQUEST_ID: Final = "tokenbus.request.id"
REQUEST_ATTEMPT: Final = "tokenbus.request.attempt"
TENANT: Final = "tokenbus.tenant"
TIER: Final = "tokenbus.tier"
STAGE: Final = "tokenbus.stage"  # marks the spans that tile a request's life, see STAGES
BATCH_ID: Final = "tokenbus.batch.id"
BATCH_SIZE: Final = "tokenbus.batch.size"
BATCH_REASON: Final = "tokenbus.batch.reason"  # why the bus left: full | timeout | ...
BATCH_FILL_RATIO: Final = "tokenbus.batch.fill_ratio"
# An OpenAI batch's line (ADR 0075), not the scheduler's batch above.
OPENAI_BATCH_ID: Final = "tokenbus.openai_batch.id"
OPENAI_BATCH_CUSTOM_ID: Final = "tokenbus.openai_batch.custom_id"
WORKER_ID: Final = "tokenbus.worker.id"
VARIANT: Final = "tokenbus.variant"  # the variant of the model that answered (ADR 0054)
CASCADE_ESCALATED_TO: Final = "tokenbus.cascade.escalated_to"  # the next model (ADR 0059)
CASCADE_REASON: Final = "tokenbus.cascade.reason"  # the verifier the answer failed
ADMISSION: Final = "tokenbus.admission"  # admitted | rejected | duplicate
RUN_OUTCOME: Final = "tokenbus.run.outcome"  # answered | handed_back | failed
QUEUE_MS: Final = "tokenbus.timings.queue_ms"
TTFT_MS: Final = "tokenbus.timings.ttft_ms"
TOTAL_MS: Final = "tokenbus.timings.total_ms"

# --- span names --------------------------------------------------------------------------
SPAN_CHAT: Final = "chat"  # the edge's root span of one request (GenAI: "{operation}")
SPAN_WORKER_REQUEST: Final = "worker.request"
SPAN_BATCH_SEND: Final = "send"  # "send {topic}", messaging convention for the batch span
SPAN_BATCH_RECEIVE: Final = "receive"  # "receive {topic}" on the worker


def messaging_span_name(operation: str, topic: str) -> str:
    """Messaging convention span name: `{operation} {destination}`."""
    return f"{operation} {topic}"


# --- stages ------------------------------------------------------------------------------
# The stages tile one request's life with no gap and no overlap: each begins at the instant
# the previous one ended (a timestamp carried in the record), so their durations add up to
# the request's end-to-end time. `tokenbus trace` sums them; the order is the data flow.
STAGE_ACCEPT: Final = "accept"  # edge: frame received -> request record created
STAGE_ADMIT: Final = "admit"  # ingest (or the edge, ADR 0041): created -> written to a tier
STAGE_QUEUE_WAIT: Final = "queue_wait"  # scheduler: in the tier topic and queue -> bus leaves
STAGE_BATCH_FORM: Final = "batch_form"  # scheduler: bus leaves -> batch record written
STAGE_BATCH_TRANSIT: Final = "batch_transit"  # batch record -> the worker starts the request
STAGE_PREFILL: Final = "prefill"  # worker: start -> first token
STAGE_DECODE: Final = "decode"  # worker: first token -> last token flushed
STAGE_RESULT_PUBLISH: Final = "result_publish"  # worker: last token -> final record written
STAGE_DELIVER: Final = "deliver"  # edge: final record written -> its frame on the socket

STAGES: Final = (
    STAGE_ACCEPT,
    STAGE_ADMIT,
    STAGE_QUEUE_WAIT,
    STAGE_BATCH_FORM,
    STAGE_BATCH_TRANSIT,
    STAGE_PREFILL,
    STAGE_DECODE,
    STAGE_RESULT_PUBLISH,
    STAGE_DELIVER,
)


def stage_span_name(stage: str) -> str:
    return f"stage {stage}"
