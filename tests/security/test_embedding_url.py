"""Issue 37 (Low): the embeddings API's key, and the URL it goes to.

Before: TOKENBUS_WORKER_EMBEDDING_URL took plain `http` to any host with a key, which then
crossed the network in clear; and a failed call was logged with the endpoint as written, so
a key put in the URL (a user, a password, a query) reached the worker's log.
"""

from __future__ import annotations

import asyncio

import pytest
from pydantic import SecretStr, ValidationError

from services.worker.settings import WorkerSettings
from shared.embeddings import EmbeddingError, EmbeddingSimilarity

SECRET = "sk-embed-0123456789abcdef"


def settings(url: str, key: str | None = SECRET) -> WorkerSettings:
    return WorkerSettings(
        worker_embedding_url=url,
        worker_embedding_model="e5",
        worker_embedding_api_key=None if key is None else SecretStr(key),
    )


@pytest.mark.parametrize("url", ["http://embeddings.internal:8001/v1", "http://10.0.0.7/v1"])
def test_a_key_is_not_sent_in_clear_to_another_host(url: str) -> None:
    with pytest.raises(ValidationError, match="in clear"):
        settings(url)


@pytest.mark.parametrize(
    "url", [f"https://user:{SECRET}@embeddings.example/v1", f"https://e.example/v1?key={SECRET}"]
)
def test_no_credentials_in_the_url(url: str) -> None:
    with pytest.raises(ValidationError, match="no user, password or query") as caught:
        settings(url, key=None)
    assert SECRET not in caught.value.errors()[0]["msg"]


@pytest.mark.parametrize(
    ("url", "key"),
    [
        ("https://embeddings.example/v1", SECRET),
        ("http://127.0.0.1:8001/v1", SECRET),  # this machine: nothing crosses a network
        ("http://localhost:8001/v1", SECRET),
        ("http://embeddings.internal:8001/v1", None),  # no key to leak
    ],
)
def test_what_stays_allowed(url: str, key: str | None) -> None:
    assert settings(url, key).worker_embedding_url == url


def test_a_failed_call_names_the_endpoint_without_its_credentials() -> None:
    url = f"http://user:{SECRET}@127.0.0.1:1/v1?key={SECRET}"  # nothing listens on port 1
    similarity = EmbeddingSimilarity(url, "e5", timeout_s=2)
    with pytest.raises(EmbeddingError) as caught:
        asyncio.run(similarity("a text", "another text"))
    said = str(caught.value)
    assert said.startswith("http://127.0.0.1:1/v1"), said
    assert SECRET not in said
    assert "user" not in said
