"""The `sim` engine: deterministic text on a simulated GPU's step clock, no GPU needed.

Two batching modes, as real engines have them:
- `continuous` (vLLM): waiting requests join at every step boundary while slots are free;
  their prompts are prefilled inside that step, and each sequence leaves when it is done.
- `static`: a batch starts only when the previous one has fully finished; its prompts are
  padded to the longest one, and finished rows keep costing compute until the batch ends.
  The engine forms a batch from whatever waits (`generate`), or runs the batch it is given
  as one call (`generate_batch`, the worker's TOKENBUS_WORKER_BATCH_MODE=static); the
  cost model of a static batch is the profile's (`SimProfile.padded_prefill_seconds`,
  `padded_decode_seconds`; docs/sim-profiles.md).

A request's outputs are read from its stream (`generate`), or pushed to a sink in one
pass after each step (`submit`, `PushEngine`: the worker's continuous mode), so a token
costs its reader a call rather than a task wakeup.

Fault injection (tests only): with `fail_marker` set, a request whose prompt contains it
fails inside the engine after its first token, as a real engine's request can (a CUDA
error, an OOM): its stream raises `SimulatedFault`. A scripted answer (tests only): with
`echo_marker` set, a request whose prompt contains it is answered with the prompt's text
after the marker, verbatim (`sim_text.echo`; the chat page's XSS tests). A pace of its
own (tests only): with `rate_marker` set, a request whose prompt contains `<marker>=<rate>`
(tokens a second, e.g. `PACE=20`) makes its tokens at that rate, at most one a step: on the
engine's step clock it simply emits on fewer steps, as a slow sequence of a continuous
batch would (`_Sequence.paced`), so tests with other rates share one stack. Engine faults
(tests only): with `fault_file` set, a file there saying `dead` kills the whole engine at
its next step, or within `FAULT_READ_EVERY_S` while it is idle (every request fails,
`failure` says why), as an engine core's death does; `hang` stops its steps for good, as a
hung core's (services/worker/engine_health.py sees both). A file, not a prompt: a request
that kills engines would kill each worker it is handed to. Logprobs (tests and benches
only): with `logprobs` set, the sim honours the field and gives each token a made-up
logprob and as many alternatives as asked
(`sim_logprobs.py`): they weigh what vLLM's weigh on the bus and at the edge, and mean
nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import re
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from services.worker.engines.base import (
    Capacity,
    EngineDelta,
    EngineFinish,
    EngineOutput,
    EngineRequest,
    FinishReason,
    OutputSink,
    RequestRefused,
    check_sampling,
    tokens_to_generate,
)
from services.worker.engines.sim_cache import ANSWER_HEADER, PrefixCache
from services.worker.engines.sim_logprobs import token_logprob
from services.worker.engines.sim_profiles import SimProfile
from services.worker.engines.sim_refusals import refusal, refuses
from services.worker.engines.sim_text import Completion, complete, echo
from services.worker.engines.sim_wrong import answered_as
from shared.tokens import sim_split, sim_tokens

SimMode = Literal["continuous", "static"]
FAULT_READ_EVERY_S = 0.25
# Sums of a step's share of a token (0.1 ten times) fall short of 1 by a rounding error.
_CREDIT_SLACK = 1e-9


def paced_rate(prompt: str, marker: str | None) -> float | None:
    """The rate `<marker>=<tokens/s>` in `prompt` asks for (the first such), or None: no
    marker set, none in the prompt, or a rate that is not a positive number."""
    if marker is None:
        return None
    found = re.search(re.escape(marker) + r"=([0-9]+(?:\.[0-9]+)?)", prompt)
    rate = float(found.group(1)) if found else 0.0
    return rate if rate > 0 else None


class SimulatedFault(RuntimeError):
    """The failure `fail_marker` injects into a request."""


@dataclass
class _Sequence:
    request: EngineRequest
    plan: Completion
    prompt_tokens: int
    limit: int  # the most it may generate: max_tokens, or the rest of the context
    outputs: deque[EngineOutput | Exception] = field(default_factory=deque)
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # set while outputs wait
    position: int = 0
    finished: bool = False
    fails: bool = False  # fault injection: fail after the first token
    tokens: list[str] | None = None  # the prompt's, once looked up in the prefix cache
    sink: OutputSink | None = None  # pushed to (`submit`) rather than read (`generate`)
    rate: float | None = None  # tokens/s of its own (`rate_marker`); None: one every step
    credit: float = 0.0  # the share of its next token its steps have made so far
    counted: int = 0  # tokens of an answer it continues that are not in `plan` (`continued`)

    def paced(self, seconds: float) -> bool:
        """Whether the step of `seconds` makes this sequence's next token: every step without
        a rate of its own; with one, the step adds `rate x seconds` of a token, and a token
        comes out once a whole one has added up (never more than one a step)."""
        if self.rate is None:
            return True
        self.credit = min(1.0, self.credit + self.rate * seconds)
        if self.credit < 1.0 - _CREDIT_SLACK:
            return False
        self.credit -= 1.0
        return True

    @property
    def done(self) -> bool:
        return self.position >= len(self.plan.pieces)

    def put(self, out: EngineOutput | Exception) -> None:
        self.outputs.append(out)
        if self.sink is None:
            self.ready.set()

    def deliver(self) -> None:
        """Push mode: hand what is queued to the sink (after a step, or at once on abort)."""
        sink, outputs = self.sink, self.outputs
        if sink is None:
            return
        while outputs:
            out = outputs.popleft()
            if isinstance(out, Exception):
                sink.on_error(out)
            else:
                sink.on_output(out)

    async def take(self) -> EngineOutput | Exception:
        """The next output; deltas queued behind each other come as one (a reader that fell
        behind takes them in one go, as vLLM's output collector does)."""
        outputs = self.outputs
        while not outputs:
            self.ready.clear()
            await self.ready.wait()
        out = outputs.popleft()
        if not isinstance(out, EngineDelta) or not outputs:
            return out
        texts, tokens, logprobs = [out.text], out.tokens, list(out.logprobs or ())
        while outputs and isinstance(nxt := outputs[0], EngineDelta):
            outputs.popleft()
            texts.append(nxt.text)
            tokens += nxt.tokens
            logprobs.extend(nxt.logprobs or ())
        given = tuple(logprobs) if out.logprobs is not None else None
        return EngineDelta("".join(texts), tokens, given, out.prompt_tokens)

    def fail(self) -> None:
        self.finished = True
        self.put(SimulatedFault(f"sim fault injected into {self.request.request_id}"))

    def finish(self, reason: FinishReason | None = None) -> None:
        if self.finished:
            return
        self.finished = True
        self.put(
            EngineFinish(
                finish_reason=self.plan.finish_reason if reason is None else reason,
                prompt_tokens=self.prompt_tokens,
                completion_tokens=self.counted + self.position,
            )
        )


@dataclass
class _StaticBatch:
    """The rows of a static batch; aborted and finished rows stay until the batch ends."""

    rows: list[_Sequence]
    padded_prompt: int
    steps: int = 0
    holds_slots: bool = False  # given as one call: every row's slot is taken until the end


class SimEngine:
    """Runs up to `max_num_seqs` sequences, one token each per step; others wait by priority."""

    name = "sim"
    continues_answers = True  # ADR 0071: an answer's next attempt goes on where it stood
    # What its text can honestly show: a seed picks another sample; min_tokens and
    # ignore_eos hold off its natural end. It has no logits (penalties, top_k, min_p,
    # logit_bias) nor token ids (stop_token_ids): those it refuses.
    sampling_fields: frozenset[str] = frozenset({"seed", "min_tokens", "ignore_eos"})

    def __init__(
        self,
        profile: SimProfile | None = None,
        mode: SimMode = "continuous",
        *,
        fail_marker: str | None = None,
        echo_marker: str | None = None,
        rate_marker: str | None = None,
        refuse_share: float = 0.0,
        wrong_share: float = 0.0,
        logprobs: bool = False,
        fault_file: str | None = None,
    ) -> None:
        self.profile = profile or SimProfile()
        self.fault_file = Path(fault_file) if fault_file else None
        self._fault_read_at = 0.0  # monotonic: the fault file is read at most every 0.25 s
        self._died: str | None = None
        if logprobs:  # made-up values (tests and benches): sim_logprobs.py
            self.sampling_fields = self.sampling_fields | {"logprobs"}
        self.mode = mode
        self.context_length: int | None = self.profile.context_length
        self.fail_marker = fail_marker or None
        self.echo_marker = echo_marker or None
        self.rate_marker = rate_marker or None
        self.refuse_share = refuse_share  # cascades' tests and benches: sim_refusals.py
        self.wrong_share = wrong_share  # shadow validation's tests: sim_wrong.py
        self._waiting: list[tuple[int, int, _Sequence]] = []
        self._running: dict[str, _Sequence] = {}
        self._batch: _StaticBatch | None = None
        self._groups: deque[list[_Sequence]] = deque()  # static batches given as one call
        self._arrivals = itertools.count()
        self._wakeup = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None
        self._step_due = 0.0
        self.steps = 0  # engine steps taken, for tests and benchmarks
        # Thread CPU time of the engine's own work: planning each request's text and the
        # steps themselves (not what their readers or sinks do with the outputs).
        self.cpu_seconds = 0.0
        self.prefix_cache = PrefixCache(self.profile.prefix_cache_tokens)

    def failure(self) -> str | None:
        """Why the engine died (its fault file said `dead`), or None while it lives."""
        return self._died

    async def start(self) -> None:
        if self._loop is None:
            self._loop = asyncio.create_task(self._run(), name="sim-engine-steps")

    async def stop(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop
            self._loop = None
        for seq in self._all():
            seq.finish("cancelled")
            seq.deliver()
        self._running.clear()
        self._waiting.clear()
        self._groups.clear()
        self._batch = None

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        seq = self._sequence(request)
        self._enqueue(seq)
        async with contextlib.aclosing(self._follow(seq)) as outputs:
            async for out in outputs:
                yield out

    def submit(self, request: EngineRequest, sink: OutputSink) -> None:
        """Push mode (`PushEngine`): each step's outputs go to `sink` in the step's own pass."""
        seq = self._sequence(request)
        seq.sink = sink
        self._enqueue(seq)

    def _enqueue(self, seq: _Sequence) -> None:
        heapq.heappush(self._waiting, (seq.request.priority, next(self._arrivals), seq))
        self._wakeup.set()

    def generate_batch(
        self, requests: Sequence[EngineRequest]
    ) -> list[AsyncIterator[EngineOutput]]:
        """Queue the requests as static batches of up to `max_num_seqs` rows (StaticEngine)."""
        streams: list[AsyncIterator[EngineOutput]] = []
        group: list[_Sequence] = []
        for request in requests:
            try:
                seq = self._sequence(request)
            except RequestRefused as exc:
                streams.append(_refused(exc))
                continue
            group.append(seq)
            streams.append(self._follow(seq))
        width = self.profile.max_num_seqs
        for start in range(0, len(group), width):
            self._groups.append(group[start : start + width])
        self._wakeup.set()
        return streams

    def _sequence(self, request: EngineRequest) -> _Sequence:
        """The request planned as a sequence; raises `RequestRefused` (a sampling field it
        does not honour, a prompt or max_tokens the context cannot hold) before planning."""
        check_sampling(request, self.name, self.sampling_fields)
        if self._died is not None:
            raise SimulatedFault(f"the sim engine is dead: {self._died}")
        # Planning the text is the engine's own work (a real one's model): counted as its time.
        cpu_at = time.thread_time()
        prompt_tokens = sim_tokens(request.prompt)
        # Unset: the rest of the context; the natural answer usually ends earlier ("stop").
        limit = tokens_to_generate(prompt_tokens, request.max_tokens, self.context_length)
        scripted = (
            echo(request.prompt, self.echo_marker, limit) if self.echo_marker is not None else None
        )
        if scripted is None and refuses(request.prompt, self.refuse_share):
            scripted = refusal(limit)
        plan = scripted or complete(
            answered_as(request.prompt, self.wrong_share),
            limit,
            request.stop,
            request.temperature,
            request.top_p,
            seed=request.seed,
            min_tokens=request.min_tokens or 0,
            ignore_eos=bool(request.ignore_eos),
        )
        seq = _Sequence(request, plan, prompt_tokens, limit)
        if request.continues:
            continued(seq, request.continues)
        seq.fails = self.fail_marker is not None and self.fail_marker in request.prompt
        seq.rate = paced_rate(request.prompt, self.rate_marker)
        self.cpu_seconds += time.thread_time() - cpu_at
        return seq

    async def _follow(self, seq: _Sequence) -> AsyncGenerator[EngineOutput]:
        try:
            while True:
                out = await seq.take()
                if isinstance(out, Exception):
                    raise out
                yield out
                if isinstance(out, EngineFinish):
                    return
        finally:
            if not seq.finished:  # the consumer went away: free the slot
                self._remove(seq.request.request_id)
                seq.finish("cancelled")

    async def abort(self, request_id: str) -> bool:
        seq = self._remove(request_id)
        if seq is None:
            return False
        seq.finish("cancelled")
        seq.deliver()
        return True

    def capacity(self) -> Capacity:
        total = self.profile.max_num_seqs
        batch = self._batch
        # A batch given as one call holds all its slots until its longest row ends.
        held = len(batch.rows) if batch is not None and batch.holds_slots else 0
        running = max(len(self._running), held)
        queued = len(self._waiting) + sum(len(g) for g in self._groups)
        queued_tokens = sum(s.prompt_tokens + s.limit - s.position for s in self._all())
        return Capacity(
            total_slots=total,
            free_slots=0 if self._died else max(0, total - running - queued),
            running=running,
            queued=queued,
            queued_tokens=queued_tokens,
            utilisation=running / total,
            prefix_cache_hit_rate=self.prefix_cache.hit_rate,
        )

    def step_seconds(self, running: int) -> float:
        """Decode step time at this batch size with short prompts (for coalescing bounds)."""
        return self.profile.step_seconds(running, 0)

    def _all(self) -> list[_Sequence]:
        grouped = [s for group in self._groups for s in group]
        return list(self._running.values()) + [s for _, _, s in self._waiting] + grouped

    def _remove(self, request_id: str) -> _Sequence | None:
        seq = self._running.pop(request_id, None)
        if seq is not None:
            return seq
        for i, (_, _, waiting) in enumerate(self._waiting):
            if waiting.request.request_id == request_id:
                self._waiting.pop(i)
                heapq.heapify(self._waiting)
                return waiting
        for group in self._groups:
            for seq in group:
                if seq.request.request_id == request_id:
                    group.remove(seq)
                    if not group:
                        self._groups.remove(group)
                    return seq
        return None

    def _admit(self, limit: int) -> list[_Sequence]:
        joined: list[_Sequence] = []
        while self._waiting and len(self._running) < limit:
            _, _, seq = heapq.heappop(self._waiting)
            self._running[seq.request.request_id] = seq
            joined.append(seq)
        return joined

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            idle = not self._running and not self._waiting and not self._groups
            fault = None
            if idle and self._batch is None:
                self._wakeup.clear()
                fault = await self._until_work()
                self._step_due = loop.time()
            if fault is not None or (fault := self._fault_asked()) is not None:
                await self._break(fault)
            cpu_at = time.thread_time()
            # A batch given as one call runs as a static batch in either mode.
            if self.mode == "continuous" and self._batch is None and not self._groups:
                seconds = self._plan_continuous_step()
            else:
                seconds = self._plan_static_step()
            self.cpu_seconds += time.thread_time() - cpu_at
            await self._tick(loop, seconds)
            cpu_at = time.thread_time()
            self.steps += 1
            stepped = list(self._running.values())
            for seq in stepped:
                self._emit(seq, seconds)
            if self._batch is not None and not any(
                r.request.request_id in self._running for r in self._batch.rows
            ):
                self._batch = None
            self.cpu_seconds += time.thread_time() - cpu_at
            # Outside the engine's own time: what the sinks do with a step is the worker's.
            for seq in stepped:
                if seq.sink is not None:
                    seq.deliver()

    async def _until_work(self) -> str | None:
        """Wait until work arrives. With a fault file, read it meanwhile and return the fault
        it asks for: an engine core dies while idle too, and vLLM's `errored` shows it then (a
        fault read only at a step was missed by a worker that had no work, and its chaos
        fault overran into the next one)."""
        every = None if self.fault_file is None else FAULT_READ_EVERY_S
        while True:
            try:
                async with asyncio.timeout(every):
                    await self._wakeup.wait()
                return None
            except TimeoutError:
                if (fault := self._fault_asked()) is not None:
                    return fault

    def _fault_asked(self) -> str | None:
        """`dead` or `hang` if the fault file asks for it now (read, then removed)."""
        now = time.monotonic()
        if self.fault_file is None or now - self._fault_read_at < FAULT_READ_EVERY_S:
            return None
        self._fault_read_at = now
        try:
            fault = self.fault_file.read_text().strip()
        except FileNotFoundError:
            return None
        self.fault_file.unlink(missing_ok=True)
        return fault if fault in ("dead", "hang") else None

    async def _break(self, fault: str) -> None:
        """The fault asked for: every request fails and the engine is dead from now on, or
        the step loop waits for ever."""
        if fault == "hang":
            await asyncio.Event().wait()
        self._died = f"{fault} (sim fault injection)"
        for seq in self._all():
            seq.finished = True
            seq.put(SimulatedFault(f"sim engine died running {seq.request.request_id}"))
            seq.deliver()
        self._running.clear()
        self._waiting.clear()
        self._groups.clear()
        self._batch = None
        await asyncio.Event().wait()  # a dead engine steps no more

    def _plan_continuous_step(self) -> float:
        joined = self._admit(self.profile.max_num_seqs)
        # A cached prefix is not prefilled again: only its KV is read (in `kv` below), as
        # with vLLM's automatic prefix caching and SGLang's RadixAttention.
        prefill = 0
        for s in joined:
            s.tokens = sim_split(s.request.prompt)
            prefill += s.prompt_tokens - self.prefix_cache.admit(s.tokens, s.request.cache_salt)
        kv = sum(s.prompt_tokens + s.position for s in self._running.values())
        decoding = len(self._running) - len(joined)
        return self.profile.step_seconds(decoding, kv, prefill)

    def _plan_static_step(self) -> float:
        if self._batch is None:
            given = bool(self._groups)
            if given:
                rows = self._groups.popleft()
                for seq in rows:
                    self._running[seq.request.request_id] = seq
            else:
                rows = self._admit(self.profile.max_num_seqs)
            padded = max((s.prompt_tokens for s in rows), default=0)
            self._batch = _StaticBatch(rows, padded, holds_slots=given)
            return self.profile.padded_prefill_seconds(len(rows), padded)
        batch = self._batch
        batch.steps += 1
        return self.profile.padded_decode_seconds(len(batch.rows), batch.padded_prompt, batch.steps)

    async def _tick(self, loop: asyncio.AbstractEventLoop, seconds: float) -> None:
        # Steps run on an absolute clock so timer lag does not slow the simulated GPU down;
        # a lag beyond one step is dropped rather than caught up in a burst.
        due = self._step_due + seconds
        now = loop.time()
        if now - due > seconds:
            due = now
        await asyncio.sleep(max(0.0, due - now))
        self._step_due = due

    def _emit(self, seq: _Sequence, seconds: float) -> None:
        if seq.fails and seq.position >= 1:
            self._running.pop(seq.request.request_id, None)
            seq.fail()
            return
        if not seq.done and not seq.paced(seconds):
            return
        if not seq.done:
            piece, top = seq.plan.pieces[seq.position], seq.request.logprobs
            given = None if top is None else (token_logprob(piece, seq.position, top),)
            first = seq.prompt_tokens if seq.position == 0 else None
            seq.put(EngineDelta(piece, 1, given, first))
            seq.position += 1
        if seq.done:
            seq.position = seq.plan.completion_tokens
            self._running.pop(seq.request.request_id, None)
            if seq.tokens is not None:
                answer = sim_split(seq.plan.text)
                self.prefix_cache.store(
                    [*seq.tokens, *ANSWER_HEADER, *answer], seq.request.cache_salt
                )
            seq.finish()


def continued(seq: _Sequence, text: str) -> None:
    """Start `seq` after `text`, the answer its request's earlier attempts sent.

    Where `text` is where its own plan stands after some tokens (greedy or seeded: the same
    plan each attempt), it goes on from there, so the answer is the uninterrupted one to the
    character. Otherwise (another sample) it plans anew from the prompt and `text`, within
    what `max_tokens` leaves, and counts `text`'s tokens as generated.
    """
    pieces, at = seq.plan.pieces, 0
    for count, piece in enumerate(pieces, start=1):
        at += len(piece)
        if at >= len(text):
            if at == len(text) and seq.plan.text.startswith(text):
                seq.position = count
                return
            break
    seq.counted = sim_tokens(text)
    left = max(0, seq.limit - seq.counted)
    request = seq.request
    seq.plan = (
        complete(
            f"{request.prompt}\n{text}",
            left,
            request.stop,
            request.temperature,
            request.top_p,
            seed=request.seed,
        )
        if left
        else Completion((), 0, "length")
    )


async def _refused(exc: RequestRefused) -> AsyncIterator[EngineOutput]:
    """A row's stream that raises `exc` at its first step (the row never ran)."""
    raise exc
    yield  # an async generator all the same
