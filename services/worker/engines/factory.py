"""Builds the engine the settings name; heavy engines are imported only when chosen."""

from __future__ import annotations

from services.worker.engines.base import Engine, StaticEngine
from services.worker.engines.sim import SimEngine
from services.worker.engines.sim_profiles import sim_profile
from services.worker.settings import WorkerSettings


def build_engine(settings: WorkerSettings) -> Engine:
    if settings.worker_engine == "sim":
        profile = sim_profile(
            settings.worker_sim_profile,
            max_num_seqs=settings.worker_max_num_seqs,
            token_rate=settings.worker_sim_token_rate,
            context_length=settings.worker_max_model_len,
            prefix_cache_tokens=settings.worker_sim_prefix_cache_tokens,
        )
        # One setting for both: a static worker's batch records run as the sim's static
        # batches, a continuous worker's requests join the sim's running batch at each step.
        return SimEngine(
            profile,
            settings.worker_batch_mode,
            fail_marker=settings.worker_sim_fail_marker,
            echo_marker=settings.worker_sim_echo_marker,
            rate_marker=settings.worker_sim_rate_marker,
            refuse_share=settings.worker_sim_refuse_share,
            wrong_share=settings.worker_sim_wrong_share,
            logprobs=settings.worker_sim_logprobs,
            fault_file=settings.worker_sim_fault_file,
        )
    if settings.worker_engine == "vllm":
        from services.worker.engines.vllm import VllmEngine, engine_args_from_settings, load_vllm

        api = load_vllm()
        return VllmEngine(
            api,
            engine_args_from_settings(api, settings),
            tool_call_parser=settings.worker_tool_call_parser,
        )
    if settings.worker_engine == "transformers":
        from services.worker.engines.transformers import TransformersEngine

        if settings.worker_model_path is None:
            raise ValueError("the transformers engine needs TOKENBUS_WORKER_MODEL_PATH")
        return TransformersEngine.from_pretrained(
            settings.worker_model_path,
            max_num_seqs=settings.worker_max_num_seqs,
            dtype=settings.worker_dtype,
            device=settings.worker_device,
            max_model_len=settings.worker_max_model_len,
        )
    raise ValueError(f"engine {settings.worker_engine!r} is not available in this build")


def static_engine(engine: Engine, settings: WorkerSettings) -> StaticEngine | None:
    """The engine to run each batch record on as one call, or None (continuous mode).

    The one place the worker's batch mode is chosen; an engine that cannot run a batch as
    one call (vLLM batches continuously) is refused at start.
    """
    if settings.worker_batch_mode != "static":
        return None
    if not isinstance(engine, StaticEngine):
        raise ValueError(
            f"TOKENBUS_WORKER_BATCH_MODE=static: the {engine.name} engine cannot run a batch"
            " as one call (sim and transformers can)"
        )
    return engine
