"""The `transformers` engine: a Hugging Face causal LM through PyTorch (extra `[transformers]`).

For users without vLLM. Requests are run in cohorts: whenever slots are free at a step
boundary, the waiting requests (by priority) are prefilled together, left-padded, into a
new cohort with its own KV cache; every step decodes one token for each cohort. A row that
finishes or is aborted is pruned from its cohort's cache, so its slot is free at once.
The forward passes run in a worker thread, so the event loop (Kafka, cancels) stays live.

A batch given as one call (`generate_batch`, the worker's TOKENBUS_WORKER_BATCH_MODE=static)
runs natively as one padded `model.generate`: prompts left-padded with an attention mask,
every row decoding until the longest ends (or all are done or aborted), streamed per row
by a streamer of our own (`_RowStreamer`) that hands each step's tokens to the event loop.
`model.generate` takes one sampling setting per call: a static batch is greedy if every
row is greedy, else sampled with its first sampled row's temperature, top_p and seed.
torch and transformers are imported here only, when this engine is chosen.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import inspect
import itertools
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch  # type: ignore[import-not-found,unused-ignore]
from transformers import (  # type: ignore[import-not-found,unused-ignore]
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.streamers import (  # type: ignore[import-not-found,unused-ignore]
    BaseStreamer,
)

from services.worker.engines.base import (
    Capacity,
    EngineDelta,
    EngineFinish,
    EngineOutput,
    EngineRequest,
    FinishReason,
    RequestRefused,
    check_sampling,
    tokens_to_generate,
)

REPLACEMENT_CHAR = "\ufffd"


@dataclass
class _Sequence:
    request: EngineRequest
    prompt_ids: list[int]
    limit: int  # the most it may generate: max_tokens, or the rest of the context
    outputs: asyncio.Queue[EngineOutput] = field(default_factory=asyncio.Queue)
    generated: list[int] = field(default_factory=list)
    sent_chars: int = 0
    finished: bool = False
    generator: Any = None  # torch.Generator for sampled requests
    prompt_told: bool = False  # its first output carried the prompt's tokens

    def finish(self, reason: FinishReason) -> None:
        if not self.finished:
            self.finished = True
            self.outputs.put_nowait(EngineFinish(reason, len(self.prompt_ids), len(self.generated)))


@dataclass
class _Cohort:
    """Sequences prefilled together, sharing one KV cache; rows leave as they finish."""

    rows: list[_Sequence]
    cache: Any
    attention_mask: Any
    next_positions: Any
    last_tokens: Any


class TransformersEngine:
    """Batched streaming generation on a Hugging Face causal LM."""

    name = "transformers"
    # Applied per row by its own sampler (a static batch: its first sampled row's, as
    # temperature); penalties, logit_bias, min_tokens and ignore_eos it refuses.
    sampling_fields: frozenset[str] = frozenset({"seed", "top_k", "min_p", "stop_token_ids"})
    cpu_seconds = 0.0  # not measured: its steps run on a thread of their own

    def __init__(
        self, model: Any, tokenizer: Any, *, max_num_seqs: int, max_model_len: int | None = None
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_num_seqs = max_num_seqs
        # The model's own limit (positions it was trained for) unless configured lower.
        trained = getattr(model.config, "max_position_embeddings", None)
        self.context_length: int | None = max_model_len or (
            trained if isinstance(trained, int) else None
        )
        self.device = next(model.parameters()).device
        self.defaults = SamplingDefaults.of(getattr(model, "generation_config", None))
        forward_params = inspect.signature(model.forward).parameters
        # transformers 5 renamed the cache argument; accept both.
        self._cache_kw = "cache" if "cache" in forward_params else "past_key_values"
        self._pad_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        ) or 0
        self._waiting: list[tuple[int, int, _Sequence]] = []
        self._cohorts: list[_Cohort] = []
        self._static_groups: deque[list[_Sequence]] = deque()  # batches given as one call
        self._static_width = 0  # rows of the static batch running now: all hold slots
        self._live: dict[str, _Sequence] = {}
        self._arrivals = itertools.count()
        self._wakeup = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        max_num_seqs: int,
        dtype: str = "auto",
        device: str = "auto",
        max_model_len: int | None = None,
    ) -> TransformersEngine:
        """Load a model and tokenizer from a local directory (no download)."""
        target = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        if dtype == "auto":
            torch_dtype = torch.bfloat16 if target.startswith("cuda") else torch.float32
        else:
            torch_dtype = getattr(torch, dtype)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model: Any = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype, local_files_only=True
        )
        return cls(
            model.to(target), tokenizer, max_num_seqs=max_num_seqs, max_model_len=max_model_len
        )

    async def start(self) -> None:
        if self._loop is None:
            self._loop = asyncio.create_task(self._run(), name="transformers-engine-steps")

    async def stop(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop
            self._loop = None
        for seq in list(self._live.values()) + [s for _, _, s in self._waiting]:
            seq.finish("cancelled")
        for seq in (s for group in self._static_groups for s in group):
            seq.finish("cancelled")
        self._live.clear()
        self._waiting.clear()
        self._cohorts.clear()
        self._static_groups.clear()

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        check_sampling(request, self.name, self.sampling_fields)
        seq = self._sequence(request)
        heapq.heappush(self._waiting, (request.priority, next(self._arrivals), seq))
        self._wakeup.set()
        async with contextlib.aclosing(self._follow(seq)) as outputs:
            async for out in outputs:
                yield out

    def generate_batch(
        self, requests: Sequence[EngineRequest]
    ) -> list[AsyncIterator[EngineOutput]]:
        """Queue the requests as static batches of up to `max_num_seqs` rows (StaticEngine)."""
        streams: list[AsyncIterator[EngineOutput]] = []
        group: list[_Sequence] = []
        for request in requests:
            try:
                check_sampling(request, self.name, self.sampling_fields)
                seq = self._sequence(request)
            except RequestRefused as exc:
                streams.append(_refused(exc))
                continue
            group.append(seq)
            streams.append(self._follow(seq))
        for start in range(0, len(group), self.max_num_seqs):
            self._static_groups.append(group[start : start + self.max_num_seqs])
        self._wakeup.set()
        return streams

    def _sequence(self, request: EngineRequest) -> _Sequence:
        """The request encoded; raises `RequestRefused` for a prompt or max_tokens the
        context cannot hold."""
        # What the request leaves unset is the model's generation config's.
        request = self.defaults.apply(request)
        ids = self._encode(request)
        # Unset: the rest of the context, as vLLM; never past it.
        seq = _Sequence(
            request, ids, tokens_to_generate(len(ids), request.max_tokens, self.context_length)
        )
        if _temperature(request) > 0:
            seq.generator = torch.Generator(device=self.device)
            seed = request.seed if request.seed is not None else hash(request.request_id)
            seq.generator.manual_seed(seed & 0x7FFFFFFFFFFFFFFF)
        return seq

    async def _follow(self, seq: _Sequence) -> AsyncGenerator[EngineOutput]:
        request = seq.request
        try:
            while True:
                out = await seq.outputs.get()
                yield out
                if isinstance(out, EngineFinish):
                    return
        finally:
            if not seq.finished:
                self._remove(request.request_id)
                seq.finish("cancelled")

    async def abort(self, request_id: str) -> bool:
        seq = self._remove(request_id)
        if seq is None:
            return False
        seq.finish("cancelled")
        return True

    def capacity(self) -> Capacity:
        running = max(len(self._live), self._static_width)
        waiting = [s for _, _, s in self._waiting]
        waiting += [s for group in self._static_groups for s in group]
        queued_tokens = sum(
            len(s.prompt_ids) + s.limit - len(s.generated)
            for s in list(self._live.values()) + waiting
        )
        return Capacity(
            total_slots=self.max_num_seqs,
            free_slots=max(0, self.max_num_seqs - running - len(waiting)),
            running=running,
            queued=len(waiting),
            queued_tokens=queued_tokens,
            utilisation=running / self.max_num_seqs,
        )

    def _encode(self, request: EngineRequest) -> list[int]:
        tok = self.tokenizer
        if request.messages is not None and getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in request.messages],
                tokenize=True,
                add_generation_prompt=True,
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        return [int(i) for i in tok(request.prompt)["input_ids"]] or [self._pad_id]

    def _remove(self, request_id: str) -> _Sequence | None:
        seq = self._live.pop(request_id, None)
        if seq is not None:
            return seq  # its row is pruned from the cohort at the next step boundary
        for i, (_, _, waiting) in enumerate(self._waiting):
            if waiting.request.request_id == request_id:
                self._waiting.pop(i)
                heapq.heapify(self._waiting)
                return waiting
        for group in self._static_groups:
            for seq in group:
                if seq.request.request_id == request_id:
                    group.remove(seq)
                    if not group:
                        self._static_groups.remove(group)
                    return seq
        return None

    async def _run(self) -> None:
        while True:
            if not self._waiting and not self._cohorts and not self._static_groups:
                self._wakeup.clear()
                await self._wakeup.wait()
            if self._static_groups and not self._cohorts:
                await self._run_static(self._static_groups.popleft())
                continue
            joined: list[_Sequence] = []
            while self._waiting and len(self._live) + len(joined) < self.max_num_seqs:
                joined.append(heapq.heappop(self._waiting)[2])
            for seq in joined:
                self._live[seq.request.request_id] = seq
            cohorts = list(self._cohorts)
            # One thread hop per step: prefill the joiners and decode every cohort.
            new_cohort, tokens = await asyncio.to_thread(self._step, joined, cohorts)
            if new_cohort is not None:
                self._cohorts.append(new_cohort)
            for cohort, picked in tokens:
                self._emit(cohort, picked)
            self._cohorts = [c for c in self._cohorts if c.rows]

    async def _run_static(self, rows: list[_Sequence]) -> None:
        """One static batch as one padded `model.generate`, its rows streamed as they go."""
        loop = asyncio.get_running_loop()
        for seq in rows:
            self._live[seq.request.request_id] = seq
        self._static_width = len(rows)

        def emit(picked: list[int]) -> None:
            for seq, token in zip(rows, picked, strict=True):
                if not seq.finished:
                    self._advance(seq, token)

        streamer = _RowStreamer(lambda picked: loop.call_soon_threadsafe(emit, picked))
        try:
            await asyncio.to_thread(self._generate_static, rows, streamer)
        finally:
            self._static_width = 0
            for seq in rows:  # generate ended before the row did (it cannot, but be sure)
                if not seq.finished:
                    self._end(seq, "length")

    def _generate_static(self, rows: list[_Sequence], streamer: _RowStreamer) -> None:
        width = max(len(s.prompt_ids) for s in rows)
        ids = [[self._pad_id] * (width - len(s.prompt_ids)) + s.prompt_ids for s in rows]
        mask = [[0] * (width - len(s.prompt_ids)) + [1] * len(s.prompt_ids) for s in rows]
        sampled = [s.request for s in rows if _temperature(s.request) > 0]
        sampling: dict[str, Any] = {"do_sample": False}
        if sampled:
            first = sampled[0]
            sampling = {
                "do_sample": True,
                "temperature": _temperature(first),
                "top_p": 1.0 if first.top_p is None else first.top_p,
                "top_k": first.top_k or None,
                "min_p": first.min_p or None,
            }
            if first.seed is not None:
                torch.manual_seed(first.seed)
        with torch.inference_mode():
            self.model.generate(
                input_ids=torch.tensor(ids, device=self.device),
                attention_mask=torch.tensor(mask, device=self.device),
                max_new_tokens=max(s.limit for s in rows),
                streamer=streamer,
                # Stop early once every row has ended (done, stopped or aborted).
                stopping_criteria=StoppingCriteriaList([_AllEnded(rows)]),
                pad_token_id=self._pad_id,
                eos_token_id=self.tokenizer.eos_token_id,
                **sampling,
            )

    def _step(
        self, joined: list[_Sequence], cohorts: list[_Cohort]
    ) -> tuple[_Cohort | None, list[tuple[_Cohort, list[int]]]]:
        out: list[tuple[_Cohort, list[int]]] = []
        with torch.inference_mode():
            for cohort in cohorts:
                self._prune(cohort)
                if cohort.rows:
                    out.append((cohort, self._decode(cohort)))
            new_cohort = None
            if joined:
                new_cohort, first = self._prefill(joined)
                out.append((new_cohort, first))
        return new_cohort, out

    def _prefill(self, rows: list[_Sequence]) -> tuple[_Cohort, list[int]]:
        width = max(len(s.prompt_ids) for s in rows)
        ids = [[self._pad_id] * (width - len(s.prompt_ids)) + s.prompt_ids for s in rows]
        mask = [[0] * (width - len(s.prompt_ids)) + [1] * len(s.prompt_ids) for s in rows]
        input_ids = torch.tensor(ids, device=self.device)
        attention_mask = torch.tensor(mask, device=self.device)
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        cache = _new_cache(self.model.config)
        logits = self._forward(input_ids, attention_mask, positions, cache)
        picked = self._sample(rows, logits)
        cohort = _Cohort(
            rows=list(rows),
            cache=cache,
            attention_mask=attention_mask,
            next_positions=positions[:, -1:] + 1,
            last_tokens=torch.tensor(picked, device=self.device)[:, None],
        )
        return cohort, picked

    def _decode(self, cohort: _Cohort) -> list[int]:
        mask = cohort.attention_mask
        ones = torch.ones((len(cohort.rows), 1), dtype=mask.dtype, device=self.device)
        cohort.attention_mask = torch.cat([cohort.attention_mask, ones], dim=1)
        logits = self._forward(
            cohort.last_tokens, cohort.attention_mask, cohort.next_positions, cohort.cache
        )
        cohort.next_positions = cohort.next_positions + 1
        picked = self._sample(cohort.rows, logits)
        cohort.last_tokens = torch.tensor(picked, device=self.device)[:, None]
        return picked

    def _forward(self, input_ids: Any, attention_mask: Any, positions: Any, cache: Any) -> Any:
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: cache},
        )
        return out.logits[:, -1, :].float()

    def _sample(self, rows: list[_Sequence], logits: Any) -> list[int]:
        # One argmax for the whole cohort: a per-row argmax would sync the GPU per row.
        picked: list[int] = logits.argmax(dim=-1).tolist()
        for row, seq in enumerate(rows):
            request = seq.request
            if _temperature(request) <= 0:
                continue
            scores = logits[row]
            if request.top_k is not None and 0 < request.top_k < scores.shape[-1]:
                kth = torch.topk(scores, request.top_k).values[-1]
                scores = scores.masked_fill(scores < kth, float("-inf"))
            probs = torch.softmax(scores / _temperature(request), dim=-1)
            if request.min_p:
                probs = probs.masked_fill(probs < request.min_p * probs.max(), 0.0)
            if request.top_p is not None and request.top_p < 1.0:
                sorted_probs, order = probs.sort(descending=True)
                keep = sorted_probs.cumsum(-1) - sorted_probs < request.top_p * sorted_probs.sum()
                probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
            picked[row] = int(torch.multinomial(probs, 1, generator=seq.generator))
        return picked

    def _prune(self, cohort: _Cohort) -> None:
        keep = [i for i, s in enumerate(cohort.rows) if not s.finished]
        if len(keep) == len(cohort.rows):
            return
        cohort.rows = [cohort.rows[i] for i in keep]
        if not keep:
            return
        index = torch.tensor(keep, device=self.device)
        cohort.cache.batch_select_indices(index)
        cohort.attention_mask = cohort.attention_mask[index]
        cohort.next_positions = cohort.next_positions[index]
        cohort.last_tokens = cohort.last_tokens[index]

    def _emit(self, cohort: _Cohort, picked: list[int]) -> None:
        for seq, token in zip(cohort.rows, picked, strict=True):
            if seq.finished:
                continue  # aborted while the step ran
            self._advance(seq, token)
        if all(s.finished for s in cohort.rows):
            cohort.rows = []

    def _advance(self, seq: _Sequence, token: int) -> None:
        request = seq.request
        if token == self.tokenizer.eos_token_id or token in (request.stop_token_ids or ()):
            self._flush(seq, self._text(seq), tokens=1)
            seq.generated.append(token)
            return self._end(seq, "stop")
        seq.generated.append(token)
        text = self._text(seq)
        hits = [
            i for s in request.stop if (i := text.find(s, max(0, seq.sent_chars - len(s)))) >= 0
        ]
        if hits:
            self._flush(seq, text[: min(hits)], tokens=1)
            return self._end(seq, "stop")
        if len(seq.generated) >= seq.limit:
            self._flush(seq, text, tokens=1)
            return self._end(seq, "length")
        # Hold back a partial character, and any tail that may yet become a stop string.
        holdable = max((len(s) - 1 for s in request.stop), default=0)
        safe = len(text) - holdable
        while safe > seq.sent_chars and text[safe - 1] == REPLACEMENT_CHAR:
            safe -= 1
        self._flush(seq, text[: max(safe, seq.sent_chars)], tokens=1)
        return None

    def _flush(self, seq: _Sequence, text: str, tokens: int) -> None:
        first = len(seq.prompt_ids) if not seq.prompt_told else None
        seq.prompt_told = True
        seq.outputs.put_nowait(EngineDelta(text[seq.sent_chars :], tokens, None, first))
        seq.sent_chars = max(seq.sent_chars, len(text))

    def _end(self, seq: _Sequence, reason: FinishReason) -> None:
        self._live.pop(seq.request.request_id, None)
        seq.finish(reason)

    def _text(self, seq: _Sequence) -> str:
        text: str = self.tokenizer.decode(seq.generated, skip_special_tokens=True)
        return text


def _temperature(request: EngineRequest) -> float:
    return 1.0 if request.temperature is None else request.temperature


@dataclass(frozen=True)
class SamplingDefaults:
    """The model's generation config, for the sampling fields a request leaves unset (as
    vLLM applies `generation_config.json`): greedy where it does not sample."""

    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None

    @classmethod
    def of(cls, config: Any) -> SamplingDefaults:
        if config is None:
            return cls()
        if not getattr(config, "do_sample", False):
            return cls(temperature=0.0)

        def number(name: str) -> Any:
            value = getattr(config, name, None)
            return value if isinstance(value, int | float) else None

        temperature = number("temperature")
        return cls(
            temperature=1.0 if temperature is None else float(temperature),
            top_p=number("top_p"),
            top_k=number("top_k"),
            min_p=number("min_p"),
        )

    def apply(self, request: EngineRequest) -> EngineRequest:
        return replace(
            request,
            temperature=self.temperature if request.temperature is None else request.temperature,
            top_p=self.top_p if request.top_p is None else request.top_p,
            top_k=self.top_k if request.top_k is None else request.top_k,
            min_p=self.min_p if request.min_p is None else request.min_p,
        )


def _new_cache(config: Any) -> Any:
    try:
        return DynamicCache(config=config)
    except TypeError:  # transformers before 4.56 takes no config
        return DynamicCache()


class _RowStreamer(BaseStreamer):  # type: ignore[misc,unused-ignore]
    """Gets each generation step's tokens, one per row, from `model.generate`'s thread.

    `generate` first puts the prompt (skipped here), then each step's new tokens.
    """

    def __init__(self, on_step: Callable[[list[int]], object]) -> None:
        self._on_step = on_step
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self._on_step([int(t) for t in value.reshape(-1).tolist()])

    def end(self) -> None:
        return None


class _AllEnded(StoppingCriteria):  # type: ignore[misc,unused-ignore]
    """Stops `model.generate` once every row of the batch has ended, however it ended."""

    def __init__(self, rows: list[_Sequence]) -> None:
        self._rows = rows

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        ended = all(s.finished for s in self._rows)
        return torch.full((input_ids.shape[0],), ended, dtype=torch.bool, device=input_ids.device)


async def _refused(exc: RequestRefused) -> AsyncIterator[EngineOutput]:
    """A row's stream that raises `exc` at its first step (the row never ran)."""
    raise exc
    yield  # an async generator all the same
