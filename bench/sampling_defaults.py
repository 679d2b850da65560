"""How often the served SmolLM2 answers "What is the capital of France?" right at given
sampling values (ADR 0064). Run with the vLLM worker's Python, the model folder and a dtype:

    $(deploy/vllm/install.sh) -m bench.sampling_defaults \
        "$($(deploy/vllm/install.sh) deploy/vllm/model.py)" bfloat16

Prints the first token's top-8 log-probabilities, then for each row of `ROWS` how many of
`ANSWERS` sampled answers (no seed, at most 300 tokens) contain "Paris" and end `stop`,
and their commonest first words. A few minutes on 2 cores.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from typing import Any

ANSWERS = 100
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ROWS: list[dict[str, Any]] = [
    {"temperature": 0.2, "top_p": 0.9},  # the model card's
    {"temperature": 0.1, "top_p": 0.9},
    {"temperature": 0.05, "top_p": 0.9},
    {"temperature": 0.2, "top_p": 0.9, "min_p": 0.1},
    {"temperature": 0.2, "top_p": 0.5},  # what deploy/vllm/model.py writes
]


def main() -> None:
    model, dtype = sys.argv[1], sys.argv[2]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams  # type: ignore[import-not-found,unused-ignore]

    llm = LLM(model=model, max_model_len=2048, enforce_eager=True, dtype=dtype)
    greedy = SamplingParams(temperature=0, max_tokens=1, logprobs=8)
    [first] = llm.chat([QUESTION], greedy, use_tqdm=False)
    top = first.outputs[0].logprobs[0].values()
    print(dtype, "first token:", [(lp.decoded_token, round(lp.logprob, 3)) for lp in top])
    print("| temperature, top_p | Paris | ended stop | first words |\n|---|---|---|---|")
    for row in ROWS:
        outs = llm.chat([QUESTION] * ANSWERS, SamplingParams(max_tokens=300, **row), use_tqdm=False)
        texts = [o.outputs[0] for o in outs]
        paris = sum("Paris" in t.text for t in texts)
        stop = sum(t.finish_reason == "stop" for t in texts)
        words = Counter(t.text.split(" ")[0] for t in texts).most_common(3)
        print(f"| {row} | {paris}/{ANSWERS} | {stop}/{ANSWERS} | {words} |", flush=True)


if __name__ == "__main__":
    main()
