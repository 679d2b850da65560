"""The delta report of `tokenbus eval`: each item's answer on each variant, how each
candidate variant's answer agrees with the reference variant's (and with the item's own
`reference` where the set gives one), a summary per variant, and the items where a
candidate differs most: how a quantized variant is documented before it takes traffic.

Pure: the set and the answers in, the report (JSON-ready) and its Markdown out. Scores come
from shared/agreement.py, as shadow validation's do.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from statistics import fmean

from pydantic import Field

from shared.agreement import Agreement, score
from shared.messages import Model as Record
from tokenbus.eval_set import EvalItem

MOST_DIFFERENT = 10  # items listed under "where it differs most"
CELL_CHARS = 160  # of an answer shown in a Markdown table cell


class Answer(Record):
    """One item's outcome on one variant: its text, or why there is none."""

    text: str | None = Field(default=None, description="The whole answer; None: none came.")
    error: str | None = Field(default=None, description="`code: message`, or the timeout.")
    answered_by: str | None = Field(
        default=None, description="The variant `chat.done` names ('baseline': none)."
    )
    finish_reason: str | None = None
    completion_tokens: int | None = None
    seconds: float = Field(ge=0.0, description="From sending to the answer's end.")


class ItemReport(Record):
    id: str
    deterministic: bool = Field(description="Greedy or seeded: quality is exact match.")
    reference: str | None = Field(default=None, description="The set's expected answer.")
    answers: dict[str, Answer] = Field(description="By variant.")
    against_reference_variant: dict[str, Agreement] = Field(
        default_factory=dict,
        description="Each candidate variant's answer judged against the reference variant's"
        " (only where both answered).",
    )
    against_expected: dict[str, Agreement] = Field(
        default_factory=dict,
        description="Each variant's answer judged against the item's `reference`.",
    )


class Scores(Record):
    """Means over the items compared."""

    compared: int = Field(ge=0)
    exact_share: float | None = None
    f1: float | None = None
    rouge_l: float | None = None
    quality: float | None = None
    embedding: float | None = Field(
        default=None, description="Mean embedding similarity, where an embedding model gave one."
    )

    @classmethod
    def of(cls, found: Sequence[Agreement]) -> Scores:
        if not found:
            return cls(compared=0)
        embedded = [a.embedding for a in found if a.embedding is not None]
        return cls(
            compared=len(found),
            exact_share=fmean(1.0 if a.exact else 0.0 for a in found),
            f1=fmean(a.f1 for a in found),
            rouge_l=fmean(a.rouge_l for a in found),
            quality=fmean(a.quality for a in found),
            embedding=fmean(embedded) if embedded else None,
        )


class VariantSummary(Record):
    variant: str
    answered: int = Field(ge=0)
    failed: int = Field(ge=0, description="Items with no answer (an error or the timeout).")
    against_reference_variant: Scores | None = Field(
        default=None, description="None for the reference variant itself."
    )
    against_expected: Scores


class Difference(Record):
    """An item where a candidate's answer differs from the reference variant's."""

    id: str
    variant: str
    f1: float
    rouge_l: float


class EvalReport(Record):
    model: str
    reference_variant: str = Field(description="The variant the others are judged against.")
    variants: list[str]
    set: str = Field(description="The set's file.")
    created_at: float = Field(description="Unix time, seconds.")
    items: list[ItemReport]
    summary: list[VariantSummary]
    most_different: list[Difference] = Field(
        description="Candidate answers that are not exact, least alike first."
    )


def build_report(
    *,
    model: str,
    variants: Sequence[str],
    set_name: str,
    items: Sequence[EvalItem],
    answers: Mapping[tuple[str, str], Answer],
    created_at: float | None = None,
    similarity: Mapping[tuple[str, str], float] | None = None,
) -> EvalReport:
    """The report of `items` run on each of `variants` (the first is the reference);
    `answers` by (item id, variant), every pair present; `similarity`: the embedding
    similarity of (reference text, judged text) pairs (`compared`), where known."""
    reference, candidates = variants[0], list(variants[1:])
    sims = similarity or {}
    reports = [_item_report(item, variants, answers, sims) for item in items]
    summary = [_summary(v, v == reference, reports) for v in variants]
    differences = [
        Difference(id=r.id, variant=v, f1=a.f1, rouge_l=a.rouge_l)
        for r in reports
        for v in candidates
        if (a := r.against_reference_variant.get(v)) is not None and not a.exact
    ]
    differences.sort(key=lambda d: (d.rouge_l, d.f1, d.id, d.variant))
    return EvalReport(
        model=model,
        reference_variant=reference,
        variants=list(variants),
        set=set_name,
        created_at=time.time() if created_at is None else created_at,
        items=reports,
        summary=summary,
        most_different=differences[:MOST_DIFFERENT],
    )


