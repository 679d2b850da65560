"""The synthetic request mix: classes of chat and summarisation requests, drawn reproducibly."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.messages import Tier
from shared.tokens import sim_tokens

DEFAULT_MIX = Path(__file__).resolve().parent / "data" / "mix.json"


class LengthDistribution(BaseModel):
    """Lognormal lengths in estimated tokens, clipped to [min, max]."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    median: float = Field(gt=0)
    sigma: float = Field(ge=0)
    min: int = Field(ge=1)
    max: int = Field(ge=1)

    def draw(self, rng: random.Random) -> int:
        value = rng.lognormvariate(math.log(self.median), self.sigma)
        return max(self.min, min(self.max, round(value)))


class RequestClass(BaseModel):
    """One kind of traffic: its tier, share of arrivals, prompt shape and lengths."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    tier: Tier
    weight: float = Field(ge=0)
    shape: Literal["messages", "prompt"]
    system: str | None = None
    openers: list[str] = Field(default_factory=list)
    instruction: str | None = None
    prompt_tokens: LengthDistribution
    max_tokens: LengthDistribution


class Mix(BaseModel):
    """The data file: request classes and the text their prompts are cut from."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    description: str = ""
    classes: list[RequestClass] = Field(min_length=1)
    corpus: list[str] = Field(min_length=1)

    @classmethod
    def load(cls, path: Path = DEFAULT_MIX) -> Mix:
        return cls.model_validate_json(path.read_text())

    def describe(self) -> str:
        total = sum(c.weight for c in self.classes) or 1.0
        return ", ".join(
            f"{c.weight / total:.0%} {c.name} ({c.tier.value}, prompt ~{c.prompt_tokens.median:g} "
            f"tokens, max_tokens ~{c.max_tokens.median:g})"
            for c in self.classes
        )

    def with_background_share(self, share: float | None) -> Mix:
        """Rescale class weights so background classes get `share` of arrivals."""
        if share is None:
            return self
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"background share must be within [0, 1], not {share}")
        totals = {t: sum(c.weight for c in self.classes if c.tier is t) for t in Tier}
        wanted = {Tier.background: share, Tier.interactive: 1.0 - share}
        for tier, want in wanted.items():
            if want > 0 and totals[tier] == 0:
                raise ValueError(f"the mix has no {tier.value} class to give a share of {want}")
        classes = [
            c.model_copy(update={"weight": c.weight / totals[c.tier] * wanted[c.tier]})
            if totals[c.tier] > 0
            else c
            for c in self.classes
        ]
        return self.model_copy(update={"classes": classes})


class PlannedRequest(BaseModel):
    """One arrival of the schedule: when it is sent (from the run's start) and what it asks."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    client_id: str
    at_s: float = Field(ge=0)
    request_class: str
    tier: Tier
    prompt_tokens: int
    body: dict[str, Any]  # the `chat.request` frame, `type` included


def poisson_arrivals(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Arrival times of a Poisson process of `rate` per second within [0, duration_s)."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, not {rate}")
    times: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def plan(mix: Mix, rate: float, duration_s: float, seed: int) -> list[PlannedRequest]:
    """The whole run's requests, drawn before it starts so drawing costs no time during it."""
    rng = random.Random(seed)
    weights = [c.weight for c in mix.classes]
    words = " ".join(mix.corpus).split()
    planned: list[PlannedRequest] = []
    for i, at in enumerate(poisson_arrivals(rate, duration_s, rng)):
        cls = rng.choices(mix.classes, weights)[0]
        target = cls.prompt_tokens.draw(rng)
        text = _text(words, target, rng)
        body: dict[str, Any] = {
            "type": "chat.request",
            "client_id": f"c{seed}-{i}",
            "max_tokens": cls.max_tokens.draw(rng),
            "priority": cls.tier.value,
        }
        if cls.shape == "messages":
            opener = rng.choice(cls.openers) if cls.openers else ""
            messages = [{"role": "user", "content": f"{opener} {text}".strip()}]
            if cls.system:
                messages.insert(0, {"role": "system", "content": cls.system})
            body["messages"] = messages
            prompt = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
        else:
            prompt = f"{cls.instruction or ''}\n\n{text}".strip()
            body["prompt"] = prompt
        planned.append(
            PlannedRequest(
                client_id=body["client_id"],
                at_s=at,
                request_class=cls.name,
                tier=cls.tier,
                prompt_tokens=sim_tokens(prompt),
                body=body,
            )
        )
    return planned


def _text(words: list[str], tokens: int, rng: random.Random) -> str:
    """About `tokens` estimated tokens of corpus text, from a random starting word."""
    start = rng.randrange(len(words))
    out: list[str] = []
    count = 0
    i = start
    while count < tokens:
        word = words[i % len(words)]
        out.append(word)
        count += sim_tokens(word)
        i += 1
    return " ".join(out)
