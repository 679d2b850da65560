"""The `Engine` protocol every engine implements, and the values that cross it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

FinishReason = Literal["stop", "length", "cancelled"]


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt: str
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    priority: int = 0  # lower runs first, as in vLLM's priority scheduling
    trace_headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineDelta:
    """New text, and how many generated tokens it covers."""

    text: str
    tokens: int


@dataclass(frozen=True)
class EngineFinish:
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int


EngineOutput = EngineDelta | EngineFinish


@dataclass(frozen=True)
class Capacity:
    total_slots: int
    free_slots: int
    running: int
    queued: int
    queued_tokens: int
    utilisation: float


class Engine(Protocol):
    """What a worker needs from an engine; `generate` streams until an `EngineFinish`."""

    name: str

    async def start(self) -> None: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    def capacity(self) -> Capacity: ...

    async def stop(self) -> None: ...
