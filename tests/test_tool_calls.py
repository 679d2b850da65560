"""Tools and structured outputs, the pure parts: OpenAI bodies to request fields, the guide
of an answer (vLLM's schemas), tool calls read back and shown in OpenAI's shapes, and the
refusal by engines that cannot guide (sim, transformers)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.edge.capabilities import unhonoured
from services.edge.openai.errors import HttpError
from services.edge.openai.sse import DONE
from services.edge.openai.translate import Answer, Identity, SseStream
from services.edge.protocol import DeltaFrame, DoneFrame, ResetFrame
from services.worker.engines.base import (
    ChatTurn,
    EngineRequest,
    FieldNotHonoured,
    check_sampling,
)
from services.worker.engines.sim import SimEngine
from services.worker.engines.structured import (
    NO_CALLS,
    Guide,
    guide,
    guided_calls,
    required_schema,
    template_messages,
)
from services.worker.engines.vllm import VllmEngine
from services.worker.runner import engine_request
from shared.messages import (
    Capabilities,
    ChatMessage,
    ChatRequest,
    DoneResult,
    FunctionCall,
    QueuedRequest,
    ReplyTo,
    ResponseFormat,
    Tier,
    Timings,
    Tool,
    ToolCall,
    Usage,
)
from tests.chat_client import sse_data
from tests.factories import openai_chat, translated

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
    "required": ["city"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": WEATHER_SCHEMA,
        "x-extra": "ignored",
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def refused(result: ChatRequest | HttpError, *words: str) -> str:
    assert isinstance(result, HttpError), result
    assert result.status == 400
    message = result.body.error.message
    for word in words:
        assert word in message, message
    return message


def record_tool(tool: dict[str, Any]) -> Tool:
    """A tool as the request record holds it (a client's extra keys left out)."""
    function = {k: v for k, v in tool["function"].items() if not k.startswith("x-")}
    return Tool.model_validate({**tool, "function": function})


def engine_req(**fields: Any) -> EngineRequest:
    tools = fields.pop("tools", None)
    return EngineRequest(
        "r",
        "user: hi",
        16,
        tools=None if tools is None else tuple(record_tool(t) for t in tools),
        **fields,
    )


def call(name: str, arguments: str, id_: str = "call_1") -> ToolCall:
    return ToolCall(id=id_, function=FunctionCall(name=name, arguments=arguments))


# -- OpenAI bodies to request fields ---------------------------------------------------------


def test_tools_tool_choice_and_response_format_reach_the_request() -> None:
    request = translated(openai_chat(tools=[WEATHER, TIME], tool_choice=NAMED))
    assert [t.function.name for t in request.tools or ()] == ["get_weather", "get_time"]
    assert request.tools is not None
    assert request.tools[0].function.parameters == WEATHER_SCHEMA
    assert request.tool_choice is not None
    assert request.tool_choice != "auto"
    assert request.sampling_needs() == {"tools"}
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER_SCHEMA}}
    request = translated(openai_chat(response_format=fmt))
    assert request.response_format is not None
    assert request.response_format.json_schema
    assert request.response_format.json_schema.json_schema == WEATHER_SCHEMA
    assert request.sampling_needs() == {"response_format"}
    assert translated(openai_chat(response_format={"type": "json_object"})).sampling_needs() == {
        "response_format"
    }


def test_what_asks_nothing_of_the_engine() -> None:
    assert translated(openai_chat(response_format={"type": "text"})).sampling_needs() == frozenset()
    assert (
        translated(openai_chat(tools=[WEATHER], tool_choice="none")).sampling_needs() == frozenset()
    )
    default = translated(openai_chat(tools=[WEATHER]))  # tools without a choice: auto, as OpenAI
    assert default.tool_choice_in_effect == "auto"
    assert default.sampling_needs() == {"tools"}
    assert translated(openai_chat()).tool_choice_in_effect == "none"


