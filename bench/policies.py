"""The stack configurations compared side by side, and whether this build can run each."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import ValidationError

from services.scheduler.settings import SchedulerSettings
from services.worker.settings import WorkerSettings

GPU_PROFILE = "llama3-8b-h100"
FALLBACK_PROFILE = "constant"
# Decode tokens/s per sequence when only the `constant` profile exists: a round figure
# near what one H100 gives an 8B model at moderate batch sizes (~10 ms per step).
FALLBACK_TOKEN_RATE = 100.0


@dataclass(frozen=True)
class Policy:
    name: str
    kind: Literal["pipeline", "direct"]
    description: str
    env: dict[str, str] = field(default_factory=dict)


POLICIES: dict[str, Policy] = {
    p.name: p
    for p in (
        Policy(
            "batch1",
            "pipeline",
            "scheduler batch size 1 in both tiers (no batching by the bus rule)",
            {
                "TOKENBUS_SCHEDULER_POLICY": "fixed",
                "TOKENBUS_SCHEDULER_INTERACTIVE_MAX_BATCH_SIZE": "1",
                "TOKENBUS_SCHEDULER_BACKGROUND_MAX_BATCH_SIZE": "1",
            },
        ),
        Policy(
            "fixed",
            "pipeline",
            "the bus rule with its fixed timeouts (scheduler defaults)",
            {"TOKENBUS_SCHEDULER_POLICY": "fixed"},
        ),
        Policy(
            "adaptive",
            "pipeline",
            "the adaptive bus rule (TOKENBUS_SCHEDULER_POLICY=adaptive)",
            {"TOKENBUS_SCHEDULER_POLICY": "adaptive"},
        ),
        Policy(
            "direct",
            "direct",
            "the same sim engine in-process behind a WebSocket: no Kafka, no services",
        ),
    )
}


def _settings_kwargs(env: dict[str, str], prefix: str = "TOKENBUS_") -> dict[str, str]:
    return {k.removeprefix(prefix).lower(): v for k, v in env.items() if k.startswith(prefix)}


def scheduler_settings(env: dict[str, str]) -> SchedulerSettings:
    """The scheduler's settings as a stack started with `env` resolves them."""
    return SchedulerSettings(**_settings_kwargs(env))  # type: ignore[arg-type]


def worker_settings(env: dict[str, str]) -> WorkerSettings:
    return WorkerSettings(**_settings_kwargs(env))  # type: ignore[arg-type]


def unavailable_reason(policy: Policy) -> str | None:
    """Why this build cannot run `policy` as asked, or None if it can."""
    if policy.kind != "pipeline":
        return None
    wanted = policy.env.get("TOKENBUS_SCHEDULER_POLICY")
    if wanted is None or wanted == "fixed":  # the bus rule is what every scheduler does
        return None
    if "scheduler_policy" not in SchedulerSettings.model_fields:
        # pydantic-settings ignores unknown variables: running it would silently be `fixed`.
        return "the scheduler has no `scheduler_policy` setting in this build"
    try:
        resolved = scheduler_settings(policy.env)
    except ValidationError as exc:
        return f"the scheduler rejects TOKENBUS_SCHEDULER_POLICY={wanted}: {exc.errors()[0]['msg']}"
    if str(getattr(resolved, "scheduler_policy", "")) != wanted:
        return f"the scheduler resolves TOKENBUS_SCHEDULER_POLICY={wanted} to something else"
    return None


@dataclass(frozen=True)
class EngineProfile:
    """The sim engine settings every policy shares, and what was substituted, if anything."""

    name: str
    env: dict[str, str]
    note: str


def engine_profile(wanted: str = GPU_PROFILE) -> EngineProfile:
    """`wanted` if the worker knows it; else the constant profile, saying so."""
    env = {"TOKENBUS_WORKER_ENGINE": "sim"}
    if "worker_sim_profile" in WorkerSettings.model_fields:
        try:
            worker_settings({**env, "TOKENBUS_WORKER_SIM_PROFILE": wanted})
        except ValidationError as exc:
            reason = f"the worker rejects profile {wanted!r}: {exc.errors()[0]['msg']}"
        else:
            return EngineProfile(wanted, {**env, "TOKENBUS_WORKER_SIM_PROFILE": wanted}, "")
    else:
        reason = "the worker has no `worker_sim_profile` setting in this build"
    env["TOKENBUS_WORKER_SIM_TOKEN_RATE"] = f"{FALLBACK_TOKEN_RATE:g}"
    if "worker_sim_profile" in WorkerSettings.model_fields:
        env["TOKENBUS_WORKER_SIM_PROFILE"] = FALLBACK_PROFILE
    note = (
        f"{wanted} was not available ({reason}); ran the `{FALLBACK_PROFILE}` profile at "
        f"{FALLBACK_TOKEN_RATE:g} tokens/s per sequence instead, so absolute numbers do not "
        "describe a GPU"
    )
    return EngineProfile(FALLBACK_PROFILE, env, note)


def max_batch_sizes(policy: Policy, env: dict[str, str]) -> dict[str, int]:
    """Largest batch per tier: the scheduler's limits, or the engine's slots for `direct`."""
    if policy.kind == "direct":
        slots = worker_settings(env).worker_max_num_seqs
        return {"interactive": slots, "background": slots}
    s = scheduler_settings(env)
    return {
        "interactive": s.scheduler_interactive_max_batch_size,
        "background": s.scheduler_background_max_batch_size,
    }


# The engine never limits: what is measured is the bus (issue 12's capacity benchmark).
FAST_TOKEN_RATE = 1000.0
FAST_MAX_NUM_SEQS = 512


def fast_constant_profile() -> EngineProfile:
    """The `constant` sim profile set fast enough that the engine is never the bottleneck."""
    env = {
        "TOKENBUS_WORKER_ENGINE": "sim",
        "TOKENBUS_WORKER_SIM_PROFILE": FALLBACK_PROFILE,
        "TOKENBUS_WORKER_SIM_TOKEN_RATE": f"{FAST_TOKEN_RATE:g}",
        "TOKENBUS_WORKER_MAX_NUM_SEQS": str(FAST_MAX_NUM_SEQS),
    }
    return EngineProfile("constant-fast", env, "")
