"""The vLLM adapter's structured outputs and tool calls, against recording fakes of vLLM's
AsyncLLM, `StructuredOutputsParams` and a tool-call parser (tests/real_engine runs them on
real vLLM with the real model)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from services.worker.engines.base import (
    ChatTurn,
    EngineDelta,
    EngineFinish,
    EngineRequest,
    RequestRefused,
)
from services.worker.engines.vllm import VllmApi, VllmEngine, engine_args
from services.worker.engines.vllm_tools import VllmToolApi
from shared.messages import NamedToolChoice, ResponseFormat, Tool
from tests.test_engine_vllm import (
    DELTA,
    FakeAsyncLLM,
    FakeRequestOutput,
    FakeTokenizer,
    fake_engine_args,
    fake_sampling_params,
    out,
)

WEATHER = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
)


@dataclass(frozen=True)
class FakeStructuredOutputs:
    """Records what `StructuredOutputsParams(...)` was given."""

    json: Any = None
    json_object: bool | None = None


class FakeClientError(ValueError):
    """vLLM's `VLLMClientError`: it refused the request as asked."""


class FakeHermesParser:
    """Reads `<tool_call>{"name", "arguments"}</tool_call>` as vLLM's hermes parser does."""

    def __init__(self, tokenizer: Any, tools: Any = None) -> None:
        self.tools = tools

    def extract_tool_calls(self, text: str, request: Any) -> Any:
        found = re.findall(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL)
        if not found:
            return SimpleNamespace(tools_called=False, tool_calls=[], content=text)
        calls = [
            SimpleNamespace(
                id=f"chatcmpl-tool-{i}",
                function=SimpleNamespace(
                    name=json.loads(f)["name"], arguments=json.dumps(json.loads(f)["arguments"])
                ),
            )
            for i, f in enumerate(found)
        ]
        before = text[: text.find("<tool_call>")]
        return SimpleNamespace(tools_called=True, tool_calls=calls, content=before or None)


def fake_parser(name: str) -> type[FakeHermesParser]:
    if name != "hermes":
        raise KeyError(name)
    return FakeHermesParser


@dataclass
class FakeToolTokenizer(FakeTokenizer):
    """A tokenizer whose template takes tools; it records them and renders only the turns."""

    tools_given: list[Any] = field(default_factory=list)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tokenize: bool,
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        self.tools_given.append(tools)
        self.rendered.append(messages)
        return "<s>" + "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<a>"


class FakeToolLLM(FakeAsyncLLM):
    """The recording AsyncLLM, with a tokenizer whose template takes tools."""

    def __init__(self, args: Any) -> None:
        super().__init__(args)
        self.tokenizer = FakeToolTokenizer()


TOOLS = VllmToolApi(
    FakeStructuredOutputs, fake_parser, lambda **kw: SimpleNamespace(**kw), FakeClientError
)
API = VllmApi(FakeToolLLM, fake_engine_args, fake_sampling_params, DELTA, tools=TOOLS)


async def started(parser: str = "hermes") -> tuple[VllmEngine, FakeAsyncLLM]:
    engine = VllmEngine(
        API, engine_args(API, model="/models/x", max_num_seqs=2), tool_call_parser=parser
    )
    await engine.start()
    return engine, FakeAsyncLLM.instances[-1]


def request(rid: str, **fields: Any) -> EngineRequest:
    return EngineRequest(rid, "user: hi", 16, messages=(ChatTurn("user", "hi"),), **fields)


async def run(engine: VllmEngine, req: EngineRequest) -> list[Any]:
    return [o async for o in engine.generate(req)]


def stream(rid: str, *parts: str) -> list[FakeRequestOutput]:
    outs = [out(rid, p, [7]) for p in parts[:-1]]
    return [*outs, out(rid, parts[-1], [7], "stop")]


