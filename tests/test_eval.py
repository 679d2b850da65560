"""`tokenbus eval` on plain values: the set's file and its errors (tokenbus/eval_set.py), a
result stream made an answer (eval_bus.py `Stream`), the delta report and its Markdown
(eval_report.py), and what the command refuses before it reaches Kafka (eval_cli.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.messages import (
    DeltaResult,
    DoneResult,
    ErrorCode,
    ErrorResult,
    ReplyTo,
    ResetResult,
    ResultRecord,
    Tier,
    Timings,
    Usage,
)
from tokenbus.cli import main
from tokenbus.eval_bus import Stream
from tokenbus.eval_cli import Refused, check_variants, choose_model, variant_list
from tokenbus.eval_report import Answer, build_report, compared, markdown
from tokenbus.eval_set import EvalItem, EvalSetError, load_set


def write_set(tmp_path: Path, *lines: object) -> Path:
    path = tmp_path / "set.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


# -- the set ------------------------------------------------------------------------------------


def test_a_set_is_read_in_order_with_greedy_as_the_default(tmp_path: Path) -> None:
    path = write_set(
        tmp_path,
        {"id": "a", "prompt": "one", "max_tokens": 4, "reference": "uno"},
        "",
        {"id": "b", "messages": [{"role": "user", "content": "two"}], "temperature": 0.7},
        {"id": "c", "prompt": "three", "temperature": 0.7, "seed": 3},
    )
    items = load_set(path)
    assert [i.id for i in items] == ["a", "b", "c"]
    assert [(i.temperature, i.deterministic) for i in items] == [
        (0.0, True),
        (0.7, False),
        (0.7, True),
    ]
    record = items[0].request(
        request_id="r-0-fp8",
        model="m",
        variant="fp8",
        reply_to=ReplyTo(topic="t.replies"),
        deadline_ms=5000,
        tier=Tier.background,
    )
    assert (record.model, record.variant, record.cache, record.max_tokens) == ("m", "fp8", False, 4)
    assert not record.cacheable


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "set.jsonl:2: not JSON: Expecting property name"),
        ("[1, 2]", "set.jsonl:2: an item is a JSON object, not list"),
        ('{"id": "x"}', "set.jsonl:2: request: exactly one of messages or prompt"),
        ('{"id": "x", "prompt": "p", "temperature": 3}', "set.jsonl:2: temperature: Input should"),
        ('{"id": "x", "prompt": "p", "colour": 1}', "set.jsonl:2: colour: Extra inputs"),
        ('{"id": "a", "prompt": "again"}', "set.jsonl:2: id 'a' again (first on line 1)"),
    ],
)
def test_a_bad_line_is_named_with_its_file_and_number(
    tmp_path: Path, line: str, message: str
) -> None:
    path = write_set(tmp_path, {"id": "a", "prompt": "fine"}, line)
    with pytest.raises(EvalSetError) as raised:
        load_set(path)
    assert str(raised.value).startswith(str(tmp_path / message)), raised.value


def test_an_empty_or_missing_set_is_refused(tmp_path: Path) -> None:
    with pytest.raises(EvalSetError, match="no item"):
        load_set(write_set(tmp_path, ""))
    with pytest.raises(EvalSetError, match="cannot be read"):
        load_set(tmp_path / "absent.jsonl")


# -- a result stream made an answer -------------------------------------------------------------

TIMINGS = Timings(queue_ms=1, batch_size=1, ttft_ms=1, total_ms=2)


def done(attempt: int = 0, variant: str | None = None) -> DoneResult:
    return DoneResult(
        request_id="r",
        attempt=attempt,
        seq=9,
        finish_reason="length",
        usage=Usage(prompt_tokens=1, completion_tokens=3),
        timings=TIMINGS,
        model="m",
        variant=variant,
    )


def delta(seq: int, text: str, attempt: int = 0) -> DeltaResult:
    return DeltaResult(request_id="r", attempt=attempt, seq=seq, text=text)


def test_a_stream_keeps_the_latest_attempt_in_order_and_ends_at_its_first_final() -> None:
    stream = Stream()
    before: list[ResultRecord] = [delta(0, "stale "), ResetResult(request_id="r", attempt=1)]
    again = [delta(1, "world", 1), delta(0, "hello ", 1), delta(1, "world", 1)]
    for record in [*before, *again]:
        assert not stream.take(record)
    assert not stream.take(delta(2, " zombie", 0))  # an attempt superseded
    assert stream.take(done(1, "fp8"))
    assert not stream.take(delta(2, " after", 1))
    answer = stream.answer(0.5)
    assert (answer.text, answer.answered_by, answer.completion_tokens) == ("hello world", "fp8", 3)
    baseline = Stream()
    assert baseline.take(done())
    assert baseline.answer(0.1).answered_by == "baseline"


def test_an_error_is_an_answer_without_text() -> None:
    stream = Stream()
    error = ErrorResult.for_request("r", ErrorCode.deadline_exceeded, "too late")
    assert stream.take(error)
    answer = stream.answer(2.0)
    assert answer.text is None
    assert answer.error == "deadline_exceeded: too late"


# -- the report ---------------------------------------------------------------------------------


def items() -> list[EvalItem]:
    return [
        EvalItem(id="same", prompt="p1", reference="the cat sat"),
        EvalItem(id="apart", prompt="p2"),
        EvalItem(id="late", prompt="p3"),
    ]


def ok(text: str, by: str) -> Answer:
    return Answer(text=text, answered_by=by, seconds=0.1)


def three_answers() -> dict[tuple[str, str], Answer]:
    """`items()` on baseline and fp8: the same, apart, and one fp8 did not answer."""
    return {
        ("same", "baseline"): ok("the cat sat", "baseline"),
        ("same", "fp8"): ok("the cat sat", "fp8"),
        ("apart", "baseline"): ok("a dog ran far away", "baseline"),
        ("apart", "fp8"): ok("a dog walked", "fp8"),
        ("late", "baseline"): ok("anything", "baseline"),
        ("late", "fp8"): Answer(error="timeout: no answer within 5 s", seconds=20.0),
    }


def test_the_report_judges_each_candidate_against_the_reference_variant() -> None:
    answers = three_answers()
    report = build_report(
        model="m",
        variants=["baseline", "fp8"],
        set_name="set.jsonl",
        items=items(),
        answers=answers,
        created_at=0.0,
    )
    same, apart, late = report.items
    assert same.against_reference_variant["fp8"].exact
    assert same.against_expected["baseline"].exact
    assert same.against_expected["fp8"].quality == 1.0
    assert not apart.against_reference_variant["fp8"].exact
    assert 0 < apart.against_reference_variant["fp8"].rouge_l < 1
    assert late.against_reference_variant == {}  # no answer, no score
    base, fp8 = report.summary
    assert (base.answered, base.failed, base.against_reference_variant) == (3, 0, None)
    assert (fp8.answered, fp8.failed) == (2, 1)
    assert fp8.against_reference_variant is not None
    assert fp8.against_reference_variant.compared == 2
    assert fp8.against_reference_variant.exact_share == 0.5
    assert fp8.against_expected.compared == 1
    assert [(d.id, d.variant) for d in report.most_different] == [("apart", "fp8")]
    text = markdown(report)
    assert text.startswith("# Evaluation of m: fp8 against baseline\n")
    assert "| fp8 | 2 | 1 | 50.0 % |" in text
    assert "## Where the candidates differ from baseline most" in text
    assert "| apart | fp8 |" in text
    assert "*no answer: timeout: no answer within 5 s*" in text
    assert json.loads(report.model_dump_json())["reference_variant"] == "baseline"


def test_embedding_similarities_join_the_scores_of_the_pairs_they_were_asked_for() -> None:
    answers = three_answers()
    variants = ["baseline", "fp8"]
    pairs = compared(items(), variants, answers)
    # Each candidate against the reference variant, each variant against the set's reference.
    assert pairs == {
        ("the cat sat", "the cat sat"),
        ("a dog ran far away", "a dog walked"),
    }
    report = build_report(
        model="m",
        variants=variants,
        set_name="set.jsonl",
        items=items(),
        answers=answers,
        created_at=0.0,
        similarity={("a dog ran far away", "a dog walked"): 0.8},  # one pair the API failed
    )
    same, apart, _ = report.items
    assert same.against_reference_variant["fp8"].embedding is None
    assert apart.against_reference_variant["fp8"].embedding == 0.8
    [fp8] = [s for s in report.summary if s.variant == "fp8"]
    assert fp8.against_reference_variant is not None
    assert fp8.against_reference_variant.embedding == 0.8  # the mean of those it has
    assert "Embedding similarity vs baseline (mean; quality of sampled items):" in markdown(report)
    plain = build_report(
        model="m", variants=variants, set_name="s", items=items(), answers=answers, created_at=0
    )
    assert "Embedding similarity" not in markdown(plain)


# -- what the command refuses before Kafka ------------------------------------------------------


def test_variants_are_two_or_more_distinct_names() -> None:
    assert variant_list("baseline, fp8") == ["baseline", "fp8"]
    for bad, why in [
        ("baseline", "name two or more"),
        ("a,a", "each variant once"),
        ("a,b/c", "'b/c' is not a variant name"),
        ("a,", "'' is not a variant name"),
    ]:
        with pytest.raises(Refused, match=why):
            variant_list(bad)


def test_the_model_and_its_variants_must_have_live_workers() -> None:
    live = {"m": {"baseline", "fp8"}}
    assert choose_model(None, live) == "m"
    with pytest.raises(Refused, match="name the model to evaluate"):
        choose_model(None, {**live, "n": {"baseline"}})
    check_variants("m", ["baseline", "fp8"], live)
    with pytest.raises(Refused, match="'int4' is not a variant of 'm' with a live worker"):
        check_variants("m", ["baseline", "int4"], live)
    with pytest.raises(Refused, match="model 'x' has no live worker"):
        check_variants("x", ["baseline", "fp8"], live)


def test_the_command_refuses_a_bad_set_or_list_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = write_set(tmp_path, "{nope")
    assert main(["eval", "--set", str(bad), "--variants", "baseline,fp8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tokenbus eval: ")
    assert "set.jsonl:1: not JSON" in err
    assert len(err.splitlines()) == 1
    good = write_set(tmp_path, {"id": "a", "prompt": "p"})
    assert main(["eval", "--set", str(good), "--variants", "fp8"]) == 2
    assert "name two or more" in capsys.readouterr().err
    args = ["eval", "--set", str(good), "--variants", "a,b", "--concurrency", "0"]
    assert main(args) == 2
    assert "--concurrency: at least 1" in capsys.readouterr().err
    half = ["eval", "--set", str(good), "--variants", "a,b", "--embedding-url", "http://e/v1"]
    assert main(half) == 2
    assert "--embedding-url and --embedding-model go together" in capsys.readouterr().err
    assert main([*half[:-1], "e:1", "--embedding-model", "x"]) == 2
    assert "--embedding-url: an http(s) URL" in capsys.readouterr().err
