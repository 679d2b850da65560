"""Structured outputs and tool calls on the vLLM engine, through vLLM's own parts.

A request's guide (`structured.py`) becomes vLLM's
`SamplingParams(structured_outputs=StructuredOutputsParams(json=<schema>))` (or
`json_object=True`), so the engine core's structured-output backend guides the answer
(llguidance unless `TOKENBUS_WORKER_STRUCTURED_OUTPUTS_BACKEND` names another, ADR 0069;
it runs on CPU too). An answer to `tool_choice: auto` is
read by vLLM's tool-call parser named by `TOKENBUS_WORKER_TOOL_CALL_PARSER` (its
`ToolParserManager`, `--tool-call-parser`'s names), as vLLM's server reads a whole answer
(`extract_tool_calls`); a guided answer (named, `required`) by `structured.guided_calls`.
vLLM is imported only by `load_vllm_tools`, so this module imports without it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.worker.engines.base import EngineRequest
from services.worker.engines.structured import (
    NO_CALLS,
    ParsedCalls,
    guide,
    guided_calls,
    new_call_id,
    template_tools,
    tool_mode,
)
from shared.messages import FunctionCall, ToolCall


@dataclass(frozen=True)
class VllmToolApi:
    """The vLLM names used for structured outputs and tool calls (or a test's fakes)."""

    structured_outputs: Callable[..., Any]  # vllm.sampling_params.StructuredOutputsParams
    tool_parser: Callable[[str], Any]  # ToolParserManager.get_tool_parser: name -> class
    chat_request: Callable[..., Any]  # vLLM's ChatCompletionRequest, which parsers read
    client_error: type[Exception]  # VLLMClientError: vLLM refused the request as asked


def load_vllm_tools() -> VllmToolApi:
    """Import vLLM's parts; raises ImportError where it is not installed."""
    from vllm.entrypoints.openai.chat_completion.protocol import (  # type: ignore[import-not-found,unused-ignore]
        ChatCompletionRequest,
    )
    from vllm.exceptions import (  # type: ignore[import-not-found,unused-ignore]
        VLLMClientError,
    )
    from vllm.sampling_params import (  # type: ignore[import-not-found,unused-ignore]
        StructuredOutputsParams,
    )
    from vllm.tool_parsers import (  # type: ignore[import-not-found,unused-ignore]
        ToolParserManager,
    )

    return VllmToolApi(
        StructuredOutputsParams,
        ToolParserManager.get_tool_parser,
        ChatCompletionRequest,
        VLLMClientError,
    )


def structured_outputs(api: VllmToolApi | None, request: EngineRequest) -> Any | None:
    """The request's `StructuredOutputsParams`; None for a free answer."""
    found = guide(request)
    if found is None:
        return None
    if api is None:
        raise RuntimeError("structured outputs need vLLM's StructuredOutputsParams")
    if found.json_object:
        return api.structured_outputs(json_object=True)
    return api.structured_outputs(json=found.json)


def tool_parser(api: VllmToolApi, name: str) -> Any:
    """vLLM's tool-call parser class `name`; an unknown name is a `ValueError` naming the
    setting (the worker fails at start, before it loads the model)."""
    try:
        return api.tool_parser(name)
    except KeyError as exc:
        raise ValueError(
            f"TOKENBUS_WORKER_TOOL_CALL_PARSER={name!r}: not one of vLLM's tool-call parsers"
            " (its --tool-call-parser names, e.g. hermes)"
        ) from exc


class ToolCallReader:
    """Reads a whole answer's tool calls: guided ones by `structured.guided_calls`, answers
    to `auto` by vLLM's tool-call parser (`parser`, a class of `tool_parser`)."""

    def __init__(self, api: VllmToolApi, parser: Any, tokenizer: Any) -> None:
        self._api = api
        self._parser = parser
        self._tokenizer = tokenizer

    def read(self, request: EngineRequest, text: str) -> ParsedCalls:
        mode = tool_mode(request)
        if mode == "none":
            return NO_CALLS
        if mode != "auto":
            return guided_calls(request, text)
        tools = template_tools(request.tools or ())
        asked = self._api.chat_request(
            model="tokenbus",
            messages=[{"role": "user", "content": ""}],
            tools=tools,
            tool_choice="auto",
        )
        found = self._parser(self._tokenizer, asked.tools).extract_tool_calls(text, asked)
        if not found.tools_called or not found.tool_calls:
            return NO_CALLS
        # Only the tools the request offered: a call the model made up (or that text the
        # tenant steered names) is not passed on as a call the client never defined.
        offered = {t.function.name for t in request.tools or ()}
        calls = tuple(
            ToolCall(
                id=c.id or new_call_id(),
                function=FunctionCall(name=c.function.name, arguments=c.function.arguments),
            )
            for c in found.tool_calls
            if c.function.name in offered
        )
        if not calls:
            return NO_CALLS
        if request.parallel_tool_calls is False:  # one call at most, as asked
            calls = calls[:1]
        return ParsedCalls(calls, found.content or None)