async def test_a_named_function_is_guided_and_read_as_one_call() -> None:
    engine, llm = await started()
    llm.script["n-0"] = stream("n-0", '{"city": ', '"Paris"}')
    named = NamedToolChoice.model_validate({"function": {"name": "get_weather"}})
    outputs = await run(engine, request("n", tools=(WEATHER,), tool_choice=named))
    params = llm.generate_calls[0]["sampling_params"]
    assert params["structured_outputs"] == FakeStructuredOutputs(json=WEATHER.function.parameters)
    # The text still streams as generated; the finish carries the call read from it.
    assert [o.text for o in outputs if isinstance(o, EngineDelta)] == ['{"city": ', '"Paris"}']
    finish = outputs[-1]
    assert isinstance(finish, EngineFinish)
    assert finish.tool_calls is not None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in finish.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert finish.content is None
    # Tools reach the template (as vLLM's server passes them).
    assert llm.tokenizer.tools_given[0][0]["function"]["name"] == "get_weather"  # type: ignore[attr-defined]
    await engine.stop()


async def test_required_is_guided_by_the_array_schema() -> None:
    engine, llm = await started()
    llm.script["q-0"] = stream("q-0", '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    outputs = await run(engine, request("q", tools=(WEATHER,), tool_choice="required"))
    guided = llm.generate_calls[0]["sampling_params"]["structured_outputs"]
    schema = guided.json
    assert schema["type"] == "array"
    assert schema["minItems"] == 1
    finish = outputs[-1]
    assert isinstance(finish, EngineFinish)
    assert finish.tool_calls is not None
    assert json.loads(finish.tool_calls[0].function.arguments) == {"city": "Oslo"}
    await engine.stop()


async def test_auto_is_free_and_read_by_the_parser() -> None:
    engine, llm = await started()
    text = 'Looking.<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    llm.script["a-0"] = stream("a-0", text)
    llm.script["b-1"] = stream("b-1", "It is sunny.")
    outputs = await run(engine, request("a", tools=(WEATHER,)))
    assert "structured_outputs" not in llm.generate_calls[0]["sampling_params"]
    finish = outputs[-1]
    assert isinstance(finish, EngineFinish)
    assert finish.tool_calls is not None
    assert finish.tool_calls[0].function.name == "get_weather"
    assert json.loads(finish.tool_calls[0].function.arguments) == {"city": "Rome"}
    assert finish.content == "Looking."
    plain = (await run(engine, request("b", tools=(WEATHER,), tool_choice="auto")))[-1]
    assert plain == EngineFinish("stop", plain.prompt_tokens, 1)  # no call: just text
    await engine.stop()


async def test_response_formats_ask_vllm_for_json() -> None:
    engine, llm = await started()
    llm.script["j-0"] = stream("j-0", "{}")
    llm.script["o-1"] = stream("o-1", "{}")
    fmt = ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}
    )
    finish = (await run(engine, request("j", response_format=fmt)))[-1]
    assert isinstance(finish, EngineFinish)
    assert finish.tool_calls is None  # a format is text, not a call
    assert llm.generate_calls[0]["sampling_params"]["structured_outputs"] == (
        FakeStructuredOutputs(json={"type": "object"})
    )
    await run(engine, request("o", response_format=ResponseFormat(type="json_object")))
    assert llm.generate_calls[1]["sampling_params"]["structured_outputs"] == (
        FakeStructuredOutputs(json_object=True)
    )
    await engine.stop()


async def test_vllm_refusing_a_request_is_the_clients_error() -> None:
    engine, llm = await started()

    async def refuses(*args: Any, **kwargs: Any) -> Any:
        raise FakeClientError("Invalid JSON grammar specification.")
        yield  # pragma: no cover

    llm.generate = refuses  # type: ignore[method-assign]
    fmt = ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "nope"}}}
    )
    with pytest.raises(RequestRefused, match="Invalid JSON grammar"):
        await run(engine, request("x", response_format=fmt))
    await engine.stop()


async def test_an_unknown_parser_fails_the_start_naming_the_setting() -> None:
    engine = VllmEngine(
        API, engine_args(API, model="/models/x", max_num_seqs=2), tool_call_parser="nope"
    )
    before = len(FakeAsyncLLM.instances)
    with pytest.raises(ValueError, match="TOKENBUS_WORKER_TOOL_CALL_PARSER='nope'"):
        await engine.start()
    assert len(FakeAsyncLLM.instances) == before  # refused before the model loads
