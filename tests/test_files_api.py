"""The Files API through the official `openai` SDK, as its docs show it (issue 39 item 1,
ADR 0074), on the session's shared stack: a file uploaded through one edge is listed, read
byte for byte and deleted through the other (the content in chunks on the bus, no edge
holding it); a bad line is refused with its number and nothing of the file is kept; another
tenant gets 404 on everything; another purpose and an oversize file are refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest

from shared.files import CHUNK_BYTES
from tests.chat_client import openai_sdk
from tests.stack import Stack

OWNER, OTHER = "files-owner", "files-other"  # tests/tenants.py
FILES_EDGE = "edge-files"
MAX_BYTES = 4 * CHUNK_BYTES  # the module's edge's upload limit


@dataclass
class Edges:
    stack: Stack
    port: int  # the module's edge, with the small upload limit

    def sdk(self, tenant: str = OWNER, own: bool = False) -> openai.OpenAI:
        return openai_sdk(self.stack, tenant, port=self.port if own else None)


@pytest.fixture(scope="module")
def edges(stack: Stack) -> Iterator[Edges]:
    with stack.own_edge(FILES_EDGE, TOKENBUS_EDGE_FILE_MAX_BYTES=str(MAX_BYTES)) as port:
        yield Edges(stack, port)


def batch_file(
    lines: int, pad: int = 0, url: str = "/v1/chat/completions", model: str = "sim-8b"
) -> bytes:
    rows = []
    for i in range(lines):
        body: dict[str, object] = {"model": model, "max_tokens": 8}
        if url == "/v1/completions":
            body["prompt"] = f"Line {i}. " + "x" * pad
        else:
            body["messages"] = [{"role": "user", "content": f"Line {i}. " + "x" * pad}]
        rows.append({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body})
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def ids(client: openai.OpenAI) -> list[str]:
    return [f.id for f in client.files.list()]


def test_a_file_uploaded_through_one_edge_is_read_whole_and_deleted_through_another(
    edges: Edges,
) -> None:
    content = batch_file(2000, pad=600)  # 1.3 MB: three chunks
    assert 2 * CHUNK_BYTES < len(content) < MAX_BYTES
    uploaded = edges.sdk(own=True).files.create(file=("questions.jsonl", content), purpose="batch")
    assert uploaded.object == "file"
    assert uploaded.purpose == "batch"
    assert uploaded.bytes == len(content)
    assert uploaded.filename == "questions.jsonl"
    assert uploaded.status == "processed"

    other_edge = edges.sdk()  # never saw the upload: it reads the bus
    assert other_edge.files.retrieve(uploaded.id) == uploaded
    assert uploaded.id in ids(other_edge)
    assert other_edge.files.content(uploaded.id).read() == content

    deleted = other_edge.files.delete(uploaded.id)
    assert (deleted.id, deleted.deleted) == (uploaded.id, True)
    for client in (other_edge, edges.sdk(own=True)):
        assert uploaded.id not in ids(client)
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(uploaded.id)
        with pytest.raises(openai.NotFoundError):
            client.files.content(uploaded.id)


def test_both_endpoints_and_listing_newest_first(edges: Edges) -> None:
    client = edges.sdk()
    chat = client.files.create(file=("chat.jsonl", batch_file(3)), purpose="batch")
    text = client.files.create(
        file=("text.jsonl", batch_file(3, url="/v1/completions")), purpose="batch"
    )
    listed = ids(client)
    assert listed.index(text.id) <= listed.index(chat.id)  # newest first
    page = client.files.list(limit=1)
    assert len(page.data) == 1
    assert page.has_more
    for f in (chat, text):
        client.files.delete(f.id)


def test_another_tenant_gets_404_on_the_file_and_its_content(edges: Edges) -> None:
    mine = edges.sdk().files.create(file=("mine.jsonl", batch_file(2)), purpose="batch")
    theirs = edges.sdk(OTHER)
    assert mine.id not in ids(theirs)
    with pytest.raises(openai.NotFoundError):
        theirs.files.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        theirs.files.content(mine.id)
    with pytest.raises(openai.NotFoundError):
        theirs.files.delete(mine.id)
    assert edges.sdk().files.retrieve(mine.id).id == mine.id  # untouched
    edges.sdk().files.delete(mine.id)


def test_a_bad_line_is_refused_with_its_number_and_nothing_is_kept(edges: Edges) -> None:
    client = edges.sdk()
    before = ids(client)
    good = batch_file(4).decode().splitlines()
    bad = json.loads(good[2])
    bad["body"]["temperature"] = 7  # past the endpoint's bound
    good[2] = json.dumps(bad)
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=("bad.jsonl", "\n".join(good).encode()), purpose="batch")
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["message"].startswith("line 3: "), error
    assert "temperature" in error["message"], error
    assert ids(client) == before


def test_another_purpose_an_oversize_file_and_no_key_are_refused(edges: Edges) -> None:
    client = edges.sdk(own=True)
    before = ids(client)
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("a.jsonl", batch_file(1)), purpose="fine-tune")
    with pytest.raises(openai.APIStatusError) as too_big:
        client.files.create(file=("big.jsonl", batch_file(4000, pad=600)), purpose="batch")
    assert too_big.value.status_code == 413
    nobody = openai.OpenAI(
        base_url=f"http://127.0.0.1:{edges.port}/v1", api_key="not-a-key", max_retries=0
    )
    with pytest.raises(openai.AuthenticationError):
        nobody.files.list()
    assert ids(client) == before
