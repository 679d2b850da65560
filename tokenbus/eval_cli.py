"""`tokenbus eval --set FILE --variants A,B`: run a fixed set through the bus on each variant
of a model and write the delta report (JSON and Markdown): how a quantized variant is
documented before it takes traffic (docs/lifecycle.md, "Offline evaluation").

The first variant is the reference; `baseline` names the model's workers without a variant.
Each item runs once per variant, pinned to it (services/scheduler/pinned.py), at most
`--concurrency` at a time; an item that fails or times out on a variant is reported as such,
and the run goes on. With `--embedding-url` and `--embedding-model`, each compared pair of
answers also gets its embedding similarity (`eval_embeddings.py`). Exit 2: a bad set,
variant list or option, or a variant with no live worker; 1: the broker cannot be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from aiokafka.errors import KafkaError
from pydantic import SecretStr

from shared.embeddings import EmbeddingSimilarity
from shared.kafka import KafkaLoginRefused
from shared.logs import configure_logging
from shared.messages import VARIANT_NAME, Tier
from shared.settings import TokenbusSettings
from tokenbus.eval_bus import RunConfig, run_set
from tokenbus.eval_embeddings import similarities
from tokenbus.eval_report import Answer, build_report, compared, markdown
from tokenbus.eval_set import EvalItem, EvalSetError, load_set
from tokenbus.models_cli import TopicMissing, read_deployment, statuses

if TYPE_CHECKING:
    from tokenbus.commands import Subcommands

PROG = "tokenbus eval"


class Refused(ValueError):
    """What the command was asked cannot be run (exit 2); the message says why."""


def register(commands: Subcommands) -> None:
    parser = commands.add_parser(
        "eval",
        help="run a set on variants of a model and write the delta report (JSON, Markdown)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--set",
        required=True,
        type=Path,
        dest="set_file",
        metavar="FILE",
        help="JSONL, one item a line: {id, messages or prompt, max_tokens?, temperature?"
        " (unset: 0), seed?, reference?}",
    )
    parser.add_argument(
        "--variants",
        required=True,
        metavar="A,B",
        help="the variants to compare, the reference first ('baseline': the workers without"
        " a variant)",
    )
    parser.add_argument(
        "--model", default=None, help="the served model (default: the one live model, if one)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where report.json and report.md go (default: ./eval-<model>-<UTC time>)",
    )
    parser.add_argument(
        "--concurrency", type=int, default=8, help="the most requests in flight at once"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds each item may take on a variant (its deadline); past it, it is"
        " reported as failed",
    )
    parser.add_argument(
        "--priority",
        choices=[t.value for t in Tier],
        default=Tier.background.value,
        help="the tier the items ride in",
    )
    parser.add_argument(
        "--embedding-url",
        default=None,
        metavar="URL",
        help="an OpenAI-compatible embeddings API (http://host:port/v1): each compared pair"
        " of answers also gets its embedding similarity (key: TOKENBUS_EVAL_EMBEDDING_API_KEY)",
    )
    parser.add_argument(
        "--embedding-model", default=None, metavar="NAME", help="the embedding model's name"
    )
    parser.set_defaults(handler=_eval)


def embedding_of(args: argparse.Namespace) -> EmbeddingSimilarity | None:
    url, model = args.embedding_url, args.embedding_model
    if url is None and model is None:
        return None
    if url is None or model is None:
        raise Refused("--embedding-url and --embedding-model go together")
    if not re.match(r"^https?://", url):
        raise Refused(f"--embedding-url: an http(s) URL, not {url!r}")
    key = os.environ.get("TOKENBUS_EVAL_EMBEDDING_API_KEY")
    return EmbeddingSimilarity(url, model, None if key is None else SecretStr(key))


def variant_list(text: str) -> list[str]:
    """The variants of `--variants`, in order; raises Refused unless two or more distinct
    variant names."""
    names = [n.strip() for n in text.split(",")]
    if bad := [n for n in names if not re.fullmatch(VARIANT_NAME, n)]:
        raise Refused(f"--variants: {bad[0]!r} is not a variant name (letters, digits, . _ -)")
    if len(set(names)) != len(names):
        raise Refused(f"--variants: each variant once, not {','.join(names)}")
    if len(names) < 2:
        raise Refused("--variants: name two or more (the reference first), e.g. baseline,fp8")
    return names


def choose_model(given: str | None, live: dict[str, set[str]]) -> str:
    """The model to run on: `given`, or the one model with live workers; raises Refused."""
    if given is not None:
        return given
    if len(live) != 1:
        found = ", ".join(sorted(live)) or "none"
        raise Refused(f"--model: name the model to evaluate (models with live workers: {found})")
    return next(iter(live))


def check_variants(model: str, variants: list[str], live: dict[str, set[str]]) -> None:
    """Raises Refused unless every variant has a live worker of `model` (a pinned request
    would wait for one until its deadline)."""
    if model not in live:
        found = ", ".join(sorted(live)) or "none"
        raise Refused(f"model {model!r} has no live worker (models with live workers: {found})")
    for variant in variants:
        if variant not in live[model]:
            serving = ", ".join(sorted(live[model]))
            raise Refused(
                f"--variants: {variant!r} is not a variant of {model!r} with a live worker"
                f" (live: {serving})"
            )


def _eval(args: argparse.Namespace) -> int:
    try:
        variants = variant_list(args.variants)
        if args.concurrency < 1:
            raise Refused("--concurrency: at least 1")
        if not 0 < args.timeout <= 86_400:
            raise Refused("--timeout: seconds, above 0 and at most a day")
        items = load_set(args.set_file)
        embedding = embedding_of(args)
    except (Refused, EvalSetError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    configure_logging("tokenbus-eval", level="WARNING")  # stdout: the command's answer
    settings = TokenbusSettings()
    try:
        rollouts, beats = asyncio.run(read_deployment(settings))
        live = {
            s.model: {v.name for v in s.variants if v.workers} for s in statuses(rollouts, beats)
        }
        live = {model: names for model, names in live.items() if names}
        model = choose_model(args.model, live)
        check_variants(model, variants, live)
    except Refused as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except (TimeoutError, KafkaError, KafkaLoginRefused, TopicMissing) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    config = RunConfig(model, variants, args.concurrency, args.timeout, Tier(args.priority))
    progress = _Progress(len(items) * len(variants))
    print(
        f"{PROG}: {len(items)} items x {len(variants)} variants of {model}"
        f" ({', '.join(variants)}), {args.concurrency} at a time",
        file=sys.stderr,
    )
    try:
        answers = asyncio.run(run_set(settings, items, config, progress))
    except (TimeoutError, KafkaError, KafkaLoginRefused) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    except ExceptionGroup as group:  # the reader's or a send's, from the run's task group
        broker, rest = group.split((TimeoutError, KafkaError, KafkaLoginRefused))
        if broker is None or rest is not None:
            raise
        print(f"{PROG}: {broker.exceptions[0]}", file=sys.stderr)
        return 1
    sims = (
        {}
        if embedding is None
        else asyncio.run(similarities(compared(items, variants, answers), embedding, PROG))
    )
    return _write(args, model, variants, items, answers, sims)


def _write(
    args: argparse.Namespace,
    model: str,
    variants: list[str],
    items: list[EvalItem],
    answers: dict[tuple[str, str], Answer],
    similarity: dict[tuple[str, str], float],
) -> int:
    report = build_report(
        model=model,
        variants=variants,
        set_name=str(args.set_file),
        items=items,
        answers=answers,
        similarity=similarity,
    )
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(report.created_at))
    out: Path = args.out or Path(f"eval-{re.sub(r'[^A-Za-z0-9._-]', '_', model)}-{stamp}")
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(report.model_dump_json(indent=2) + "\n")
        (out / "report.md").write_text(markdown(report))
    except OSError as exc:
        print(f"{PROG}: cannot write the report to {out}: {exc}", file=sys.stderr)
        return 1
    for s in report.summary:
        vs = s.against_reference_variant
        against = (
            "reference"
            if vs is None or vs.exact_share is None
            else f"exact {100 * vs.exact_share:.1f} %, F1 {vs.f1:.3f}, ROUGE-L {vs.rouge_l:.3f}"
            + ("" if vs.embedding is None else f", embedding {vs.embedding:.3f}")
        )
        print(f"{s.variant:<20} answered {s.answered}/{s.answered + s.failed}  {against}")
    print(f"report: {out / 'report.md'} and {out / 'report.json'}")
    return 0


class _Progress:
    """One line on stderr per answer: how far the run is, and what failed."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.failed = 0

    def __call__(self, item: str, variant: str, answer: Answer) -> None:
        self.done += 1
        self.failed += answer.text is None
        what = f"failed: {answer.error}" if answer.text is None else f"{answer.seconds:.1f} s"
        print(
            f"{PROG}: [{self.done}/{self.total}] {item} on {variant}: {what}"
            f" ({self.failed} failed so far)",
            file=sys.stderr,
            flush=True,
        )
