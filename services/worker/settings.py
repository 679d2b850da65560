"""Worker settings (`TOKENBUS_WORKER_*`)."""

from __future__ import annotations

import os
import socket
from typing import Literal, Self

from pydantic import Field, SecretStr, model_validator

from shared.embeddings import credentials_in, key_in_clear
from shared.messages import VARIANT_NAME
from shared.settings import TokenbusSettings


def _default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


# Variables that no longer exist, each with what replaced it: refused at start rather than
# ignored (unknown TOKENBUS_* variables are), so that a setting nobody reads cannot look set.
RETIRED = {
    "TOKENBUS_WORKER_SIM_MODE": "no longer read (ADR 0052): TOKENBUS_WORKER_BATCH_MODE"
    " (continuous or static) now sets the sim engine's batching too. Delete the variable;"
    " for static batches set TOKENBUS_WORKER_BATCH_MODE=static (a continuous worker on a"
    " statically batching sim is no longer offered)",
}


class WorkerSettings(TokenbusSettings):
    worker_id: str = Field(
        default_factory=_default_worker_id, description="Name in heartbeats; default host-pid."
    )
    worker_engine: str = Field(
        default="sim", pattern="^(sim|vllm|transformers)$", description="sim, vllm or transformers."
    )
    worker_model: str = Field(default="sim-8b", description="Model name in heartbeats.")
    worker_variant: str | None = Field(
        default=None,
        pattern=VARIANT_NAME,
        description="The variant of the model this worker runs (a revision, engine,"
        " quantization or worker group; `tokenbus models rollout` sets its share); unset:"
        " the model's baseline.",
    )
    worker_max_num_seqs: int = Field(default=64, ge=1, description="Sequences run at once.")
    worker_flush_ms: float = Field(default=20.0, gt=0, description="Longest a token waits.")
    worker_flush_tokens: int = Field(default=16, ge=1, description="Send a chunk at this size.")
    worker_flush_first: bool = Field(
        default=True, description="Send each stream's first token at once (TTFT)."
    )
    worker_batch_partition: int = Field(
        default=0,
        ge=0,
        description="The batches topic partition this worker reads; batches are addressed to"
        " a worker id, so workers may share one, but each on its own reads only its own.",
    )
    worker_batch_mode: Literal["continuous", "static"] = Field(
        default="continuous",
        description="continuous: each request of a batch record goes to the engine on its own"
        " (the engine batches, as vLLM does). static: each batch record runs as one engine"
        " call, padded to its longest prompt, every slot taken until its longest output ends"
        " (Triton's static batcher); one batch at a time. Engines: sim, transformers; the"
        " sim engine batches the same way.",
    )
    worker_heartbeat_ms: float = Field(
        default=1000.0,
        gt=0,
        description="Longest gap between heartbeats (one is also sent soon after a slot frees);"
        " schedulers declare a worker dead after three silent intervals.",
    )
    worker_drain_timeout_s: float = Field(
        default=10.0,
        ge=0,
        description="On SIGTERM: how long running requests may finish before being handed back"
        " (a request another worker can continue, ADR 0071, is handed back at once).",
    )
    worker_engine_stall_s: float = Field(
        default=30.0,
        gt=0,
        description="An engine that holds requests and makes no output for this long is taken"
        " for hung: the worker turns not ready, advertises no free slot and exits to be"
        " restarted, its requests run elsewhere (services/worker/engine_health.py). Above the"
        " longest prefill the model may take.",
    )
    worker_fence_missed_beats: float | None = Field(
        default=None,
        gt=1,
        description="With no heartbeat stored for this many intervals the worker may have"
        " been declared dead: it stops every run, writes nothing more for them and hands"
        " them back. Unset: SCHEDULER_WORKER_MISSED_BEATS + 1 (one interval of slack).",
    )
    scheduler_worker_missed_beats: int = Field(
        default=3,
        ge=1,
        description="The schedulers' death threshold (their setting); the worker's fence"
        " follows it.",
    )
    worker_result_write_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="How long writing an error answer or a dead letter may keep failing"
        " (retried with backoff); a run waiting longer for its result records logs"
        " `results.slow` and goes on waiting.",
    )
    worker_result_resend_s: float = Field(
        default=120.0,
        gt=0,
        description="How long a batch of result records Kafka did not take (a broker away,"
        " hung, or failing over) is sent again, in order, before its runs are handed back to"
        " be run again as the next attempt; no later record of those runs is sent meanwhile"
        " (ADR 0048).",
    )

    # Shadow validation on a gold worker (services/worker/shadow.py)
    worker_embedding_url: str | None = Field(
        default=None,
        pattern=r"^https?://",
        description="An OpenAI-compatible embeddings API (its base, e.g."
        " http://127.0.0.1:8001/v1): a gold worker adds the embedding similarity of the two"
        " answers to each shadow score (shared/embeddings.py). None: no embedding score.",
    )
    worker_embedding_model: str | None = Field(
        default=None, min_length=1, description="The embedding model's name at that API."
    )
    worker_embedding_api_key: SecretStr | None = Field(
        default=None, description="Bearer key for the embeddings API, if it needs one."
    )

    # sim engine
    worker_sim_profile: str = Field(
        default="constant",
        pattern="^(constant|llama3-8b-h100|llama3-8b-h200|llama3-70b-fp8-h200|smollm2-cpu)$",
        description="constant: worker_sim_token_rate per sequence; llama3-8b-*,"
        " llama3-70b-fp8-h200: GPU cost models; smollm2-cpu: fitted to SmolLM2 on vLLM's CPU"
        " build (docs/sim-profiles.md).",
    )
    worker_sim_token_rate: float = Field(default=50.0, gt=0, description="sim: tokens/s/seq.")
    worker_sim_prefix_cache_tokens: int | None = Field(
        default=None,
        ge=0,
        description="sim: KV-cache tokens its prefix cache may hold; 0: none (default: the"
        " profile's, its GPU's KV cache; 65536 for constant).",
    )
    worker_sim_fail_marker: str | None = Field(
        default=None,
        min_length=1,
        description="sim fault injection (tests): a request whose prompt contains this text"
        " fails inside the engine after its first token.",
    )
    worker_sim_echo_marker: str | None = Field(
        default=None,
        min_length=8,
        description="sim scripted answers (tests only; unset in production): a request whose"
        " prompt contains this text is answered with the prompt's text after it, verbatim.",
    )
    worker_sim_rate_marker: str | None = Field(
        default=None,
        min_length=8,
        description="sim paced answers (tests only; unset in production): a request whose"
        " prompt contains `<marker>=<tokens/s>` makes its tokens at that rate (at most one a"
        " step), so tests of other rates share one stack.",
    )

    worker_sim_refuse_share: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="sim (tests and benches of cascades; 0 in production): the share of prompts"
        " (chosen by a hash of the prompt) answered with a refusal the cascade's refusal"
        " verifier catches (services/worker/engines/sim_refusals.py).",
    )
    worker_sim_wrong_share: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="sim (tests and canary drills of shadow validation; 0 in production): the"
        " share of prompts (chosen by a hash of the prompt) answered with other text than a"
        " faithful sim worker gives (services/worker/engines/sim_wrong.py).",
    )
    worker_sim_fault_file: str | None = Field(
        default=None,
        min_length=1,
        description="sim engine faults (tests only; unset in production): a file here saying"
        " `dead` kills the whole sim engine at its next step, or within 0.25 s while it is idle"
        " (every request fails, it says it died), as an engine core's death does; `hang` stops"
        " its steps for good, as a hung core's. Read at most every 0.25 s, and removed once"
        " read.",
    )
    worker_sim_logprobs: bool = Field(
        default=False,
        description="sim (tests and benches of logprob traffic; off in production): honour"
        " `logprobs` with made-up values shaped and sized as vLLM's"
        " (services/worker/engines/sim_logprobs.py); off, the sim refuses the field.",
    )

    # vllm and transformers engines
    worker_model_path: str | None = Field(
        default=None, description="Local model directory (or hub id for vLLM) to load."
    )
    worker_dtype: str = Field(default="auto", description="auto|bfloat16|float16|float32.")
    worker_quantization: str | None = Field(default=None, description="vLLM: e.g. fp8, awq.")
    worker_gpu_memory_utilization: float = Field(
        default=0.90, gt=0, le=1, description="vLLM: share of GPU memory it may take."
    )
    worker_max_model_len: int | None = Field(
        default=None,
        ge=1,
        description="Context length; longer prompts get invalid_request. Unset: the model's"
        " (sim: the profile's, 8192).",
    )
    worker_tensor_parallel_size: int = Field(
        default=1, ge=1, description="vLLM: GPUs per model replica."
    )
    worker_enforce_eager: bool = Field(
        default=False,
        description="vLLM: no CUDA graphs or torch.compile (starts faster; the CPU build and"
        " `make run ENGINE=vllm` set it).",
    )
    worker_structured_outputs_backend: Literal["guidance", "auto", "xgrammar", "outlines"] = Field(
        default="guidance",
        description="vLLM: the grammar backend that guides JSON answers and tool calls (vLLM's"
        " --structured-outputs-config backend). guidance (llguidance), built for schemas an"
        " adversary writes (issue 37, N2, ADR 0069); auto is vLLM's own default (xgrammar, else"
        " llguidance).",
    )
    worker_tool_call_parser: str = Field(
        default="hermes",
        min_length=1,
        description="vLLM: the tool-call parser that reads tool calls from an answer to"
        " `tool_choice: auto` (one of vLLM's `--tool-call-parser` names; hermes reads"
        " `<tool_call>{json}</tool_call>`).",
    )
    worker_device: str = Field(default="auto", description="transformers: auto|cpu|cuda[:n].")

    @model_validator(mode="after")
    def _refuse_retired(self) -> Self:
        present = {name.upper() for name in os.environ} & RETIRED.keys()
        if present:
            raise ValueError("; ".join(f"{name}: {RETIRED[name]}" for name in sorted(present)))
        return self

    @model_validator(mode="after")
    def _embedding_needs_both(self) -> Self:
        if (self.worker_embedding_url is None) != (self.worker_embedding_model is None):
            raise ValueError(
                "TOKENBUS_WORKER_EMBEDDING_URL and TOKENBUS_WORKER_EMBEDDING_MODEL go together:"
                " set both (shadow scores add an embedding similarity) or neither"
            )
        url = self.worker_embedding_url
        if url is not None and credentials_in(url):
            raise ValueError(
                "TOKENBUS_WORKER_EMBEDDING_URL: no user, password or query in it; a key goes"
                " in TOKENBUS_WORKER_EMBEDDING_API_KEY"
            )
        if url is not None and self.worker_embedding_api_key is not None and key_in_clear(url):
            raise ValueError(
                "TOKENBUS_WORKER_EMBEDDING_URL is http to another host: its API key would"
                " cross the network in clear; use https (http only to a loopback address)"
            )
        return self

    @property
    def fence_after_beats(self) -> float:
        """Silent heartbeat intervals after which the worker fences itself."""
        if self.worker_fence_missed_beats is not None:
            return self.worker_fence_missed_beats
        return self.scheduler_worker_missed_beats + 1.0
