"""A batch input file's lines, checked as their endpoints would check them (issue 39): the
first bad line refuses the file, named by its number; vLLM's `run_batch` files pass."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from services.edge.openai.batch_lines import MAX_LINES, Checked, check_lines
from services.edge.openai.errors import HttpError
from shared.messages import RequestLimits

LIMITS = RequestLimits()
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}


def line(custom_id: str = "r1", url: str = "/v1/chat/completions", **over: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": dict(CHAT), **over}


def jsonl(*lines: object) -> io.BytesIO:
    return io.BytesIO(
        b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)
    )


def refusal(*lines: object) -> str:
    refused = check_lines(jsonl(*lines), LIMITS)
    assert isinstance(refused, HttpError), refused
    assert refused.status == 400
    return refused.body.error.message


def test_vllms_run_batch_example_file_passes_unchanged() -> None:
    """vLLM's own example (examples/offline_inference/openai_batch/openai_example_batch.jsonl),
    both endpoints, blank lines skipped as run_batch skips them."""
    vllm_example = (
        b'{"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions", "body": '
        b'{"model": "meta-llama/Meta-Llama-3-8B-Instruct", "messages": [{"role": "system", '
        b'"content": "You are a helpful assistant."},{"role": "user", "content": "Hello world!"}],'
        b'"max_completion_tokens": 1000}}\n\n'
        b'{"custom_id": "request-2", "method": "POST", "url": "/v1/completions", "body": '
        b'{"model": "m", "prompt": "Once upon a time", "max_tokens": 16}}'
    )
    checked = check_lines(io.BytesIO(vllm_example), LIMITS)
    assert isinstance(checked, Checked)
    assert checked.lines == 2
    # Each line's prompt bound + its max tokens, as a request is charged.
    assert checked.tokens > 1000 + 16


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (b"{not json", "line 2: not valid JSON"),
        (line("r2", url="/v1/embeddings"), "line 2: url '/v1/embeddings' is not served here"),
        (line("r1"), "line 2: custom_id 'r1' is used twice"),
        (line("r2", method="GET"), "line 2: "),
        ({"custom_id": "r2", "method": "POST", "url": "/v1/chat/completions"}, "line 2: "),
        (line("r2", body={**CHAT, "stream": True}), "line 2: a batch's requests do not stream"),
        (line("r2", body={**CHAT, "temperature": 9}), "line 2: "),
        (line("r2", body={"model": "m", "messages": []}), "line 2: "),
        (line("r2", extra=1), "line 2: "),
    ],
)
def test_a_bad_line_refuses_the_file_with_its_number(bad: object, says: str) -> None:
    assert refusal(line("r1"), bad, line("r3")).startswith(says)


def test_an_empty_file_and_one_past_openais_line_limit_are_refused() -> None:
    assert "no request" in refusal(b"", b"  ")
    many = jsonl(*(line(f"r{i}") for i in range(MAX_LINES + 1)))
    refused = check_lines(many, LIMITS)
    assert isinstance(refused, HttpError)
    assert refused.body.error.message.startswith(f"line {MAX_LINES + 1}: a batch file holds")
