"""Routes: a model name clients may ask for that runs a cascade of models, with a verifier.

A route (`TOKENBUS_ROUTES`, JSON, read by every service) names `cascade`, two or more
models from the fastest to the largest, and `verifiers` that judge an answer. A request
for the route starts on the model its `rules` pick (the first rule that matches its
estimated prompt tokens and its key's plan; none: the cascade's first model); a worker
whose answer fails a verifier does not answer: it hands the request on to the next model
of the cascade as the next attempt, and the client sees a `reset` and the larger model's
answer (services/worker/cascade.py, docs/lifecycle.md "Cascades", ADR 0059).

Pure configuration and the one rule that picks a request's first model (`start_step`);
what each verifier checks lives with the worker (services/worker/verifiers.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Self

import regex
from jsonschema import SchemaError
from jsonschema.validators import validator_for
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared.nested_quantifiers import nested_quantifier

ROUTE_NAME = r"^[A-Za-z0-9._:-]{1,200}$"
PLAN_NAME = r"^[A-Za-z0-9._-]{1,64}$"

# What the refusal detector looks for at an answer's start (case-insensitive, after any
# leading whitespace and punctuation): the openings instruction-tuned models use to decline.
REFUSAL_PHRASES: tuple[str, ...] = (
    "I'm sorry",
    "I am sorry",
    "I apologize",
    "I cannot",
    "I can't",
    "I can not",
    "I'm unable",
    "I am unable",
    "I'm not able",
    "I am not able",
    "As an AI",
    "Sorry, but",
)


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class JsonSchemaVerifier(_Config):
    """The answer is JSON valid against `schema` (a JSON Schema, any draft `jsonschema`
    knows; `$schema` picks it, else the latest)."""

    kind: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")

    @field_validator("json_schema")
    @classmethod
    def _a_schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        try:
            validator_for(schema).check_schema(schema)
        except SchemaError as exc:
            raise ValueError(f"not a valid JSON Schema: {exc.message}") from None
        return schema


class RegexVerifier(_Config):
    """The answer matches `pattern` (the `regex` package, as Python's `re` reads it; searched,
    anchor it for a whole match; a search stops after services/worker/verifiers.py's
    REGEX_TIMEOUT_S, and an answer not shown to match by then fails it). A pattern that
    repeats a repeat (`(a+)+`) is refused here (shared/nested_quantifiers.py)."""

    kind: Literal["regex"]
    pattern: str = Field(min_length=1, max_length=4096)

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            regex.compile(pattern)
        except regex.error as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from None
        if (why := nested_quantifier(pattern)) is not None:
            raise ValueError(why)
        return pattern


class LengthVerifier(_Config):
    """The answer is at least `min` and at most `max` characters or tokens long."""

    kind: Literal["length"]
    unit: Literal["chars", "tokens"] = "chars"
    min: int | None = Field(default=None, ge=0)
    max: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _a_bound(self) -> Self:
        if self.min is None and self.max is None:
            raise ValueError("a length verifier needs min, max or both")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min ({self.min}) is above max ({self.max})")
        return self


class RefusalVerifier(_Config):
    """The answer does not open with a refusal (`phrases`, default `REFUSAL_PHRASES`)."""

    kind: Literal["refusal"]
    phrases: tuple[Annotated[str, Field(min_length=1, max_length=200)], ...] = Field(
        default=REFUSAL_PHRASES, min_length=1
    )


class LogprobVerifier(_Config):
    """The mean log-probability of the answer's tokens is at least `min_mean` (needs an
    engine that gives log-probs and a request that asks for them: vLLM; an answer without
    them is not judged by this verifier)."""

    kind: Literal["logprob"]
    min_mean: float = Field(le=0.0, allow_inf_nan=False)


Verifier = Annotated[
    JsonSchemaVerifier | RegexVerifier | LengthVerifier | RefusalVerifier | LogprobVerifier,
    Field(discriminator="kind"),
]


class RouteRule(_Config):
    """Start a route's request on `start` (a model of its cascade) when it matches.

    Every bound given must hold: its estimated prompt tokens within
    [`min_prompt_tokens`, `max_prompt_tokens`], its key's plan among `plans` (a null entry
    matches a request without a plan; the field unset: any plan).
    """

    start: str = Field(min_length=1, max_length=200)
    min_prompt_tokens: int | None = Field(default=None, ge=0)
    max_prompt_tokens: int | None = Field(default=None, ge=0)
    plans: tuple[str | None, ...] | None = Field(default=None, min_length=1)

    @field_validator("plans")
    @classmethod
    def _plan_names(cls, plans: tuple[str | None, ...] | None) -> tuple[str | None, ...] | None:
        for plan in plans or ():
            if plan is not None and not re.match(PLAN_NAME, plan):
                raise ValueError(f"plan {plan!r} is not a plan name ({PLAN_NAME})")
        return plans

    def matches(self, prompt_tokens: int, plan: str | None) -> bool:
        if self.min_prompt_tokens is not None and prompt_tokens < self.min_prompt_tokens:
            return False
        if self.max_prompt_tokens is not None and prompt_tokens > self.max_prompt_tokens:
            return False
        return self.plans is None or plan in self.plans


class Route(_Config):
    """One route: its cascade (fastest first), what its answers must pass, where to start."""

    cascade: tuple[Annotated[str, Field(min_length=1, max_length=200)], ...] = Field(min_length=2)
    verifiers: tuple[Verifier, ...] = Field(min_length=1)
    rules: tuple[RouteRule, ...] = ()

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if len(set(self.cascade)) != len(self.cascade):
            raise ValueError(f"cascade {list(self.cascade)} names a model twice")
        for rule in self.rules:
            if rule.start not in self.cascade:
                raise ValueError(f"rule start {rule.start!r} is not in the cascade")
        return self

    def start_step(self, prompt_tokens: int, plan: str | None) -> int:
        """Where a new request starts: the first matching rule's model, else the first."""
        for rule in self.rules:
            if rule.matches(prompt_tokens, plan):
                return self.cascade.index(rule.start)
        return 0

    def model_at(self, step: int) -> str:
        """The cascade's model at `step` (past the end: the last, the largest)."""
        return self.cascade[min(step, len(self.cascade) - 1)]


Routes = Mapping[str, Route]


def check_route_names(routes: Routes, models: tuple[str, ...] = ()) -> None:
    """Raise `ValueError` for a route name that is no name, that names a served model, or
    whose cascade names a route (a cascade runs on models, not on other routes)."""
    for name, route in routes.items():
        if not re.match(ROUTE_NAME, name):
            raise ValueError(f"route {name!r}: not a model name ({ROUTE_NAME})")
        if name in models:
            raise ValueError(f"route {name!r}: is also a served model (TOKENBUS_SERVED_MODELS)")
        nested = [m for m in route.cascade if m in routes]
        if nested:
            raise ValueError(f"route {name!r}: its cascade names routes {nested}, not models")
