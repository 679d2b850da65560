"""Tools and structured outputs: what an OpenAI chat body asks for, and tool calls in OpenAI's
shapes.

Pure. The request side: `tools`, `tool_choice` and `response_format` pass on to the
request's fields of the same names, with only the keys the record knows (a client's extra
keys are ignored, as unknown fields are), as do an assistant message's `tool_calls` and a
tool message's `tool_call_id`; vLLM's `guided_json` and `structured_outputs` (its `json`
and `json_object`) become a `response_format`. The request checks them (`ChatRequest`), and
whether the model's engine can honour them is the gateway's check, as for the sampling
fields.

The answer side, as OpenAI's API and vLLM's server show it:
- an answer that calls tools has `message.tool_calls`
  (`[{id, type: "function", function: {name, arguments}}]`, `arguments` a JSON object's
  text) and `content` null, or the text the model wrote besides the calls;
- its finish_reason is "tool_calls", except after a named `tool_choice`, which ends with
  "stop", as OpenAI ends a forced call;
- a stream of a request that may call tools holds its text back until the answer is whole
  (the calls are read from the whole text): at the end one chunk carries the content, or
  every call (`delta.tool_calls[{index, id, type, function: {name, arguments}}]`), which
  OpenAI's clients accept as they accept a call streamed in pieces.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from services.edge.openai.errors import HttpError, invalid
from services.edge.openai.schema import (
    ChatCompletionRequest,
    ChunkToolCall,
    CompletionRequest,
    FunctionCallBody,
    Message,
    ToolCallBody,
)
from shared.messages import ToolCall

# Which tool answers a request may get: "named" (one call of the named function), "any"
# (auto or required); None: it calls no tool.
ToolAnswer = Literal["named", "any"]


def request_fields(body: ChatCompletionRequest) -> dict[str, object] | HttpError:
    """The request's `tools`, `tool_choice`, `parallel_tool_calls` and `response_format`, as
    the record takes them
    (vLLM's `structured_outputs` and `guided_json` as a `response_format`), or the 400 for
    a guide tokenbus does not take."""
    fields: dict[str, object] = {}
    if body.tools is not None:
        fields["tools"] = [_tool(t) for t in body.tools]
    if body.tool_choice is not None:
        fields["tool_choice"] = _tool_choice(body.tool_choice)
    if body.parallel_tool_calls is not None:
        fields["parallel_tool_calls"] = body.parallel_tool_calls
    guided = _vllm_guide(body)
    if isinstance(guided, HttpError):
        return guided
    if guided is not None and body.response_format is not None:
        return invalid(
            "response_format: give it or vLLM's guided fields, not both", "response_format"
        )
    fmt = guided if guided is not None else body.response_format
    if fmt is not None:
        fields["response_format"] = _response_format(fmt)
    return fields


def _vllm_guide(body: ChatCompletionRequest) -> dict[str, Any] | HttpError | None:
    """vLLM's `guided_json` or `structured_outputs` as a `response_format`; of the
    latter's constraints, `json` and `json_object` (regex, choice, grammar: a 400)."""
    if body.guided_json is not None and body.structured_outputs is not None:
        return invalid("guided_json: give it or structured_outputs, not both", "guided_json")
    schema: object = body.guided_json
    if body.structured_outputs is not None:
        asked = {k for k, v in body.structured_outputs.items() if v not in (None, False)}
        if other := sorted(asked - {"json", "json_object"}):
            return invalid(
                f"structured_outputs: {', '.join(other)} not supported (json and json_object"
                " are, as is response_format)",
                "structured_outputs",
            )
        if "json" not in asked:
            return {"type": "json_object"} if asked else None
        schema = body.structured_outputs["json"]
    if schema is None:
        return None
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError):  # nested past the parser's depth too
            return invalid("guided_json: not a JSON schema (invalid JSON)", "guided_json")
    return {"type": "json_schema", "json_schema": {"name": "guided_json", "schema": schema}}


def message_fields(message: Message) -> dict[str, object]:
    """A message's `tool_calls` and `tool_call_id`, as the record's `ChatMessage` takes them."""
    fields: dict[str, object] = {}
    if message.tool_calls:
        fields["tool_calls"] = [_call(c) for c in message.tool_calls]
    if message.tool_call_id is not None:
        fields["tool_call_id"] = message.tool_call_id
    return fields


def tool_answer(body: ChatCompletionRequest | CompletionRequest) -> ToolAnswer | None:
    """What tool answers `body` may get (its stream then holds the text back)."""
    if not isinstance(body, ChatCompletionRequest) or not body.tools:
        return None
    if body.tool_choice == "none":
        return None
    return "named" if isinstance(body.tool_choice, dict) else "any"


def finish_reason(answer: ToolAnswer | None, finish: str, calls: Sequence[ToolCall]) -> str:
    """The choice's finish_reason: "tool_calls" for an answer that calls tools it chose."""
    if calls and answer == "any" and finish == "stop":
        return "tool_calls"
    return finish


def message_calls(calls: Sequence[ToolCall]) -> list[ToolCallBody]:
    return [
        ToolCallBody(
            id=c.id, function=FunctionCallBody(name=c.function.name, arguments=c.function.arguments)
        )
        for c in calls
    ]


def delta_calls(calls: Sequence[ToolCall]) -> list[ChunkToolCall]:
    return [
        ChunkToolCall(
            index=i,
            id=c.id,
            function=FunctionCallBody(name=c.function.name, arguments=c.function.arguments),
        )
        for i, c in enumerate(calls)
    ]


def _tool(tool: dict[str, Any]) -> object:
    function = tool.get("function")
    if not isinstance(function, dict):
        return tool  # refused by the request's check, naming what is wrong
    known = ("name", "description", "parameters", "strict")
    return {"type": tool.get("type"), "function": {k: function[k] for k in known if k in function}}


def _tool_choice(choice: object) -> object:
    if isinstance(choice, dict) and isinstance(function := choice.get("function"), dict):
        return {"type": choice.get("type"), "function": {"name": function.get("name")}}
    return choice


def _response_format(fmt: dict[str, Any]) -> object:
    schema = fmt.get("json_schema")
    if not isinstance(schema, dict):
        return {k: fmt[k] for k in ("type", "json_schema") if k in fmt}
    known = ("name", "description", "schema", "strict")
    return {"type": fmt.get("type"), "json_schema": {k: schema[k] for k in known if k in schema}}


def _call(call: dict[str, Any]) -> object:
    function = call.get("function")
    if not isinstance(function, dict):
        return call
    arguments = function.get("arguments")
    if not isinstance(arguments, str):  # some clients send the object itself
        arguments = json.dumps(arguments if arguments is not None else {})
    return {
        "id": call.get("id"),
        "type": call.get("type", "function"),
        "function": {"name": function.get("name"), "arguments": arguments},
    }
