"""Structured outputs and tool calls for an engine with guided decoding (the vLLM engine).

Pure, and free of vLLM, so each rule is tested with plain values:
- `guide`: what a request's answer is guided to, as vLLM's own server decides it (its
  `ToolParser.adjust_request` and `get_json_schema_from_tools`, `vllm/tool_parsers/`): a
  named function's `parameters` schema; for `required`, a non-empty array of
  `{name, parameters}` objects, one schema per tool (anyOf); else the `response_format`'s
  schema, or any JSON object. The tool schemas are built here rather than by vLLM's
  function, which takes its server's own request types; tests/real_engine checks that they
  equal vLLM's.
- `guided_calls`: a guided answer read back as tool calls. vLLM's server passes a named
  function's raw text on as `arguments`; here it is parsed and written again, so the
  arguments are always one JSON object (the schema's), or there is no call at all when the
  answer is not one (cut by max_tokens): the text is then the answer, as without tools.
- `template_messages` and `template_tools`: the conversation and tools as a chat template
  reads them, with a call's arguments as an object, as vLLM renders them
  (`_postprocess_messages` in `vllm/renderers/chat_utils.py`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from services.worker.engines.base import ChatTurn, EngineRequest
from shared.messages import FunctionCall, NamedToolChoice, Tool, ToolCall

# How a request uses its tools: "named" and "required" answers are guided JSON; "auto"
# answers are free text a tool parser reads; "none" calls nothing.
ToolMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class Guide:
    """What an answer is guided to: JSON valid against `json` (a schema), or, with
    `json_object`, any JSON object."""

    json: dict[str, Any] | None = None
    json_object: bool = False


@dataclass(frozen=True)
class ParsedCalls:
    """An answer read as tool calls: the calls and the text besides them (None: none); with
    no calls (`NO_CALLS`), the answer's text is its content, as without tools."""

    tool_calls: tuple[ToolCall, ...] | None
    content: str | None


NO_CALLS = ParsedCalls(None, None)


def tool_mode(request: EngineRequest) -> ToolMode:
    if not request.tools:
        return "none"
    choice = request.tool_choice if request.tool_choice is not None else "auto"
    return "named" if isinstance(choice, NamedToolChoice) else choice


def guide(request: EngineRequest) -> Guide | None:
    """The guide of `request`'s answer; None: free text."""
    mode = tool_mode(request)
    tools = request.tools or ()
    if mode == "named" and isinstance(request.tool_choice, NamedToolChoice):
        return Guide(json=_parameters(_named(tools, request.tool_choice.function.name)))
    if mode == "required":
        return Guide(json=required_schema(tools, parallel=request.parallel_tool_calls))
    fmt = request.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        return Guide(json_object=True)
    return Guide(json=fmt.json_schema.json_schema)


def required_schema(tools: Sequence[Tool], *, parallel: bool | None = None) -> dict[str, Any]:
    """The schema of a `required` answer: one or more calls (one at most with `parallel`
    false), each `{"name": <a tool>, "parameters": <its arguments>}` (vLLM's
    `_get_json_schema_from_tools`, with each tool's `$defs` gathered at the top)."""
    defs: dict[str, Any] = {}
    variants = []
    for tool in tools:
        params = dict(_parameters(tool))
        for name, shared in dict(params.pop("$defs", None) or {}).items():
            if defs.setdefault(name, shared) != shared:
                raise ValueError(
                    f"tools: `$defs` {name!r} has different schemas in different tools"
                )
        variants.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": params,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": variants},
    }
    if parallel is False:  # only an explicit false: unset, parallel calls are allowed
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def guided_calls(request: EngineRequest, text: str) -> ParsedCalls:
    """A named or `required` answer (guided JSON) as tool calls; text that is not the
    guided JSON (cut short) calls nothing."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # nested past the parser's depth: not the guided JSON
        return NO_CALLS
    if tool_mode(request) == "named" and isinstance(request.tool_choice, NamedToolChoice):
        if not isinstance(value, dict):
            return NO_CALLS
        return ParsedCalls((_call(request.tool_choice.function.name, value),), None)
    if not isinstance(value, list) or not value:
        return NO_CALLS
    calls = []
    for item in value:
        if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
            return NO_CALLS
        calls.append(_call(item["name"], item.get("parameters") or {}))
    return ParsedCalls(tuple(calls), None)


def new_call_id() -> str:
    """A tool call's id, as vLLM makes them (`make_tool_call_id`)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def template_messages(turns: Sequence[ChatTurn]) -> list[dict[str, Any]]:
    """The conversation as `apply_chat_template` takes it: an assistant's calls with their
    arguments as objects (arguments that are not an object's JSON become `{}`, as in vLLM),
    a tool's message with the id of the call it answers."""
    out: list[dict[str, Any]] = []
    for turn in turns:
        message: dict[str, Any] = {"role": turn.role, "content": turn.content}
        if turn.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": c.type,
                    "function": {"name": c.function.name, "arguments": _object(c.function)},
                }
                for c in turn.tool_calls
            ]
        if turn.tool_call_id is not None:
            message["tool_call_id"] = turn.tool_call_id
        out.append(message)
    return out


def template_tools(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """The tools as `apply_chat_template(tools=)` takes them (OpenAI's shape)."""
    return [t.model_dump(mode="json", exclude_none=True) for t in tools]


def _call(name: str, arguments: object) -> ToolCall:
    text = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=text))


def _named(tools: Sequence[Tool], name: str) -> Tool:
    for tool in tools:
        if tool.function.name == name:
            return tool
    raise ValueError(f"tool_choice: function {name!r} is not in `tools`")


def _parameters(tool: Tool) -> dict[str, Any]:
    """A tool's arguments schema; none given still means a JSON object (as vLLM)."""
    return tool.function.parameters or {"type": "object", "properties": {}}


def _object(function: FunctionCall) -> dict[str, Any]:
    try:
        value: object = json.loads(function.arguments) if function.arguments else {}
    except (ValueError, RecursionError):  # a tenant's arguments nested past the parser's depth
        return {}
    return dict(value) if isinstance(value, dict) else {}