def test_bad_tool_requests_are_400s_naming_the_field() -> None:
    refused(openai_chat(tool_choice="required"), "tool_choice", "needs `tools`")
    missing = {"type": "function", "function": {"name": "nope"}}
    refused(openai_chat(tools=[WEATHER], tool_choice=missing), "tool_choice", "'nope' is not in")
    refused(openai_chat(tools=[{"type": "function", "function": {}}]), "tools")
    refused(openai_chat(response_format={"type": "json_schema"}), "response_format")
    refused(openai_chat(response_format={"type": "yaml"}), "response_format")
    both = {"type": "json_object"}
    refused(
        openai_chat(tools=[WEATHER], tool_choice="required", response_format=both),
        "response_format",
        "cannot be combined",
    )
    # Auto may still answer in the format asked.
    translated(openai_chat(tools=[WEATHER], tool_choice="auto", response_format=both))


def test_vllms_guided_fields_are_a_response_format() -> None:
    fmt = translated(openai_chat(guided_json=WEATHER_SCHEMA)).response_format
    assert fmt is not None
    assert fmt.json_schema is not None
    assert fmt.json_schema.json_schema == WEATHER_SCHEMA
    fmt = translated(openai_chat(guided_json=json.dumps(WEATHER_SCHEMA))).response_format
    assert fmt is not None
    assert fmt.json_schema is not None
    assert fmt.json_schema.json_schema == WEATHER_SCHEMA
    fmt = translated(openai_chat(structured_outputs={"json": WEATHER_SCHEMA})).response_format
    assert fmt is not None
    assert fmt.json_schema is not None
    assert fmt.json_schema.json_schema == WEATHER_SCHEMA
    fmt = translated(openai_chat(structured_outputs={"json_object": True})).response_format
    assert fmt == ResponseFormat(type="json_object")
    refused(
        openai_chat(structured_outputs={"regex": "a+"}), "structured_outputs: regex not supported"
    )
    refused(openai_chat(guided_json="{nope"), "guided_json", "invalid JSON")
    refused(
        openai_chat(guided_json=WEATHER_SCHEMA, response_format={"type": "json_object"}),
        "not both",
    )


def test_a_conversation_with_calls_and_results_keeps_them() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    request = translated(openai_chat(messages=messages, tools=[WEATHER]))
    assert request.messages is not None
    assistant, tool = request.messages[1], request.messages[2]
    assert assistant.content == ""
    assert assistant.tool_calls == [call("get_weather", '{"city": "Paris"}')]
    assert tool.tool_call_id == "call_1"
    # The bound a request is charged counts the tools and calls a template may render.
    bare = [{k: v for k, v in m.items() if k in ("role", "content")} for m in messages]
    plain = translated(openai_chat(messages=bare))
    rendered_extra = len(json.dumps(WEATHER_SCHEMA)) + len('{"city": "Paris"}')
    assert request.prompt_token_bound() - plain.prompt_token_bound() > rendered_extra


def test_only_an_assistant_carries_tool_calls() -> None:
    with pytest.raises(ValueError, match="only an assistant"):
        ChatMessage(role="user", content="x", tool_calls=[call("f", "{}")])


def test_records_without_tools_hold_no_new_keys() -> None:
    """A reader from before tools (its models forbid unknown keys) still reads them."""
    record = translated(openai_chat()).model_dump(mode="json")
    assert not {"tools", "tool_choice", "response_format"} & set(record)
    assert set(record["messages"][0]) == {"role", "content"}
    done = DoneResult(
        request_id="r",
        seq=1,
        finish_reason="stop",
        usage=Usage(prompt_tokens=1, completion_tokens=1),
        timings=Timings(queue_ms=0, batch_size=1, ttft_ms=0, total_ms=0),
    )
    assert not {"tool_calls", "content"} & set(done.model_dump(mode="json"))


def test_tool_requests_are_not_cached() -> None:
    assert translated(openai_chat(temperature=0)).cacheable
    assert not translated(openai_chat(temperature=0, tools=[WEATHER], tool_choice="none")).cacheable
    assert not translated(
        openai_chat(temperature=0, response_format={"type": "json_object"})
    ).cacheable