def compared(
    items: Sequence[EvalItem],
    variants: Sequence[str],
    answers: Mapping[tuple[str, str], Answer],
) -> set[tuple[str, str]]:
    """Every (reference text, judged text) pair the report scores: what an embedding
    model is asked about (`tokenbus eval --embedding-url`)."""
    pairs = set()
    for item in items:
        texts = {v: answers[(item.id, v)].text for v in variants}
        base = texts[variants[0]]
        for v, text in texts.items():
            if text is None:
                continue
            if base is not None and v != variants[0]:
                pairs.add((base, text))
            if item.reference is not None:
                pairs.add((item.reference, text))
    return pairs


def _item_report(
    item: EvalItem,
    variants: Sequence[str],
    answers: Mapping[tuple[str, str], Answer],
    sims: Mapping[tuple[str, str], float],
) -> ItemReport:
    mine = {v: answers[(item.id, v)] for v in variants}
    base = mine[variants[0]].text
    det = item.deterministic

    def judged(reference: str, text: str) -> Agreement:
        return score(reference, text, deterministic=det, embedding=sims.get((reference, text)))

    return ItemReport(
        id=item.id,
        deterministic=det,
        reference=item.reference,
        answers=mine,
        against_reference_variant={
            v: judged(base, text)
            for v in variants[1:]
            if base is not None and (text := mine[v].text) is not None
        },
        against_expected={
            v: judged(item.reference, text)
            for v in variants
            if item.reference is not None and (text := mine[v].text) is not None
        },
    )


def _summary(variant: str, is_reference: bool, reports: Sequence[ItemReport]) -> VariantSummary:
    answered = sum(r.answers[variant].text is not None for r in reports)
    vs_variant = [a for r in reports if (a := r.against_reference_variant.get(variant)) is not None]
    vs_expected = [a for r in reports if (a := r.against_expected.get(variant)) is not None]
    return VariantSummary(
        variant=variant,
        answered=answered,
        failed=len(reports) - answered,
        against_reference_variant=None if is_reference else Scores.of(vs_variant),
        against_expected=Scores.of(vs_expected),
    )


# -- Markdown ------------------------------------------------------------------------------------


def markdown(report: EvalReport) -> str:
    """The report for people: the summary, where the candidates differ most, every item."""
    ref = report.reference_variant
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(report.created_at))
    out = [
        f"# Evaluation of {report.model}: {', '.join(report.variants[1:])} against {ref}",
        "",
        f"Set `{report.set}`, {len(report.items)} items, run {when}. Each item ran once on"
        f" each variant (pinned); a candidate's answer is judged against {ref}'s answer to"
        " the same item (exact match, token F1, ROUGE-L; quality: exact match for greedy or"
        " seeded items, else the embedding similarity where an embedding model was given,"
        " else ROUGE-L), and against the item's `reference` where it has one.",
        "",
        "## Summary",
        "",
        f"| variant | answered | failed | exact vs {ref} | F1 vs {ref} | ROUGE-L vs {ref}"
        f" | quality vs {ref} | exact vs reference | F1 vs reference | ROUGE-L vs reference |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in report.summary:
        v, e = s.against_reference_variant, s.against_expected
        against = ["—"] * 4 if v is None else [_share(v.exact_share), *_means(v)]
        expected = [_share(e.exact_share), _num(e.f1), _num(e.rouge_l)]
        out.append(_row([s.variant, str(s.answered), str(s.failed), *against, *expected]))
    embedded = [
        f"{s.variant} {_num(v.embedding)}"
        for s in report.summary
        if (v := s.against_reference_variant) is not None and v.embedding is not None
    ]
    if embedded:
        out += ["", f"Embedding similarity vs {ref} (mean; quality of sampled items):"]
        out.append(", ".join(embedded) + ".")
    out += ["", f"## Where the candidates differ from {ref} most", ""]
    if not report.most_different:
        out.append(f"Every answer compared is exactly {ref}'s.")
    else:
        out += [
            f"| item | variant | ROUGE-L | F1 | {ref}'s answer | the variant's answer |",
            "|---|---|---|---|---|---|",
        ]
        by_id = {r.id: r for r in report.items}
        for d in report.most_different:
            answers = by_id[d.id].answers
            out.append(
                _row(
                    [
                        d.id,
                        d.variant,
                        _num(d.rouge_l),
                        _num(d.f1),
                        _cell(answers[ref]),
                        _cell(answers[d.variant]),
                    ]
                )
            )
    out += ["", "## Items", "", f"| item | variant | exact vs {ref} | F1 | ROUGE-L | answer |"]
    out.append("|---|---|---|---|---|---|")
    for r in report.items:
        for name, answer in r.answers.items():
            a = r.against_reference_variant.get(name)
            scores = ["—"] * 3 if a is None else ["yes" if a.exact else "no", *_means(a)[:2]]
            out.append(_row([r.id, name, *scores, _cell(answer)]))
    return "\n".join(out) + "\n"


def _means(s: Scores | Agreement) -> list[str]:
    return [_num(s.f1), _num(s.rouge_l), _num(s.quality)]


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def _share(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f} %"


def _cell(answer: Answer) -> str:
    if answer.text is None:
        return f"*no answer: {answer.error or 'unknown'}*"
    text = " ".join(answer.text.split())
    return text if len(text) <= CELL_CHARS else text[: CELL_CHARS - 1] + "…"


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
