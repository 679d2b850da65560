"""The capacity model of docs/capacity.md: replicas, partitions, brokers and Kafka traffic
for a number of GPUs, from measured figures that are easy to replace.

Every input is in `FIGURES` (CPU per request per service, with where it was measured) or
`WORKLOAD` (the request shape and record sizes); the GPU side comes from the sim engine's
cost model (`services/worker/engines/sim_profiles.py`). `python -m deploy.capacity
--update docs/capacity.md` rewrites the generated tables; tests/test_capacity.py fails
when they are stale.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from services.worker.engines.sim_profiles import PROFILES, CostModel
from shared.topics import Topics


@dataclass(frozen=True)
class CpuFigures:
    """CPU per request of each service (ms) at `tokens_per_request` output tokens, and where
    the numbers come from.

    Edge and worker handle every result record, so their cost grows with the output: for
    another request shape it is scaled by output tokens (the fixed part scaled with it, so
    for longer outputs an over- rather than an under-estimate). Ingest and the scheduler see
    each request once, whatever its length.
    """

    label: str
    source: str
    tokens_per_request: float
    edge_ms: float
    ingest_ms: float
    scheduler_ms: float
    worker_ms: float  # the worker's own CPU, not the engine's (the GPU's host thread)

    def at(self, output_tokens: int) -> CpuFigures:
        """The same figures for requests of `output_tokens` output tokens."""
        scale = output_tokens / self.tokens_per_request
        return CpuFigures(
            self.label,
            self.source,
            output_tokens,
            self.edge_ms * scale,
            self.ingest_ms,
            self.scheduler_ms,
            self.worker_ms * scale,
        )


FIGURES = (
    CpuFigures(
        label="measured 2026-11-30 (make bench)",
        source=(
            "`make bench` (bench/capacity.py), docs/benchmarks.md's capacity run of"
            " 2026-11-30 21:57 UTC (ADR 0041: the edge writes most requests straight to a"
            " tier topic): /proc CPU of each process at the pipeline's ceiling, 500 req/s on"
            " 2 cores, 64 output tokens per request, engine time apart. Ingest's figure is"
            " per request that passes it, from the 18:42 run, when every request did"
        ),
        tokens_per_request=64,
        edge_ms=1.04,
        ingest_ms=0.46,
        scheduler_ms=0.46,
        worker_ms=0.70,
    ),
    CpuFigures(
        label="issue 12 target",
        source=(
            "issue 12's target for the four services together: 0.5 ms + 20 us per output"
            " token per request (1.78 ms at 64 tokens), split here like the measured row"
            " (ingest's share apart)."
        ),
        tokens_per_request=64,
        edge_ms=1.78 * 1.04 / 2.20,
        ingest_ms=1.78 * 0.46 / 2.20,
        scheduler_ms=1.78 * 0.46 / 2.20,
        worker_ms=1.78 * 0.70 / 2.20,
    ),
)


@dataclass(frozen=True)
class Workload:
    prompt_tokens: int = 512
    output_tokens: int = 128
    bytes_per_token: float = 4.0  # UTF-8 English text, about four characters per token
    record_overhead_bytes: int = 400  # JSON envelope, headers (trace context), batch framing
    flush_tokens: int = 16  # TOKENBUS_WORKER_FLUSH_TOKENS: tokens per result record
    max_num_seqs: int = 64  # TOKENBUS_WORKER_MAX_NUM_SEQS, the sim profiles' batch
    cpu_target: float = 0.7  # a replica is sized to run at 70 % of its one core (asyncio)
    replication: int = 3  # copies of each topic (min.insync.replicas 2)
    broker_write_mb_s: float = 50.0  # replicated writes one broker takes with headroom
    profile: str = "llama3-8b-h100"
    # Requests that pass ingest: applications' (written to tokenbus.requests) and the edge's
    # that the response cache may answer (temperature 0 or a seed). The edge writes the rest
    # straight to a tier topic (ADR 0041). An assumption to replace with a deployment's mix.
    ingest_share: float = 0.2


WORKLOAD = Workload()
GPUS = (1, 8, 64)


def gpu_requests_per_second(cost: CostModel, w: Workload) -> float:
    """One GPU at full batch: prefill of the prompt (compute-bound) plus the output tokens'
    share of decode steps of `max_num_seqs` sequences (memory-bound)."""
    prefill_s = w.prompt_tokens * cost.flops_per_token / (cost.peak_flops * cost.compute_efficiency)
    kv = w.max_num_seqs * (w.prompt_tokens + w.output_tokens // 2)
    decode_s = cost.step_seconds(w.max_num_seqs, kv, 0) / w.max_num_seqs
    return 1.0 / (prefill_s + w.output_tokens * decode_s)


@dataclass(frozen=True)
class Plan:
    gpus: int
    requests_s: float
    output_tokens_s: float
    edges: int
    ingest: int
    schedulers: int
    worker_cores: float  # CPU one worker process needs to keep its GPU busy
    partitions: dict[str, int]
    brokers: int
    produce_mb_s: float
    consume_mb_s: float


def replicas(requests_s: float, cpu_ms: float, w: Workload) -> int:
    return max(1, math.ceil(requests_s * cpu_ms / 1000 / w.cpu_target))


def plan(gpus: int, measured: CpuFigures, w: Workload = WORKLOAD) -> Plan:
    cost = PROFILES[w.profile].cost
    assert isinstance(cost, CostModel), f"{w.profile} has no GPU cost model"
    cpu = measured.at(w.output_tokens)
    rps = gpus * gpu_requests_per_second(cost, w)
    edges = max(2, replicas(rps, cpu.edge_ms, w))
    ingest = replicas(rps * w.ingest_share, cpu.ingest_ms, w)
    schedulers = replicas(rps, cpu.scheduler_ms, w)
    topics = Topics("tokenbus")
    fixed = topics.partitions()
    # A consumer group uses at most one consumer per partition: each topic needs at least
    # as many partitions as its consumers, and never fewer than today's defaults.
    partitions = {
        "requests": max(fixed[topics.requests], ingest),
        "requests.<tier>": max(fixed[topics.tiers[0]], schedulers),
        "batches": fixed[topics.batches],
        "results": max(fixed[topics.results], edges),
    }
    request_bytes = w.prompt_tokens * w.bytes_per_token + w.record_overhead_bytes
    result_records = math.ceil(w.output_tokens / w.flush_tokens) + 1  # deltas + done
    result_bytes = w.output_tokens * w.bytes_per_token + result_records * w.record_overhead_bytes
    # requests (ingest's share), tier topic, batches (each request once), results.
    produce = rps * ((2 + w.ingest_share) * request_bytes + result_bytes) / 1e6
    # Every worker reads the whole batches partition it shares (TOKENBUS_WORKER_BATCH_PARTITION
    # is one value for the Deployment) and keeps the batches addressed to it.
    consume = rps * ((1 + w.ingest_share + gpus) * request_bytes + result_bytes) / 1e6
    brokers = max(3, math.ceil(produce * w.replication / w.broker_write_mb_s))
    return Plan(
        gpus, rps, rps * w.output_tokens, edges, ingest, schedulers,
        rps / gpus * cpu.worker_ms / 1000, partitions, brokers,
        produce, consume,
    )  # fmt: skip


def markdown(w: Workload = WORKLOAD) -> str:
    cost = PROFILES[w.profile].cost
    assert isinstance(cost, CostModel), f"{w.profile} has no GPU cost model"
    per_gpu = gpu_requests_per_second(cost, w)
    out = [
        f"Workload: {w.prompt_tokens}-token prompts, {w.output_tokens} output tokens, "
        f"`{w.profile}` at {w.max_num_seqs} sequences: **{per_gpu:.1f} requests/s "
        f"({per_gpu * w.output_tokens:,.0f} output tokens/s) per GPU**. Replicas at "
        f"{w.cpu_target:.0%} of one core each; replication factor {w.replication}; "
        f"{w.broker_write_mb_s:.0f} MB/s of replicated writes per broker; "
        f"{w.ingest_share:.0%} of requests pass ingest (applications' and cacheable ones;"
        " the edge writes the rest straight to a tier topic, ADR 0041).",
        "",
    ]
    for measured in FIGURES:
        cpu = measured.at(w.output_tokens)
        out += [
            f"#### CPU figures: {cpu.label}",
            "",
            f"edge {cpu.edge_ms:.2f} ms, ingest {cpu.ingest_ms:.2f} ms, scheduler "
            f"{cpu.scheduler_ms:.2f} ms, worker {cpu.worker_ms:.2f} ms of CPU per request "
            f"of {w.output_tokens} output tokens (measured at {measured.tokens_per_request:.0f};"
            f" edge and worker scaled by output tokens). Source: {cpu.source}",
            "",
            "| GPUs | requests/s | output tokens/s | edges | ingest | schedulers | "
            "worker cores per GPU | partitions: requests / tier / batches / results | "
            "brokers | Kafka produce MB/s | Kafka consume MB/s |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for gpus in GPUS:
            p = plan(gpus, measured, w)
            parts = " / ".join(str(p.partitions[k]) for k in p.partitions)
            out.append(
                f"| {gpus} | {p.requests_s:,.0f} | {p.output_tokens_s:,.0f} | {p.edges} | "
                f"{p.ingest} | {p.schedulers} | {p.worker_cores:.2f} | {parts} | {p.brokers} | "
                f"{p.produce_mb_s:.1f} | {p.consume_mb_s:.1f} |"
            )
        out.append("")
    return "\n".join(out).rstrip() + "\n"


START = "<!-- capacity-model:start (python -m deploy.capacity --update docs/capacity.md) -->"
END = "<!-- capacity-model:end -->"


def with_tables(doc: str) -> str:
    head, rest = doc.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{markdown()}{END}{tail}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--update", type=Path, metavar="DOC", help="rewrite its tables")
    args = parser.parse_args()
    if args.update is None:
        print(markdown())
        return
    path: Path = args.update
    path.write_text(with_tables(path.read_text()))
    print(f"updated the capacity tables in {path}")


if __name__ == "__main__":
    main()
