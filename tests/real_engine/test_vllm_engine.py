"""The vLLM adapter on real vLLM (the CPU build) with the real model, in this process.

One engine with a single sequence slot, so vLLM keeps a queue: what it runs next shows
its priority order, and when it starts the next shows that an abort freed the slot.
It is loaded once for the module (issue 36), on the module's event loop (`ON_THE_ENGINES_LOOP`
on every test that uses it); after each test whatever it left running is aborted and the
engine is idle again (`one_slot`).
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from deploy import test_ledger
from services.worker.engines.base import ChatTurn, EngineDelta, EngineFinish, EngineRequest
from services.worker.engines.structured import required_schema
from services.worker.engines.vllm import (
    VllmEngine,
    engine_args,
    load_vllm,
    prompt_token_ids,
    sampling_params,
)
from services.worker.engines.vllm_tools import ToolCallReader, tool_parser
from shared.messages import NamedToolChoice, ResponseFormat, Tool
from shared.prefixes import cache_salt
from tests.worst_schema import worst_schema
from tokenbus.local_engine import DTYPE, KV_CACHE_GIB, MAX_MODEL_LEN, LocalEngine

pytestmark = [
    # vLLM's environment and its processes (importing vLLM starts one): not the unit tier.
    pytest.mark.integration,
    pytest.mark.timeout(600),
    # vLLM's own imports warn (deprecations in its dependencies); not this project's.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


# The engine's loop lives as long as the module: its tests run on it.
ON_THE_ENGINES_LOOP = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(local_engine: LocalEngine) -> AsyncIterator[VllmEngine]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CPU_KVCACHE_SPACE", str(KV_CACHE_GIB))
        api = load_vllm()
        args = engine_args(
            api,
            model=str(local_engine.model_path),
            max_num_seqs=1,
            dtype=DTYPE,
            max_model_len=MAX_MODEL_LEN,
            enforce_eager=True,
        )
        loaded = VllmEngine(api, args)
        test_ledger.note(test_ledger.VLLM_LOAD, where="test_vllm_engine")
        await loaded.start()
    try:
        yield loaded
    finally:
        await loaded.stop()  # vLLM's output handler task ended too (VllmEngine.stop)
        del loaded
        # What the engine client leaves to the collector is collected here, while this
        # module's loop runs: not in the next module's first test (stop 47's clean clone).
        gc.collect()


@pytest_asyncio.fixture(loop_scope="module")
async def one_slot(engine: VllmEngine) -> AsyncIterator[VllmEngine]:
    """The module's engine, idle: after the test, what it left running is aborted."""
    try:
        yield engine
    finally:
        for request_id in engine.in_flight():
            await engine.abort(request_id)
        await until(lambda: not engine.in_flight(), "the engine idle after the test")


def turn(rid: str, text: str, max_tokens: int, priority: int) -> EngineRequest:
    return EngineRequest(
        rid,
        text,
        max_tokens,
        temperature=0.0,
        priority=priority,
        messages=(ChatTurn("user", text),),
    )


