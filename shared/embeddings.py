"""How close two answers are in meaning: the cosine of their embeddings (issue 28, ADR 0063).

Where an embedding model is configured, shadow validation (services/worker/shadow.py) and
`tokenbus eval` add this to their agreement scores (shared/agreement.py). The model is
served by anything that speaks OpenAI's embeddings API (`POST {url}/embeddings`): vLLM's
own server (`vllm serve MODEL --runner pooling`), Text Embeddings Inference, or a hosted
API. Both texts go in one request, so they are embedded by the same model at once. Each
call opens its own connection (httpx), so nothing is left to close: a score is a sample,
far rarer than requests, and an embedding costs far more than a connection.

A text with no words is not sent (servers refuse empty input): two such texts agree
(1.0), one against one with words scores 0.0, as shared/agreement.py scores them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from urllib.parse import urlsplit

import httpx
from pydantic import SecretStr

TIMEOUT_S = 10.0
_WORD = re.compile(r"\w")


class EmbeddingError(Exception):
    """The embedding endpoint failed or answered something unusable (the message says which)."""


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine similarity of two vectors, -1 to 1 (0 where either has no length)."""
    if len(a) != len(b):
        raise EmbeddingError(f"embeddings of different lengths: {len(a)} and {len(b)}")
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norms = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    if norms == 0.0:
        return 0.0
    return max(-1.0, min(1.0, dot / norms))


def redacted(url: str) -> str:
    """`url` as a log may show it: scheme, host, port and path; no user, password or query
    (where a key may have been put)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


def key_in_clear(url: str) -> bool:
    """Whether a key sent to `url` would cross a network in clear: http to a host that is
    not this machine's loopback."""
    parts = urlsplit(url)
    return parts.scheme == "http" and (parts.hostname or "") not in LOOPBACK


LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})


def credentials_in(url: str) -> bool:
    """Whether `url` carries a user, a password or a query (where keys get put)."""
    parts = urlsplit(url)
    return bool(parts.username or parts.password or parts.query)


class EmbeddingSimilarity:
    """Caller: a gold worker's shadow validation. Each call is one request to the endpoint."""

    def __init__(
        self,
        url: str,
        model: str,
        api_key: SecretStr | None = None,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        self.model = model
        self._endpoint = url.rstrip("/") + "/embeddings"
        self._named = redacted(self._endpoint)  # what errors (and so logs) say
        self._api_key = api_key
        self._timeout_s = timeout_s

    async def __call__(self, reference: str, candidate: str) -> float:
        """The cosine of the two texts' embeddings; raises `EmbeddingError`."""
        worded = [bool(_WORD.search(t)) for t in (reference, candidate)]
        if not all(worded):
            return 1.0 if worded[0] == worded[1] else 0.0
        first, second = await self._embed([reference, candidate])
        return cosine(first, second)

    async def _embed(self, texts: list[str]) -> list[list[float]]:
        key = self._api_key
        headers = {} if key is None else {"Authorization": f"Bearer {key.get_secret_value()}"}
        try:
            async with httpx.AsyncClient(headers=headers, timeout=self._timeout_s) as client:
                response = await client.post(
                    self._endpoint, json={"model": self.model, "input": texts}
                )
        except httpx.HTTPError as exc:
            raise EmbeddingError(f"{self._named}: {type(exc).__name__}") from exc
        if response.status_code != 200:
            raise EmbeddingError(
                f"{self._named} answered {response.status_code}: {response.text[:300]}"
            )
        try:
            data = sorted(response.json()["data"], key=lambda d: d["index"])
            vectors = [[float(x) for x in d["embedding"]] for d in data]
        except (ValueError, KeyError, TypeError) as exc:
            raise EmbeddingError(f"{self._named}: not an embeddings answer: {exc!r}") from exc
        if len(vectors) != len(texts):
            raise EmbeddingError(f"{self._named}: {len(vectors)} embeddings for {len(texts)}")
        return vectors
