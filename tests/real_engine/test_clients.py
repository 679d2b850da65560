"""The clients people put in front of vLLM's OpenAI server, against tokenbus (issue 26).

The real-engine suite's stack (`bus`, tests/real_engine/conftest.py: two vLLM workers
serving SmolLM2-135M-Instruct on vLLM's CPU build, beside the transformers ones). Each
client is the real package, as its users call it: the `openai` SDK, LangChain's
`ChatOpenAI` and LiteLLM (`hosted_vllm/` and `openai/` providers). They are installed into
this suite's environment by `make test` (deploy/vllm/test-requirements.txt).
"""

from __future__ import annotations

import os
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tests.stack import Stack
from tokenbus.local_engine import MAX_MODEL_LEN, MODEL_NAME

# LiteLLM fetches a price list from GitHub at import unless told to use its own copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_Q = "What is the weather like in Paris today? Answer in celsius."


class Weather(BaseModel):
    """What the structured-output tests ask for (bounded, so a small model ends it)."""

    city: str = Field(max_length=24)
    unit: Literal["celsius", "fahrenheit"]


WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": Weather.model_json_schema(),
    },
}

pytestmark = pytest.mark.timeout(600)


def base_url(stack: Stack) -> str:
    return f"{stack.http_url}/v1"


def sdk(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url(stack), api_key=stack.keys["default"], max_retries=0)


# -- the openai SDK ------------------------------------------------------------------------


def test_openai_sdk_chat_completions_and_models(bus: Stack) -> None:
    client = sdk(bus)
    card = client.models.retrieve(MODEL_NAME)
    assert card.id == MODEL_NAME
    assert card.model_dump().get("max_model_len") == MAX_MODEL_LEN
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")

    answer = client.chat.completions.create(
        model=MODEL_NAME, messages=FRANCE, max_tokens=24, temperature=0
    )
    assert "Paris" in (answer.choices[0].message.content or "")
    assert answer.usage is not None
    assert answer.usage.completion_tokens > 0
    assert answer.model == MODEL_NAME

    text = client.completions.create(
        model=MODEL_NAME, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert text.choices[0].text.strip()
    assert text.usage is not None
    assert text.usage.completion_tokens > 0


def test_openai_sdk_streams_with_usage_and_vllm_fields(bus: Stack) -> None:
    client = sdk(bus)
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=FRANCE,
            max_tokens=16,
            stream=True,
            # vLLM's `continuous_usage_stats`, as guidellm streams (issue 42 item 4).
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            # vLLM's extension fields, as `vllm bench serve --ignore-eos` sends them.
            extra_body={"ignore_eos": True, "top_k": 1, "min_tokens": 16},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    usage = [c.usage for c in chunks]
    assert all(u is not None for u in usage), usage
    *so_far, final = [u for u in usage if u is not None]
    assert final.completion_tokens == 16  # ignore_eos ran it to max_tokens
    # vLLM's own counts, chunk by chunk, up to the final's.
    counted = [u.completion_tokens for u in so_far]
    assert counted == sorted(counted)
    assert counted[-1] == 16
    assert {u.prompt_tokens for u in so_far} == {final.prompt_tokens}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_openai_sdk_parses_structured_output_into_a_model(bus: Stack) -> None:
    """`chat.completions.parse` sends a strict json_schema built from a pydantic model."""
    parsed = sdk(bus).chat.completions.parse(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": WEATHER_Q}],
        response_format=Weather,
        max_tokens=96,
        temperature=0,
    )
    weather = parsed.choices[0].message.parsed
    assert isinstance(weather, Weather)
    assert weather.city


# -- LangChain -----------------------------------------------------------------------------


def langchain(stack: Stack, **fields: Any) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=MODEL_NAME,
        base_url=base_url(stack),
        api_key=stack.keys["default"],
        temperature=0,
        max_retries=0,
        **fields,
    )


def test_langchain_invoke_and_stream(bus: Stack) -> None:
    llm = langchain(bus, max_tokens=24)
    message = llm.invoke("What is the capital of France?")
    assert "Paris" in str(message.content)
    assert message.usage_metadata is not None
    assert message.usage_metadata["output_tokens"] > 0

    pieces = [str(chunk.content) for chunk in llm.stream("What is the capital of France?")]
    assert len([p for p in pieces if p]) > 1  # streamed, not one block
    assert "Paris" in "".join(pieces)


def test_langchain_sends_no_max_tokens_by_default_and_is_answered(bus: Stack) -> None:
    """LangChain sends no `max_tokens` unless asked: the answer must still come whole."""
    message = langchain(bus).invoke("Say hello.")
    assert str(message.content).strip()
    assert message.response_metadata.get("finish_reason") in ("stop", "length")


def test_langchain_without_max_tokens_gets_an_answer_longer_than_256_tokens(bus: Stack) -> None:
    """Unset max_tokens is the rest of the context, as vLLM has it (ADR 0051): before, the
    answer was cut at 256 tokens (and min_tokens above 256 was a 400)."""
    # The story goes on to 300 tokens at least, then ends at its next stop string (vLLM
    # checks them only past min_tokens). Left alone at temperature 0, SmolLM2 loops to the end
    # of the context (2,005 tokens, ~100 s on the CPU build); the penalty breaks the loop.
    llm = langchain(
        bus, stop=[".", "\n"], extra_body={"min_tokens": 300, "repetition_penalty": 1.2}
    )
    message = llm.invoke("Write a long story about a bus that travels across the country.")
    usage = message.usage_metadata
    assert usage is not None
    assert usage["output_tokens"] >= 300 > 256
    finish = message.response_metadata.get("finish_reason")
    assert finish in ("stop", "length")
    if finish == "length":  # only at the end of the context
        assert usage["input_tokens"] + usage["output_tokens"] == MAX_MODEL_LEN


def test_max_tokens_above_the_context_is_a_400_as_vllm_answers_it(bus: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(bus).chat.completions.create(
            model=MODEL_NAME,
            messages=FRANCE,
            max_tokens=MAX_MODEL_LEN + 1,  # type: ignore[arg-type]
        )
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in caught.value.message
    assert "max_tokens" in caught.value.message


def test_langchain_bind_tools_and_with_structured_output(bus: Stack) -> None:
    llm = langchain(bus, max_tokens=96)
    called = llm.bind_tools([WEATHER_TOOL], tool_choice="get_weather").invoke(WEATHER_Q)
    assert len(called.tool_calls) == 1
    call = called.tool_calls[0]
    assert call["name"] == "get_weather"
    Weather.model_validate(call["args"])  # an object valid against the tool's schema

    # langchain-openai's default method: a json_schema response_format, guided by vLLM.
    structured = llm.with_structured_output(Weather).invoke(WEATHER_Q)
    assert isinstance(structured, Weather)


# -- LiteLLM -------------------------------------------------------------------------------


@pytest.mark.parametrize("provider", ["hosted_vllm", "openai"])
def test_litellm_completion_and_stream(bus: Stack, provider: str) -> None:
    import litellm

    common: dict[str, Any] = {
        "model": f"{provider}/{MODEL_NAME}",
        "api_base": base_url(bus),
        "api_key": bus.keys["default"],
        "messages": FRANCE,
        "max_tokens": 24,
        "temperature": 0,
        "num_retries": 0,
    }
    answer = litellm.completion(**common)
    assert "Paris" in (answer.choices[0].message.content or "")
    assert answer.usage.completion_tokens > 0

    chunks = list(litellm.completion(**common, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
