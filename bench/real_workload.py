"""The requests and loads of the real-engine benchmark (bench/real_engine.py), one place for
both of its paths: straight to vLLM's `AsyncLLM` (bench/real_direct.py, in the vLLM worker's
environment) and through tokenbus (the bench, over the WebSocket).

Closed loops: at load `c`, `c` clients each send their next request as soon as the last one
ended, until the load's requests are all answered. Greedy (temperature 0), so both paths
generate the same tokens for the same request. `max_tokens` differs from request to
request (24-88): with one cap for all, most answers stop at it in the same engine step,
the clients' next requests arrive together and are prefilled in one long step, and the
TTFT under load measures that wave more than the engine (docs/sim-profiles.md).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.stats import percentile

# Concurrent clients: one (the TTFT of a lone request), a few, and vLLM's max_num_seqs
# (saturation: every slot busy).
LOADS = (1, 4, 16)
MAX_NUM_SEQS = 16
MAX_TOKENS_RANGE = (24, 88)

TOPICS = (
    "a bus",
    "the sea",
    "a library",
    "coffee",
    "a mountain",
    "the moon",
    "a bicycle",
    "rain",
    "a garden",
    "music",
    "a train station",
    "winter",
)
ASKS = (
    "Write two sentences about {}.",
    "Describe {} to a child.",
    "Give three facts about {}.",
    "Write a short poem about {}.",
)


def messages(i: int) -> list[dict[str, str]]:
    """Request `i`'s chat: about 40 prompt tokens with the template, no two sharing a
    prefix (the system message starts with the request's number), so neither engine's
    prefix cache plays a part; a system message of its own, so the template adds none and
    the sim sees nearly the text the model does."""
    ask = ASKS[i % len(ASKS)].format(TOPICS[(i // len(ASKS)) % len(TOPICS)])
    system = f"Request {i}. You are a helpful assistant; answer briefly and clearly."
    return [{"role": "system", "content": system}, {"role": "user", "content": ask}]


def max_tokens(i: int) -> int:
    """Request `i`'s cap: spread over MAX_TOKENS_RANGE (a stride coprime with its width)."""
    low, high = MAX_TOKENS_RANGE
    return low + (i * 37) % (high - low + 1)


def requests_at(load: int) -> int:
    """How many requests a load sends: enough for a steady state, bounded in time."""
    return max(24, 3 * load)


@dataclass
class Sample:
    """One request as its client saw it (seconds from its send)."""

    ttft_s: float
    total_s: float
    completion_tokens: int
    prompt_tokens: int
    # Gaps between consecutive outputs after the first, over the tokens each carried.
    token_gaps_s: list[float] = field(default_factory=list)


@dataclass
class LoadRun:
    """One load's samples and its wall time (first send to last end)."""

    load: int
    wall_s: float
    samples: list[Sample]

    @property
    def tokens_per_s(self) -> float:
        return sum(s.completion_tokens for s in self.samples) / max(1e-9, self.wall_s)

    def ttft_ms(self, q: float) -> float:
        return 1000 * percentile(sorted(s.ttft_s for s in self.samples), q)

    def token_gap_ms(self, q: float) -> float:
        gaps = sorted(g for s in self.samples for g in s.token_gaps_s)
        return 1000 * percentile(gaps, q) if gaps else 0.0

    def summary(self) -> dict[str, float]:
        return {
            "load": self.load,
            "requests": len(self.samples),
            "ttft_p50_ms": round(self.ttft_ms(50), 1),
            "ttft_p99_ms": round(self.ttft_ms(99), 1),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "token_gap_p50_ms": round(self.token_gap_ms(50), 2),
            "prompt_tokens_mean": round(
                sum(s.prompt_tokens for s in self.samples) / max(1, len(self.samples)), 1
            ),
            "completion_tokens": sum(s.completion_tokens for s in self.samples),
        }


def dump_runs(runs: list[LoadRun]) -> str:
    return json.dumps([asdict(r) for r in runs])


def load_runs(text: str) -> list[LoadRun]:
    raw: list[dict[str, Any]] = json.loads(text)
    return [LoadRun(r["load"], r["wall_s"], [Sample(**s) for s in r["samples"]]) for r in raw]