@ON_THE_ENGINES_LOOP
async def test_priority_and_abort_inside_vllm(one_slot: VllmEngine) -> None:
    """f. With one slot taken, a background request (priority 1) waits in vLLM; an
    interactive one (0) sent after it runs first. d. Aborting the running request frees
    vLLM's slot: the next request starts, and the time from abort to its first token is
    printed (cancel to free slot, a prefill included)."""
    engine = one_slot
    firsts: list[tuple[str, float]] = []

    async def run(request: EngineRequest) -> list[object]:
        outputs: list[object] = []
        async for out in engine.generate(request):
            if not outputs:
                firsts.append((request.request_id, time.monotonic()))
            outputs.append(out)
        return outputs

    running = asyncio.create_task(run(turn("a", "Write a long story about a bus.", 1500, 1)))
    await until(lambda: bool(firsts), "the first request's first token")
    background = asyncio.create_task(run(turn("b", "Name a fruit.", 8, 1)))
    await waiting_in_vllm(engine, 1)  # b is in vLLM's queue before c is sent
    interactive = asyncio.create_task(run(turn("c", "Name a colour.", 8, 0)))
    await waiting_in_vllm(engine, 2)
    assert [rid for rid, _ in firsts] == ["a"], "the one slot was not held by the first"
    aborted_at = time.monotonic()
    assert await engine.abort("a")
    a_out = await running
    c_out, b_out = await interactive, await background
    assert isinstance(a_out[-1], EngineFinish)
    assert a_out[-1].finish_reason == "cancelled"
    order = [rid for rid, _ in firsts]
    assert order == ["a", "c", "b"], order  # interactive ahead of the background one
    c_first = dict(firsts)["c"]
    print(f"\nvLLM abort to the next request's first token: {(c_first - aborted_at) * 1000:.0f} ms")
    for out in (b_out, c_out):
        assert isinstance(out[-1], EngineFinish)
        assert out[-1].finish_reason in ("stop", "length")
        assert all(isinstance(o, EngineDelta) for o in out[:-1])
    cap = engine.capacity()
    assert (cap.free_slots, cap.running, cap.queued) == (1, 0, 0)
    assert cap.kv_cache_usage is not None  # from vLLM's scheduler stats


@ON_THE_ENGINES_LOOP
async def test_a_tenant_never_hits_another_tenants_prefix_cache(one_slot: VllmEngine) -> None:
    """The same prompt from another tenant (another `cache_salt`) finds none of the blocks the
    first tenant's left in vLLM's prefix cache; the first tenant's next request finds them."""
    engine = one_slot
    window = engine.scheduler.prefix_cache
    prompt = " ".join(f"Item {i}: the payroll of ACME for month {i} is sealed." for i in range(60))
    hits: list[int] = []
    for n, tenant in enumerate(("t-victim", "t-attacker", "t-victim"), start=1):
        request = EngineRequest(
            f"salt-{n}",
            prompt,
            1,
            temperature=0.0,
            messages=(ChatTurn("user", prompt),),
            cache_salt=cache_salt(tenant),
        )
        before, seen = window.totals[2], window.totals[0]
        _ = [out async for out in engine.generate(request)]
        await until(lambda seen=seen: window.totals[0] > seen, f"vLLM's stats of request {n}")
        hits.append(window.totals[2] - before)
    assert hits[0] == 0, hits  # nothing cached yet
    assert hits[1] == 0, hits  # another tenant's probe: none of the victim's blocks
    assert hits[2] > 256, hits  # the same tenant: its prompt's full blocks


async def waiting_in_vllm(engine: VllmEngine, count: int) -> None:
    """Until vLLM's scheduler stats (read by the stat logger) say `count` requests wait."""
    await until(lambda: (engine.scheduler.waiting or 0) >= count, f"{count} waiting in vLLM")


