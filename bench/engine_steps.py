"""Step time and tokens/s of the `transformers` engine by batch size: the GPU calibration run.

Builds a model of the chosen shape with random weights in memory (no download) and a
character tokenizer, then for each batch size submits that many requests at once
(`--prompt` tokens in, `--output` tokens out, greedy) and times the prefill and the decode
steps. On an H200 with `--shape llama3-8b` this is issue 4's acceptance 5, and what
`docs/sim-profiles.md` says should replace the sim profiles' assumed efficiencies.

    python -m bench.engine_steps --shape llama3-8b --device cuda \
        --json bench/out/engine_steps.json                     # on the GPU machine
    python -m bench.engine_steps --shape tiny --device cpu --batch-sizes 1,4   # smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import string
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from services.worker.engines.base import EngineDelta, EngineFinish, EngineRequest
from services.worker.engines.sim_profiles import PROFILES
from tests.engine_contract import TINY_LLAMA, char_tokenizer, random_llama

SHAPES: dict[str, dict[str, int]] = {
    "tiny": TINY_LLAMA,
    # meta-llama/Meta-Llama-3-8B config.json
    "llama3-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
    ),
}


@dataclass
class StepRun:
    batch_size: int
    prompt_tokens: int
    output_tokens: int
    prefill_s: float  # submit -> every request has its first token
    step_ms_p50: float  # decode step (request 0's token inter-arrival)
    step_ms_p90: float
    decode_tokens_per_s: float  # batch_size * (output - 1) / decode time
    sim_h200_step_ms: float  # what the llama3-8b-h200 profile predicts at mid-decode


async def one_batch(engine: Any, batch_size: int, prompt: int, output: int) -> StepRun:
    rng = random.Random(batch_size)
    letters = string.ascii_lowercase + " "
    requests = [
        EngineRequest(
            f"b{batch_size}-{i}",
            "".join(rng.choice(letters) for _ in range(prompt)),
            output,
            temperature=0.0,
        )
        for i in range(batch_size)
    ]
    arrivals: list[list[float]] = [[] for _ in requests]

    async def follow(i: int, request: EngineRequest) -> None:
        async for out in engine.generate(request):
            if isinstance(out, EngineDelta):
                arrivals[i].append(time.perf_counter())
            elif isinstance(out, EngineFinish):
                assert out.completion_tokens == output, out

    started = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for i, request in enumerate(requests):
            tg.create_task(follow(i, request))
    first_all = max(a[0] for a in arrivals)
    last_all = max(a[-1] for a in arrivals)
    steps = [(b - a) * 1000 for a, b in zip(arrivals[0], arrivals[0][1:], strict=False)]
    deciles = statistics.quantiles(steps, n=10) if len(steps) > 1 else steps * 9
    kv = batch_size * (prompt + output // 2)
    return StepRun(
        batch_size=batch_size,
        prompt_tokens=prompt,
        output_tokens=output,
        prefill_s=round(first_all - started, 4),
        step_ms_p50=round(statistics.median(steps), 3),
        step_ms_p90=round(deciles[8], 3),
        decode_tokens_per_s=round(batch_size * (output - 1) / (last_all - first_all), 1),
        sim_h200_step_ms=round(PROFILES["llama3-8b-h200"].step_seconds(batch_size, kv) * 1000, 3),
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import torch  # type: ignore[import-not-found,unused-ignore]

    from services.worker.engines.transformers import TransformersEngine

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    tokenizer = char_tokenizer()
    with torch.device(args.device):
        model = random_llama(tokenizer, **SHAPES[args.shape])
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    engine = TransformersEngine(model, tokenizer, max_num_seqs=max(sizes))
    await engine.start()
    try:
        await one_batch(engine, 1, 16, 4)  # warm-up: kernels, allocator
        runs = [await one_batch(engine, b, args.prompt, args.output) for b in sizes]
    finally:
        await engine.stop()
    print(
        f"| batch | prefill s ({args.prompt} tok each) | step p50 ms | step p90 ms "
        "| decode tok/s | sim llama3-8b-h200 step ms |"
    )
    print("|---|---|---|---|---|---|")
    for r in runs:
        print(
            f"| {r.batch_size} | {r.prefill_s:.3f} | {r.step_ms_p50:.2f} | {r.step_ms_p90:.2f} "
            f"| {r.decode_tokens_per_s:.0f} | {r.sim_h200_step_ms:.2f} |"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"shape": args.shape, "device": args.device, "dtype": str(dtype)}
        args.json.write_text(json.dumps({**meta, "runs": [asdict(r) for r in runs]}, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
