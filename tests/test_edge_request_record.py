"""The edge's request record, built from the validated request without validating it again,
is the record validation would have built (unit)."""

from __future__ import annotations

import json

from services.edge.gateway import request_record
from services.edge.protocol import ChatRequestFrame
from shared.messages import ReplyTo, RequestLimits, RequestRecord


def test_the_record_built_without_validation_is_the_validated_record() -> None:
    limits = RequestLimits()
    frame = ChatRequestFrame.model_validate(
        {
            "type": "chat.request",
            "client_id": "c1",
            "messages": [{"role": "user", "content": "hi"}],
            "stop": "END",
            "priority": "background",
            "seed": 7,
            "deadline_ms": 5000,
        },
        context={"limits": limits},
    )
    reply_to = ReplyTo(topic="t.results", partition=3)
    built = request_record(frame, request_id="r1", tenant="acme", reply_to=reply_to)
    fields = frame.model_dump(exclude={"type"})
    fields.update(request_id="r1", tenant="acme", reply_to=reply_to.model_dump())
    fields["created_at"] = built.created_at
    validated = RequestRecord.model_validate(fields, context={"limits": limits})
    assert json.loads(built.model_dump_json()) == json.loads(validated.model_dump_json())
    # What a reader of the topic parses back is the same request.
    assert RequestRecord.model_validate_json(built.model_dump_json()) == validated