async def until(predicate: Callable[[], bool], what: str, within_s: float = 30) -> None:
    deadline = time.monotonic() + within_s
    for _ in itertools.count():
        if predicate():
            return
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def test_a_tokenizer_that_adds_a_bos_gets_one_bos(local_engine: LocalEngine) -> None:
    """The chat template writes the BOS; a tokenizer that also adds one (Llama-3's,
    Mistral's, Gemma's) must not add a second. SmolLM2's adds none, so this one is made
    to: its post-processor puts `<|im_start|>` (SmolLM2's BOS) in front of every text."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(Path(local_engine.model_path))
    bos = tokenizer.convert_tokens_to_ids("<|im_start|>")
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)]
    )
    assert tokenizer.encode("hi")[0] == bos  # it does add one now
    ids = prompt_token_ids(tokenizer, turn("x", "What is the capital of France?", 8, 0))
    assert ids[0] == bos, ids[:4]
    assert ids[1] != bos, ids[:4]
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert rendered.startswith("<|im_start|>")
    assert len(ids) == len(tokenizer.encode(rendered)) - 1  # one BOS fewer than doubled


def test_sampling_params_carry_every_sampling_field() -> None:
    """vLLM's own `SamplingParams` (this version's names and checks) from a request that
    sets every field; unset ones take the model's defaults given, else vLLM's neutral."""
    api = load_vllm()
    request = EngineRequest(
        "r",
        "hi",
        8,
        top_k=5,
        min_p=0.1,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={11: -100.0, 12: 7.5},
        min_tokens=2,
        ignore_eos=True,
        stop_token_ids=(2, 9),
        seed=4,
    )
    params = sampling_params(api, request, {"temperature": 0.2, "top_p": 0.9, "top_k": 50})
    assert (params.top_k, params.min_p, params.repetition_penalty) == (5, 0.1, 1.3)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert params.logit_bias == {11: -100.0, 12: 7.5}
    assert (params.min_tokens, params.ignore_eos, params.seed) == (2, True, 4)
    assert list(params.stop_token_ids) == [2, 9]
    assert (params.temperature, params.top_p, params.max_tokens) == (0.2, 0.9, 8)
    plain = sampling_params(api, EngineRequest("r", "hi", 8))
    assert (plain.temperature, plain.top_p, plain.top_k, plain.min_tokens) == (1.0, 1.0, 0, 0)
    assert not plain.ignore_eos


@ON_THE_ENGINES_LOOP
async def test_ignore_eos_reaches_the_engine(one_slot: VllmEngine) -> None:
    """A short answer ("Paris.") runs on to max_tokens with ignore_eos; the model's
    generation defaults were read at start: the ones deploy/vllm/model.py writes into its
    folder (issue 44, ADR 0064)."""
    assert one_slot.sampling_defaults == {"temperature": 0.2, "top_p": 0.5}
    question = (ChatTurn("user", "What is the capital of France? One word."),)

    async def finish(rid: str, ignore_eos: bool) -> EngineFinish:
        request = EngineRequest(
            rid, "q", 48, temperature=0.0, ignore_eos=ignore_eos, messages=question
        )
        outputs = [o async for o in one_slot.generate(request)]
        assert isinstance(outputs[-1], EngineFinish)
        return outputs[-1]

    natural = await finish("natural", ignore_eos=False)
    assert natural.finish_reason == "stop"
    assert natural.completion_tokens < 48
    forced = await finish("forced", ignore_eos=True)
    assert (forced.finish_reason, forced.completion_tokens) == ("length", 48)


@ON_THE_ENGINES_LOOP
async def test_logprobs_come_one_per_generated_token(one_slot: VllmEngine) -> None:
    """Real vLLM's logprobs, read per delta: one per generated token, each <= 0, with as
    many alternatives as asked, most likely first; greedy, the chosen token is a top one."""
    assert "logprobs" in one_slot.sampling_fields
    request = EngineRequest(
        "logprobs",
        "q",
        12,
        temperature=0.0,
        logprobs=3,
        messages=(ChatTurn("user", "Name three colours."),),
    )
    outputs = [o async for o in one_slot.generate(request)]
    finish = outputs[-1]
    assert isinstance(finish, EngineFinish)
    deltas = [o for o in outputs if isinstance(o, EngineDelta)]
    assert all(d.logprobs is not None and len(d.logprobs) == d.tokens for d in deltas)
    tokens = [t for d in deltas for t in d.logprobs or ()]
    assert len(tokens) == finish.completion_tokens > 0
    for token in tokens:
        assert token.logprob <= 0.0
        assert len(token.top) == 3
        assert [a.logprob for a in token.top] == sorted(
            (a.logprob for a in token.top), reverse=True
        )
        # Greedy: the chosen token is a most likely one (bf16 ties are common: " This" and
        # " The" at -2.0578 were seen here).
        best = token.top[0].logprob
        assert token.logprob == pytest.approx(best)
        assert token.token in {a.token for a in token.top if a.logprob == best}
    # The tokens spell the answer (and an end-of-sequence token, if it ended on one).
    assert "".join(t.token for t in tokens).startswith("".join(d.text for d in deltas))
    # Not asked, none given.
    plain = EngineRequest("plain", "q", 4, temperature=0.0, messages=request.messages)
    given = [o.logprobs async for o in one_slot.generate(plain) if isinstance(o, EngineDelta)]
    assert given
    assert all(lp is None for lp in given)


# -- structured outputs and tool calls (issue 26, point 3) ------------------------------------

CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER_TOOL = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": CITY_SCHEMA,
        },
    }
)
TIME_TOOL = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"timezone": {"type": "string", "maxLength": 24}},
                "required": ["timezone"],
            },
        },
    }
)
ASK = (ChatTurn("user", "What is the weather like in Paris today?"),)


async def answer_of(engine: VllmEngine, request: EngineRequest) -> tuple[str, EngineFinish]:
    outputs = [o async for o in engine.generate(request)]
    finish = outputs[-1]
    assert isinstance(finish, EngineFinish)
    return "".join(o.text for o in outputs if isinstance(o, EngineDelta)), finish


@ON_THE_ENGINES_LOOP
async def test_json_schema_answers_valid_json(one_slot: VllmEngine) -> None:
    """`response_format` json_schema: vLLM's structured outputs (llguidance, the worker's
    default) make even this small model's answer JSON valid against the schema; json_object
    gives an object."""
    import jsonschema

    fmt = ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "weather", "schema": CITY_SCHEMA}}
    )
    request = EngineRequest("fmt", "q", 96, temperature=0.0, messages=ASK, response_format=fmt)
    text, finish = await answer_of(one_slot, request)
    assert finish.finish_reason == "stop", text
    assert finish.tool_calls is None
    jsonschema.validate(json.loads(text), CITY_SCHEMA)
    loose = EngineRequest(
        "obj",
        "q",
        96,
        temperature=0.0,
        messages=(ChatTurn("user", "Describe Paris as a JSON object."),),
        response_format=ResponseFormat(type="json_object"),
    )
    text, finish = await answer_of(one_slot, loose)
    if finish.finish_reason == "stop":  # cut by max_tokens, it cannot be whole
        assert isinstance(json.loads(text), dict), text


# The worst schema shared/schema_bounds.py accepts compiles (llguidance on vLLM's CPU build)
# and is answered within this on a 2-core machine: 1.7-2.1 s measured (ADR 0069, N2).
WORST_SCHEMA_S = 30.0


@ON_THE_ENGINES_LOOP
async def test_the_worst_accepted_schema_compiles_in_bounded_time(one_slot: VllmEngine) -> None:
    """Issue 37, N2: the grammar compile has no timeout in vLLM, so what the edge accepts
    must compile in bounded time; measured here with the costliest schema it accepts."""
    fmt = ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "worst", "schema": worst_schema()}}
    )
    request = EngineRequest("worst", "q", 16, temperature=0.0, messages=ASK, response_format=fmt)
    started = time.monotonic()
    text, finish = await answer_of(one_slot, request)
    took = time.monotonic() - started
    print(f"\nthe worst accepted schema: compiled and answered in {took:.1f} s: {text!r}")
    assert finish.finish_reason in ("stop", "length")
    assert took < WORST_SCHEMA_S, took
    # Guided, not given up: with arrays of 1,024 items in each of its 180 leaves (184,320
    # counted items) llguidance's matcher refused the grammar (more than 65,525 symbols) and
    # the answer was empty; the bounds now hold the counts to MAX_REPEATS in all (ADR 0069).
    assert text.lstrip().startswith("{"), text


@ON_THE_ENGINES_LOOP
async def test_a_named_tool_call_has_an_object_of_its_schema(one_slot: VllmEngine) -> None:
    """A named tool_choice: one call of it, its arguments a JSON object valid against the
    tool's parameters (vLLM's own server gave a JSON string here: issue 26)."""
    import jsonschema

    named = NamedToolChoice.model_validate({"function": {"name": "get_weather"}})
    request = EngineRequest(
        "named",
        "q",
        96,
        temperature=0.0,
        messages=ASK,
        tools=(WEATHER_TOOL, TIME_TOOL),
        tool_choice=named,
    )
    text, finish = await answer_of(one_slot, request)
    assert finish.tool_calls is not None, text
    (call,) = finish.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert isinstance(arguments, dict)
    assert {"city", "unit"} <= set(arguments)
    jsonschema.validate(arguments, CITY_SCHEMA)


@ON_THE_ENGINES_LOOP
async def test_required_gives_valid_calls(one_slot: VllmEngine) -> None:
    """tool_choice required: at least one call, each of an offered tool, with arguments
    valid against that tool's parameters. (Left to call in parallel, this model repeats its
    call until max_tokens: `parallel_tool_calls` false bounds the array to one.)"""
    import jsonschema

    request = EngineRequest(
        "required",
        "q",
        128,
        temperature=0.0,
        messages=ASK,
        tools=(WEATHER_TOOL, TIME_TOOL),
        tool_choice="required",
        parallel_tool_calls=False,
    )
    text, finish = await answer_of(one_slot, request)
    assert finish.tool_calls, text
    schemas = {t.function.name: t.function.parameters for t in (WEATHER_TOOL, TIME_TOOL)}
    for call in finish.tool_calls:
        assert call.function.name in schemas
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_the_required_schema_is_vllms() -> None:
    """The `required` schema built here equals the one vLLM's server builds for the same
    tools (`get_json_schema_from_tools`)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam
    from vllm.tool_parsers.utils import get_json_schema_from_tools

    tools = [WEATHER_TOOL, TIME_TOOL]
    theirs = get_json_schema_from_tools(
        "required",
        [ChatCompletionToolsParam.model_validate(t.model_dump(exclude_none=True)) for t in tools],
    )
    assert required_schema(tools) == theirs
    one = get_json_schema_from_tools(
        "required",
        [ChatCompletionToolsParam.model_validate(t.model_dump(exclude_none=True)) for t in tools],
        parallel_tool_calls=False,
    )
    assert required_schema(tools, parallel=False) == one


