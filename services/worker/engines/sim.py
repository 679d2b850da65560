"""The `sim` engine: continuous batching on a step clock, deterministic text, no GPU."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from services.worker.engines.base import (
    Capacity,
    EngineDelta,
    EngineFinish,
    EngineOutput,
    EngineRequest,
)
from services.worker.engines.sim_text import Completion, complete
from shared.tokens import estimate_tokens


@dataclass(frozen=True)
class SimProfile:
    """Timing of the simulated GPU. `token_rate` is decode tokens/s per sequence."""

    token_rate: float = 50.0
    max_num_seqs: int = 64

    def step_seconds(self, running: int, kv_tokens: int) -> float:
        return 1.0 / self.token_rate


@dataclass
class _Sequence:
    request: EngineRequest
    plan: Completion
    prompt_tokens: int
    outputs: asyncio.Queue[EngineOutput] = field(default_factory=asyncio.Queue)
    position: int = 0
    finished: bool = False

    def finish(self, reason: str | None = None) -> None:
        if self.finished:
            return
        self.finished = True
        self.outputs.put_nowait(
            EngineFinish(
                finish_reason=self.plan.finish_reason if reason is None else "cancelled",
                prompt_tokens=self.prompt_tokens,
                completion_tokens=self.position,
            )
        )


class SimEngine:
    """Runs up to `max_num_seqs` sequences, one token each per step; others wait by priority."""

    name = "sim"

    def __init__(self, profile: SimProfile | None = None) -> None:
        self.profile = profile or SimProfile()
        self._waiting: list[tuple[int, int, _Sequence]] = []
        self._running: dict[str, _Sequence] = {}
        self._arrivals = itertools.count()
        self._wakeup = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._loop is None:
            self._loop = asyncio.create_task(self._run(), name="sim-engine-steps")

    async def stop(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
            try:
                await self._loop
            except asyncio.CancelledError:
                pass
            self._loop = None
        for seq in self._all():
            seq.finish("cancelled")

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        plan = complete(
            request.prompt, request.max_tokens, request.stop, request.temperature, request.top_p
        )
        seq = _Sequence(request, plan, estimate_tokens(request.prompt))
        heapq.heappush(self._waiting, (request.priority, next(self._arrivals), seq))
        self._wakeup.set()
        try:
            while True:
                out = await seq.outputs.get()
                yield out
                if isinstance(out, EngineFinish):
                    return
        finally:
            if not seq.finished:  # the consumer went away: free the slot
                self._remove(request.request_id)
                seq.finish("cancelled")

    async def abort(self, request_id: str) -> None:
        seq = self._remove(request_id)
        if seq is not None:
            seq.finish("cancelled")

    def capacity(self) -> Capacity:
        total = self.profile.max_num_seqs
        running = len(self._running)
        queued_tokens = sum(
            s.prompt_tokens + s.request.max_tokens - s.position for s in self._all()
        )
        return Capacity(
            total_slots=total,
            free_slots=max(0, total - running - len(self._waiting)),
            running=running,
            queued=len(self._waiting),
            queued_tokens=queued_tokens,
            utilisation=running / total,
        )

    def _all(self) -> list[_Sequence]:
        return list(self._running.values()) + [s for _, _, s in self._waiting]

    def _remove(self, request_id: str) -> _Sequence | None:
        seq = self._running.pop(request_id, None)
        if seq is not None:
            return seq
        for i, (_, _, waiting) in enumerate(self._waiting):
            if waiting.request.request_id == request_id:
                self._waiting.pop(i)
                heapq.heapify(self._waiting)
                return waiting
        return None

    async def _run(self) -> None:
        while True:
            if not self._running and not self._waiting:
                self._wakeup.clear()
                await self._wakeup.wait()
            while self._waiting and len(self._running) < self.profile.max_num_seqs:
                _, _, seq = heapq.heappop(self._waiting)
                self._running[seq.request.request_id] = seq
            kv = sum(s.prompt_tokens + s.position for s in self._running.values())
            await asyncio.sleep(self.profile.step_seconds(len(self._running), kv))
            for seq in list(self._running.values()):
                self._step(seq)

    def _step(self, seq: _Sequence) -> None:
        if seq.position < len(seq.plan.pieces):
            seq.outputs.put_nowait(EngineDelta(seq.plan.pieces[seq.position], 1))
            seq.position += 1
        if seq.position >= len(seq.plan.pieces):
            seq.position = seq.plan.completion_tokens
            self._running.pop(seq.request.request_id, None)
            seq.finish()
