"""The real-engine benchmark's direct path: the same requests straight to vLLM's `AsyncLLM`.

Run by bench/real_engine.py with the vLLM worker's Python (it imports vLLM): one `AsyncLLM`
with the worker's own engine arguments (the adapter's `engine_args`), the chat rendered and
tokenized as the worker does it, the same closed loops. Prints the runs as JSON on one
stdout line that starts with `RESULT ` (vLLM logs to stdout too).

    <vllm-python> -m bench.real_direct --model <folder> --dtype bfloat16
"""

from __future__ import annotations

import argparse
import asyncio
import time

from bench.real_workload import (
    LOADS,
    MAX_NUM_SEQS,
    LoadRun,
    Sample,
    dump_runs,
    max_tokens,
    messages,
    requests_at,
)
from services.worker.engines.base import ChatTurn, EngineRequest
from services.worker.engines.vllm import engine_args, load_vllm, prompt_token_ids
from tokenbus.local_engine import MAX_MODEL_LEN

RESULT = "RESULT "


async def one(llm: object, api: object, tokenizer: object, i: int) -> Sample:
    from vllm.sampling_params import (  # type: ignore[import-not-found,unused-ignore]
        RequestOutputKind,
        SamplingParams,
    )

    turns = tuple(ChatTurn(m["role"], m["content"]) for m in messages(i))
    request = EngineRequest(f"d{i}", "", max_tokens(i), temperature=0.0, messages=turns)
    began = time.perf_counter()
    ids = await asyncio.to_thread(prompt_token_ids, tokenizer, request)
    params = SamplingParams(
        max_tokens=request.max_tokens, temperature=0.0, output_kind=RequestOutputKind.DELTA
    )
    first: float | None = None
    last = began
    gaps: list[float] = []
    tokens = 0
    async for out in llm.generate({"prompt_token_ids": ids}, params, f"d{i}-{began}"):  # type: ignore[attr-defined]
        n = len(out.outputs[0].token_ids)
        now = time.perf_counter()
        if n and first is None:
            first = now
        elif n:
            gaps.extend([(now - last) / n] * n)
        if n:
            last = now
        tokens += n
    end = time.perf_counter()
    return Sample((first or end) - began, end - began, tokens, len(ids), gaps)


async def closed_loop(llm: object, api: object, tokenizer: object, load: int, base: int) -> LoadRun:
    count = requests_at(load)
    queue = iter(range(base, base + count))
    samples: list[Sample] = []

    async def client() -> None:
        for i in queue:
            samples.append(await one(llm, api, tokenizer, i))

    began = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for _ in range(load):
            tg.create_task(client())
    return LoadRun(load, time.perf_counter() - began, samples)


async def main(args: argparse.Namespace) -> None:
    api = load_vllm()
    eargs = engine_args(
        api,
        model=args.model,
        max_num_seqs=MAX_NUM_SEQS,
        dtype=args.dtype,
        max_model_len=MAX_MODEL_LEN,
        enforce_eager=True,
    )
    llm = await asyncio.to_thread(api.async_llm.from_engine_args, eargs)
    tokenizer = llm.get_tokenizer()
    try:
        await closed_loop(llm, api, tokenizer, 4, 10_000)  # warm-up, not counted
        runs = []
        base = 0
        for load in args.loads:
            runs.append(await closed_loop(llm, api, tokenizer, load, base))
            base += requests_at(load)
        print(RESULT + dump_runs(runs), flush=True)
    finally:
        llm.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--loads", type=int, nargs="+", default=list(LOADS))
    asyncio.run(main(parser.parse_args()))