def test_the_hermes_parser_reads_an_auto_answer(local_engine: LocalEngine) -> None:
    """An answer to `auto` in hermes' format is read by vLLM's own hermes parser into
    calls and the text besides them; text without a call is no call."""
    from transformers import AutoTokenizer

    api = load_vllm()
    assert api.tools is not None
    tokenizer = AutoTokenizer.from_pretrained(Path(local_engine.model_path))
    reader = ToolCallReader(api.tools, tool_parser(api.tools, "hermes"), tokenizer)
    request = EngineRequest("auto", "q", 8, messages=ASK, tools=(WEATHER_TOOL,))
    text = (
        'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris",'
        ' "unit": "celsius"}}</tool_call>'
    )
    parsed = reader.read(request, text)
    assert parsed.tool_calls is not None
    assert parsed.content == "Let me check."
    assert json.loads(parsed.tool_calls[0].function.arguments) == {
        "city": "Paris",
        "unit": "celsius",
    }
    assert reader.read(request, "It is sunny.").tool_calls is None
    # A call of a tool the request did not offer is no call (issue 37, Low); beside an
    # offered one, it is dropped.
    made_up = '<tool_call>{"name": "delete_account", "arguments": {}}</tool_call>'
    assert reader.read(request, made_up).tool_calls is None
    both = reader.read(request, text + made_up).tool_calls
    assert both is not None
    assert [c.function.name for c in both] == ["get_weather"]
