"""Timing profiles of the `sim` engine: a fixed token rate, or a cost model of a real GPU.

Every number of the cost-model profiles is derived, with its source, in docs/sim-profiles.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

GB = 1e9
TERA = 1e12


@dataclass(frozen=True)
class CostModel:
    """Step time of one model on one GPU, from the roofline of a transformer forward pass.

    A forward pass reads every weight once and the KV cache of every running sequence
    (memory time), and does 2 FLOPs per parameter per token it processes (compute time);
    the step takes the larger of the two, plus a fixed per-step overhead (scheduling,
    sampling, kernel launches). Prefill tokens processed in a step add compute only.
    """

    weight_bytes: float
    kv_bytes_per_token: float
    flops_per_token: float
    memory_bandwidth: float  # bytes/s, peak
    peak_flops: float  # FLOP/s, dense, peak
    bandwidth_efficiency: float  # achieved share of peak bandwidth in decode
    compute_efficiency: float  # achieved share of peak FLOPs (model FLOPs utilisation)
    step_overhead_s: float

    def step_seconds(self, running: int, kv_tokens: int, prefill_tokens: int = 0) -> float:
        """One engine step: `running` sequences decode one token, `prefill_tokens` are read."""
        memory = (self.weight_bytes + kv_tokens * self.kv_bytes_per_token) / (
            self.memory_bandwidth * self.bandwidth_efficiency
        )
        compute = (
            (running + prefill_tokens)
            * self.flops_per_token
            / (self.peak_flops * self.compute_efficiency)
        )
        return self.step_overhead_s + max(memory, compute)


@dataclass(frozen=True)
class MeasuredStepModel:
    """Step time as measured on a real engine, not derived from a roofline: a base per
    step, a cost per decoding sequence and per prefilled token (the KV cache read is not
    seen at these sizes). A CPU's decode step is not memory-bound as a GPU's is: its cost
    grows with the batch from the first sequence (docs/sim-profiles.md, "smollm2-cpu").
    """

    base_s: float
    per_sequence_s: float
    per_prefill_token_s: float

    def step_seconds(self, running: int, kv_tokens: int, prefill_tokens: int = 0) -> float:
        return (
            self.base_s + running * self.per_sequence_s + prefill_tokens * self.per_prefill_token_s
        )


@dataclass(frozen=True)
class SimProfile:
    """How long the simulated GPU takes. Without a cost model every step lasts 1/token_rate."""

    name: str = "constant"
    max_num_seqs: int = 64
    token_rate: float = 50.0  # tokens/s per sequence; the `constant` profile only
    cost: CostModel | MeasuredStepModel | None = None
    # Llama-3-8B's max_position_embeddings (config.json); a prompt longer is refused.
    context_length: int = 8192
    # KV-cache tokens the prefix cache may hold (sim_cache.py); 0: no prefix caching.
    prefix_cache_tokens: int = 65536

    def step_seconds(self, running: int, kv_tokens: int, prefill_tokens: int = 0) -> float:
        if self.cost is None:
            return 1.0 / self.token_rate
        return self.cost.step_seconds(running, kv_tokens, prefill_tokens)

    # The static-batch cost model (docs/sim-profiles.md, "Static batches"): every row is
    # padded to the longest prompt, and every row decodes until the longest output ends.

    def padded_prefill_seconds(self, rows: int, longest_prompt: int) -> float:
        """The step that prefills a static batch: rows x longest prompt tokens, pads too.

        It also yields every row's first token.
        """
        padded = rows * longest_prompt
        return self.step_seconds(0, padded, padded)

    def padded_decode_seconds(self, rows: int, longest_prompt: int, step: int) -> float:
        """Decode step `step` (1, 2, ...) of a static batch: all its rows, finished or not."""
        return self.step_seconds(rows, rows * (longest_prompt + step))

    def static_batch_seconds(self, prompts: Sequence[int], outputs: Sequence[int]) -> StaticTiming:
        """When a static batch's rows get their first token and their last, from its start."""
        rows, longest = len(prompts), max(prompts, default=0)
        first = self.padded_prefill_seconds(rows, longest)
        ends_at = [first]  # ends_at[k]: the end of the step that yields token k + 1
        for step in range(1, max(outputs, default=1)):
            ends_at.append(ends_at[-1] + self.padded_decode_seconds(rows, longest, step))
        return StaticTiming(
            first_token_s=first,
            row_done_s=tuple(ends_at[max(1, n) - 1] for n in outputs),
            batch_s=ends_at[-1],
        )


@dataclass(frozen=True)
class StaticTiming:
    """A static batch's timeline from its start: first tokens, each row's end, its end.

    Every row's slot is taken until `batch_s`, however early the row itself ends.
    """

    first_token_s: float
    row_done_s: tuple[float, ...]
    batch_s: float


# Llama-3-8B in bf16 (config.json of meta-llama/Meta-Llama-3-8B; docs/sim-profiles.md).
LLAMA3_8B_PARAMS = 8.03e9
LLAMA3_8B_WEIGHT_BYTES = LLAMA3_8B_PARAMS * 2  # bf16
LLAMA3_8B_KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads x 128, bf16
LLAMA3_8B_FLOPS_PER_TOKEN = 2 * LLAMA3_8B_PARAMS

# Efficiencies and overhead are assumptions until measured on the device (docs/sim-profiles.md).
BANDWIDTH_EFFICIENCY = 0.80
COMPUTE_EFFICIENCY = 0.50
STEP_OVERHEAD_S = 0.0005


# KV-cache tokens of Llama-3-8B on a GPU, as vLLM sizes its cache: gpu_memory_utilization
# (0.9, its default) of the GPU's memory, less the weights, over the KV bytes per token.
# Activation memory is not subtracted, so this is an upper bound (docs/sim-profiles.md).
GPU_MEMORY_UTILIZATION = 0.9