def test_the_worker_hands_the_engine_tools_and_turns() -> None:
    record = translated(
        openai_chat(
            messages=[
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"id": "c", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}
                    ],
                },
                {"role": "tool", "content": "12:00", "tool_call_id": "c"},
            ],
            tools=[WEATHER, TIME],
            tool_choice="required",
        )
    )
    queued = QueuedRequest.model_validate(
        {
            **record.model_dump(),
            "request_id": "r",
            "tier": Tier.interactive,
            "prompt_tokens": 1,
            "reply_to": ReplyTo(topic="t"),
        }
    )
    request = engine_request(queued)
    assert request.tool_choice == "required"
    assert [t.function.name for t in request.tools or ()] == ["get_weather", "get_time"]
    assert request.messages is not None
    assert request.messages[1].tool_calls == (call("get_time", '{"tz": "UTC"}', "c"),)
    assert request.messages[2].tool_call_id == "c"


# -- the answer's guide, as vLLM's server builds it ------------------------------------------


def test_a_named_function_is_guided_by_its_parameters() -> None:
    assert guide(engine_req(tools=[WEATHER, TIME])) is None  # auto: free, a parser reads it
    named = translated(openai_chat(tools=[WEATHER, TIME], tool_choice=NAMED))
    assert guide(engine_req(tools=[WEATHER, TIME], tool_choice=named.tool_choice)) == Guide(
        json=WEATHER_SCHEMA
    )
    by_time = translated(
        openai_chat(
            tools=[TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}
        )
    )
    # No parameters: still a JSON object (vLLM's `_params_or_empty_object`).
    assert guide(engine_req(tools=[TIME], tool_choice=by_time.tool_choice)) == Guide(
        json={"type": "object", "properties": {}}
    )


def test_required_is_an_array_of_calls_of_the_tools() -> None:
    schema = required_schema([record_tool(t) for t in (WEATHER, TIME)])
    assert schema == {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": ["get_weather"]},
                        "parameters": WEATHER_SCHEMA,
                    },
                    "required": ["name", "parameters"],
                },
                {
                    "properties": {
                        "name": {"type": "string", "enum": ["get_time"]},
                        "parameters": {"type": "object", "properties": {}},
                    },
                    "required": ["name", "parameters"],
                },
            ],
        },
    }
    assert guide(engine_req(tools=[WEATHER, TIME], tool_choice="required")) == Guide(json=schema)


def test_parallel_tool_calls_false_allows_one_call() -> None:
    request = translated(
        openai_chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    )
    assert request.parallel_tool_calls is False
    one = guide(engine_req(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False))
    assert one is not None
    assert one.json is not None
    assert one.json["maxItems"] == 1
    many = guide(engine_req(tools=[WEATHER], tool_choice="required", parallel_tool_calls=True))
    assert many is not None
    assert many.json is not None
    assert "maxItems" not in many.json  # as vLLM: only an explicit false bounds it


def test_required_gathers_each_tools_defs_at_the_top() -> None:
    point = {"type": "object", "properties": {"x": {"type": "number"}}}
    with_defs = {
        "type": "function",
        "function": {
            "name": "move",
            "parameters": {
                "type": "object",
                "properties": {"to": {"$ref": "#/$defs/Point"}},
                "$defs": {"Point": point},
            },
        },
    }
    schema = required_schema([Tool.model_validate(with_defs)])
    assert schema["$defs"] == {"Point": point}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    other = json.loads(json.dumps(with_defs))
    other["function"]["name"] = "jump"
    other["function"]["parameters"]["$defs"]["Point"] = {"type": "string"}
    with pytest.raises(ValueError, match="Point"):
        required_schema([Tool.model_validate(with_defs), Tool.model_validate(other)])


def test_response_formats_guide_to_json() -> None:
    fmt = translated(openai_chat(response_format={"type": "json_object"})).response_format
    assert guide(engine_req(response_format=fmt)) == Guide(json_object=True)
    fmt = translated(
        openai_chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "w", "schema": WEATHER_SCHEMA},
            }
        )
    ).response_format
    assert guide(engine_req(response_format=fmt)) == Guide(json=WEATHER_SCHEMA)
    fmt = translated(openai_chat(response_format={"type": "text"})).response_format
    assert guide(engine_req(response_format=fmt)) is None
    assert guide(engine_req()) is None


# -- guided answers read back ----------------------------------------------------------------


