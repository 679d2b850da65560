"""The engines the contract suite runs against: `sim` always, real ones wherever importable.

`available_engines()` is evaluated at collection time; an engine whose libraries are not
installed is simply not in the list (no skips). The `transformers` case builds a tiny
random-initialised Llama and a character-level tokenizer in a temporary directory, and
loads them through the engine's own `from_pretrained` (no download). The `vllm` case loads
the same tiny model on a GPU.
"""

from __future__ import annotations

import importlib.util
import string
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from deploy import test_ledger
from services.worker.engines.base import Engine, EngineRequest
from services.worker.engines.sim import SimEngine
from services.worker.engines.sim_profiles import sim_profile
from services.worker.engines.sim_text import complete


@dataclass(frozen=True)
class EngineCase:
    """How to build one engine for the contract tests."""

    name: str
    build: Callable[[int], Engine]  # max_num_seqs -> engine (not started)
    # The exact text an engine must produce, where it is known in advance (the sim).
    expected_text: Callable[[EngineRequest], str] | None = None


def _sim_text(request: EngineRequest) -> str:
    if request.max_tokens is None:
        # Unset, the sim's limit is the rest of its profile's context, which this cannot see.
        raise ValueError("the sim's expected text needs a request with max_tokens set")
    plan = complete(
        request.prompt, request.max_tokens, request.stop, request.temperature, request.top_p
    )
    return plan.text


def _sim(profile: str, mode: str, rate: float = 400.0) -> Callable[[int], Engine]:
    def build(max_num_seqs: int) -> Engine:
        p = sim_profile(profile, max_num_seqs=max_num_seqs, token_rate=rate)
        return SimEngine(p, "static" if mode == "static" else "continuous")

    return build


def _installed(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


def char_tokenizer() -> Any:
    """A character-level fast tokenizer (specials, letters, digits, punctuation)."""
    from tokenizers import (  # type: ignore[import-not-found,unused-ignore]
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
    )
    from transformers import (  # type: ignore[import-not-found,unused-ignore]
        PreTrainedTokenizerFast,
    )

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    chars = list(string.ascii_letters + string.digits + " .,!?'-")
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call,unused-ignore]
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )


def random_llama(tokenizer: Any, **shape: int) -> Any:
    """A Llama with random weights; only the tokenizer's tokens (never EOS) can win argmax.

    A random model may pick EOS, or ids the tokenizer cannot decode, at any step; zeroing
    those rows of `lm_head` keeps greedy streams going until max_tokens.
    """
    import torch  # type: ignore[import-not-found,unused-ignore]
    from transformers import (  # type: ignore[import-not-found,unused-ignore]
        LlamaConfig,
        LlamaForCausalLM,
    )

    settings: dict[str, Any] = {"vocab_size": len(tokenizer), **shape}
    config = LlamaConfig(
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **settings,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id].zero_()
        model.lm_head.weight[len(tokenizer) :].zero_()
    return model


TINY_LLAMA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


@cache
def tiny_model_dir() -> str:
    """Save a tiny random Llama and a character tokenizer; return the directory."""
    import torch  # type: ignore[import-not-found,unused-ignore]

    torch.manual_seed(0)
    tokenizer = char_tokenizer()
    model = random_llama(tokenizer, **TINY_LLAMA)
    path = Path(tempfile.mkdtemp(prefix="tokenbus-tiny-llama-"))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _transformers(max_num_seqs: int) -> Engine:
    from services.worker.engines.transformers import TransformersEngine

    test_ledger.note(test_ledger.TRANSFORMERS_LOAD, where="engine contract")
    return TransformersEngine.from_pretrained(
        tiny_model_dir(), max_num_seqs=max_num_seqs, dtype="float32", device="cpu"
    )


def _vllm(max_num_seqs: int) -> Engine:
    from services.worker.engines.vllm import VllmEngine, engine_args, load_vllm

    api = load_vllm()
    test_ledger.note(test_ledger.VLLM_LOAD, where="engine contract")
    args = engine_args(
        api,
        model=tiny_model_dir(),
        max_num_seqs=max_num_seqs,
        dtype="float32",
        gpu_memory_utilization=0.3,
        max_model_len=1024,
    )
    return VllmEngine(api, args)


def available_engines() -> list[EngineCase]:
    cases = [
        EngineCase("sim-constant-continuous", _sim("constant", "continuous"), _sim_text),
        EngineCase("sim-h100-continuous", _sim("llama3-8b-h100", "continuous"), _sim_text),
        EngineCase("sim-h200-static", _sim("llama3-8b-h200", "static"), _sim_text),
    ]
    if _installed("torch", "transformers"):
        cases.append(EngineCase("transformers-tiny-llama", _transformers))
    if _installed("vllm", "torch") and _cuda_available():
        cases.append(EngineCase("vllm-tiny-llama", _vllm))
    return cases


def _cuda_available() -> bool:
    import torch  # type: ignore[import-not-found,unused-ignore]

    return bool(torch.cuda.is_available())