def llama3_8b_kv_tokens(gpu_memory_bytes: float) -> int:
    free = gpu_memory_bytes * GPU_MEMORY_UTILIZATION - LLAMA3_8B_WEIGHT_BYTES
    return int(free // LLAMA3_8B_KV_BYTES_PER_TOKEN)


def _llama3_8b(memory_bandwidth: float, peak_flops: float) -> CostModel:
    return CostModel(
        weight_bytes=LLAMA3_8B_WEIGHT_BYTES,
        kv_bytes_per_token=LLAMA3_8B_KV_BYTES_PER_TOKEN,
        flops_per_token=LLAMA3_8B_FLOPS_PER_TOKEN,
        memory_bandwidth=memory_bandwidth,
        peak_flops=peak_flops,
        bandwidth_efficiency=BANDWIDTH_EFFICIENCY,
        compute_efficiency=COMPUTE_EFFICIENCY,
        step_overhead_s=STEP_OVERHEAD_S,
    )


PROFILES: dict[str, SimProfile] = {
    "constant": SimProfile(),
    # H100 SXM5: 3.35 TB/s HBM3, 989 TFLOPS dense bf16 (NVIDIA H100 datasheet).
    # 80 GB of HBM3 (80 GiB as CUDA reports it).
    "llama3-8b-h100": SimProfile(
        name="llama3-8b-h100",
        cost=_llama3_8b(3.35 * TERA, 989 * TERA),
        prefix_cache_tokens=llama3_8b_kv_tokens(80 * 2**30),
    ),
    # H200 SXM: 4.8 TB/s HBM3e, 989 TFLOPS dense bf16, 141 GB (NVIDIA H200 datasheet).
    "llama3-8b-h200": SimProfile(
        name="llama3-8b-h200",
        cost=_llama3_8b(4.8 * TERA, 989 * TERA),
        prefix_cache_tokens=llama3_8b_kv_tokens(141 * GB),
    ),
}


# Llama-3-70B with FP8 weights (config.json of meta-llama/Meta-Llama-3-70B; docs/sim-profiles.md,
# "Llama-3-70B"), bf16 KV cache, on one H200: the large model of a cascade's benchmark
# (`make bench-cascade`), on the same GPU as `llama3-8b-h200` so their GPU-seconds compare.
LLAMA3_70B_PARAMS = 70.55e9
LLAMA3_70B_FP8_WEIGHT_BYTES = LLAMA3_70B_PARAMS * 1  # fp8
LLAMA3_70B_KV_BYTES_PER_TOKEN = 2 * 80 * 8 * 128 * 2  # K and V, 80 layers, 8 KV heads x 128, bf16
H200_FP8_DENSE_FLOPS = 1979 * TERA  # NVIDIA H200 datasheet: FP8 3,958 TFLOPS with sparsity
PROFILES["llama3-70b-fp8-h200"] = SimProfile(
    name="llama3-70b-fp8-h200",
    cost=CostModel(
        weight_bytes=LLAMA3_70B_FP8_WEIGHT_BYTES,
        kv_bytes_per_token=LLAMA3_70B_KV_BYTES_PER_TOKEN,
        flops_per_token=2 * LLAMA3_70B_PARAMS,
        memory_bandwidth=4.8 * TERA,
        peak_flops=H200_FP8_DENSE_FLOPS,
        bandwidth_efficiency=BANDWIDTH_EFFICIENCY,
        compute_efficiency=COMPUTE_EFFICIENCY,
        step_overhead_s=STEP_OVERHEAD_S,
    ),
    prefix_cache_tokens=int(
        (141 * GB * GPU_MEMORY_UTILIZATION - LLAMA3_70B_FP8_WEIGHT_BYTES)
        // LLAMA3_70B_KV_BYTES_PER_TOKEN
    ),
)


# SmolLM2-135M-Instruct on vLLM 0.32's CPU build, bf16, 2 cores (AVX2): fitted by
# `make bench-real` (bench/real_engine.py) to direct AsyncLLM runs; the fit and its runs are
# in docs/sim-profiles.md ("smollm2-cpu"), the check against the real engine in
# docs/benchmarks.md.
SMOLLM2_CPU_STEP = MeasuredStepModel(
    base_s=0.0282, per_sequence_s=0.00127, per_prefill_token_s=0.00148
)
PROFILES["smollm2-cpu"] = SimProfile(
    name="smollm2-cpu",
    max_num_seqs=16,
    cost=SMOLLM2_CPU_STEP,
    context_length=2048,
    # 1 GiB of KV cache (VLLM_CPU_KVCACHE_SPACE=1) over 23040 bytes a token (30 layers,
    # 3 KV heads of 64, K and V, bf16).
    prefix_cache_tokens=2**30 // (2 * 30 * 3 * 64 * 2),
)


def sim_profile(
    name: str,
    *,
    max_num_seqs: int,
    token_rate: float,
    context_length: int | None = None,
    prefix_cache_tokens: int | None = None,
) -> SimProfile:
    """The named profile with this worker's slot count (and, for `constant`, its rate).

    `context_length` overrides the profile's (TOKENBUS_WORKER_MAX_MODEL_LEN), and so does
    `prefix_cache_tokens` (TOKENBUS_WORKER_SIM_PREFIX_CACHE_TOKENS).
    """
    try:
        base = PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown sim profile {name!r}; known: {sorted(PROFILES)}") from None
    profile = replace(base, max_num_seqs=max_num_seqs, token_rate=token_rate)
    if context_length is not None:
        profile = replace(profile, context_length=context_length)
    if prefix_cache_tokens is not None:
        profile = replace(profile, prefix_cache_tokens=prefix_cache_tokens)
    return profile