def test_a_named_answer_is_one_call_with_an_object() -> None:
    named = translated(openai_chat(tools=[WEATHER], tool_choice=NAMED)).tool_choice
    request = engine_req(tools=[WEATHER], tool_choice=named)
    parsed = guided_calls(request, '{ "city" : "Paris" }')
    assert parsed.content is None
    assert parsed.tool_calls is not None
    (only,) = parsed.tool_calls
    assert only.function.name == "get_weather"
    assert json.loads(only.function.arguments) == {"city": "Paris"}
    assert only.id.startswith("chatcmpl-tool-")
    assert guided_calls(request, '{"city": "Par') == NO_CALLS  # cut by max_tokens
    assert guided_calls(request, '"Paris"') == NO_CALLS  # not an object: no call


def test_a_required_answer_is_its_calls_in_order() -> None:
    request = engine_req(tools=[WEATHER, TIME], tool_choice="required")
    text = (
        '[{"name": "get_time", "parameters": {}},'
        ' {"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    )
    parsed = guided_calls(request, text)
    assert parsed.tool_calls is not None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.tool_calls] == [
        ("get_time", {}),
        ("get_weather", {"city": "Oslo"}),
    ]
    assert len({c.id for c in parsed.tool_calls}) == 2
    assert guided_calls(request, "[]") == NO_CALLS


def test_the_template_gets_call_arguments_as_objects() -> None:
    turns = (
        ChatTurn("user", "hi"),
        ChatTurn("assistant", "", (call("get_weather", '{"city": "Paris"}'),)),
        ChatTurn("tool", "sunny", tool_call_id="call_1"),
        ChatTurn("assistant", "", (call("get_time", "not json"),)),
    )
    rendered = template_messages(turns)
    assert rendered[0] == {"role": "user", "content": "hi"}
    assert rendered[1]["tool_calls"] == [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
        }
    ]
    assert rendered[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert rendered[3]["tool_calls"][0]["function"]["arguments"] == {}  # as vLLM coerces it


# -- engines that cannot guide refuse ----------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {"tools": [WEATHER]},
        {"tools": [WEATHER], "tool_choice": "required"},
        {"response_format": {"type": "json_object"}},
    ],
)
def test_sim_refuses_tools_and_json_formats(fields: dict[str, Any]) -> None:
    request = translated(openai_chat(**fields))
    field = "tools" if "tools" in fields else "response_format"
    # The transformers engine (torch is not in this env) is refused by name in
    # tests/real_engine/test_bus.py.
    for name, honoured in (("sim", SimEngine.sampling_fields),):
        sim = Capabilities(engine=name, sampling=honoured)
        why = unhonoured(request, [sim])
        assert why is not None
        assert why.startswith(f"{field}: not supported")
        assert name in why
        engine_side = engine_req(
            tools=fields.get("tools"),
            tool_choice=request.tool_choice,
            response_format=request.response_format,
        )
        with pytest.raises(FieldNotHonoured, match=f"^{field}: .*\\({name}\\)"):
            check_sampling(engine_side, name, honoured)
    vllm = Capabilities(engine="vllm", sampling=VllmEngine.sampling_fields)
    assert unhonoured(request, [vllm]) is None


def test_tools_with_tool_choice_none_run_anywhere() -> None:
    request = translated(openai_chat(tools=[WEATHER], tool_choice="none"))
    sim = Capabilities(engine="sim", sampling=SimEngine.sampling_fields)
    assert unhonoured(request, [sim]) is None
    check_sampling(
        engine_req(tools=[WEATHER], tool_choice="none"), "sim", SimEngine.sampling_fields
    )


# -- the answer in OpenAI's shapes -------------------------------------------------------------

USAGE = Usage(prompt_tokens=3, completion_tokens=5)
TIMINGS = Timings(queue_ms=1, batch_size=1, ttft_ms=2, total_ms=3)
CALL = call("get_weather", '{"city": "Paris"}')


def done(calls: list[ToolCall] | None, content: str | None = None) -> DoneFrame:
    return DoneFrame(
        request_id="r1",
        finish_reason="stop",
        usage=USAGE,
        timings=TIMINGS,
        tool_calls=calls,
        content=content,
    )


def ident(tools: Any) -> Identity:
    return Identity("chat", "r1", "m", 1700000000, tools=tools)


def test_a_whole_answer_carries_its_calls() -> None:
    answer = Answer(ident("any"))
    answer.take(DeltaFrame(request_id="r1", seq=0, text='<tool_call>{"name": ...}'))
    answer.take(done([CALL]))
    body = answer.result
    assert body is not None
    assert not isinstance(body, HttpError)
    dumped = body.model_dump()
    choice = dumped["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    }
    named = Answer(ident("named"))
    named.take(done([CALL]))
    assert named.result is not None
    assert not isinstance(named.result, HttpError)
    assert named.result.model_dump()["choices"][0]["finish_reason"] == "stop"  # as OpenAI


def test_an_answer_that_calls_nothing_is_text() -> None:
    answer = Answer(ident("any"))
    answer.take(DeltaFrame(request_id="r1", seq=0, text="It is sunny."))
    answer.take(done(None))
    assert answer.result is not None
    assert not isinstance(answer.result, HttpError)
    choice = answer.result.model_dump()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "It is sunny."}
    assert choice["finish_reason"] == "stop"


def test_a_stream_holds_the_text_and_ends_with_the_calls() -> None:
    sse = SseStream(ident("any"), include_usage=True)
    opened = sse.take(DeltaFrame(request_id="r1", seq=0, text="<tool_call>"))
    assert [e["choices"][0]["delta"] for e in sse_data(opened)] == [
        {"role": "assistant", "content": ""}
    ]
    assert sse.take(DeltaFrame(request_id="r1", seq=1, text="{...}</tool_call>")) == []
    ending = sse.take(done([CALL, call("get_time", "{}", "call_2")], content="Let me look."))
    assert ending[-1] == DONE
    got = sse_data(ending)
    assert got[0]["choices"][0]["delta"] == {"role": None, "content": "Let me look."}
    assert got[1]["choices"][0]["delta"] == {
        "role": None,
        "content": None,
        "tool_calls": [
            {
                "index": 0,
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "index": 1,
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_time", "arguments": "{}"},
            },
        ],
    }
    assert got[2]["choices"][0]["finish_reason"] == "tool_calls"
    assert got[3]["usage"]["completion_tokens"] == 5
    assert "id: 0:1" in ending[0].decode()  # the events stand after the last delta


def test_a_held_stream_that_calls_nothing_sends_its_text_at_the_end() -> None:
    sse = SseStream(ident("any"), include_usage=False)
    sse.take(DeltaFrame(request_id="r1", seq=0, text="old"))
    assert sse.take(ResetFrame(request_id="r1", attempt=1)) == []  # nothing shown: restarts
    sse.take(DeltaFrame(request_id="r1", seq=0, text="It is "))
    sse.take(DeltaFrame(request_id="r1", seq=1, text="sunny."))
    got = sse_data(sse.take(done(None)))
    assert [e["choices"][0]["delta"].get("content") for e in got] == ["It is sunny.", None]
    assert got[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_request_without_tools_streams_as_before() -> None:
    sse = SseStream(ident(None), include_usage=False)
    got = sse_data(sse.take(DeltaFrame(request_id="r1", seq=0, text="hi")))
    assert [e["choices"][0]["delta"].get("content") for e in got] == ["", "hi"]
    assert "tool_calls" not in got[1]["choices"][0]["delta"]


@pytest.mark.parametrize(
    ("fields", "guided"),
    [
        ({}, False),
        ({"tools": [WEATHER]}, False),  # auto: parsed after, not guided
        ({"tools": [WEATHER], "tool_choice": "none"}, False),
        ({"tools": [WEATHER], "tool_choice": "required"}, True),
        ({"tools": [WEATHER], "tool_choice": NAMED}, True),
        ({"response_format": {"type": "text"}}, False),
        ({"response_format": {"type": "json_object"}}, True),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "w", "schema": WEATHER_SCHEMA},
                }
            },
            True,
        ),
    ],
)
def test_a_request_is_guided_where_the_engine_compiles_a_grammar_for_it(
    fields: dict[str, Any], guided: bool
) -> None:
    """What the tenant's `guided` places count (issue 37, N2)."""
    assert translated(openai_chat(**fields)).guided is guided
