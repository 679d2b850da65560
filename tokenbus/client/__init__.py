"""`tokenbus.client`: an async Python SDK for the edge's WebSocket protocol (`/v1/chat`).

    client = Client(["ws://edge-a:8000/v1/chat", "ws://edge-b:8000/v1/chat"], api_key=KEY)
    async for delta in client.chat([{"role": "user", "content": "Why a bus?"}]):
        print(delta.text, end="", flush=True)

A dropped socket is resumed on the next edge in the list (`stream.resume`) and the answer
is shown once: no delta twice, none missing. A re-run of the request (its worker died)
comes as a `Delta` with `reset=True`: drop what was shown, the new attempt's text follows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from tokenbus.client.framing import Delta, StreamBroken
from tokenbus.client.stream import ChatError, ChatStream, ConnectionLost

Message = Mapping[str, str]


class Client:
    """Edges to talk to and the API key to present (`Authorization: Bearer`).

    `urls`: one edge's `ws://host:port/v1/chat`, or several; a stream starts on the first
    and moves to the others in turn when its socket drops. `reconnect_timeout_s`: how long
    a dropped stream tries the edges before `ConnectionLost` (the edge keeps a dropped
    stream for its disconnect grace, 30 s by default, so more than that is no use).
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        api_key: str | None = None,
        *,
        reconnect_timeout_s: float = 30.0,
        open_timeout_s: float = 10.0,
    ) -> None:
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        if not self.urls:
            raise ValueError("at least one edge URL is needed")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.reconnect_timeout_s = reconnect_timeout_s
        self.open_timeout_s = open_timeout_s

    def chat(
        self,
        messages: Sequence[Message] | str,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        stop: Sequence[str] | None = None,
        priority: Literal["interactive", "background"] | None = None,
        deadline_ms: int | None = None,
        model: str | None = None,
        fallback_model: str | None = None,
        conversation_id: str | None = None,
    ) -> ChatStream:
        """One request: a conversation (`[{"role": ..., "content": ...}, ...]`) or a prompt.

        Returns the stream to iterate; nothing is sent until iteration starts.
        """
        body: dict[str, Any] = (
            {"prompt": messages}
            if isinstance(messages, str)
            else {"messages": [dict(m) for m in messages]}
        )
        options = {
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "stop": list(stop) if stop is not None else None,
            "priority": priority,
            "deadline_ms": deadline_ms,
            "model": model,
            "fallback_model": fallback_model,
            "conversation_id": conversation_id,
        }
        body.update({k: v for k, v in options.items() if v is not None})
        return ChatStream(
            self.urls,
            self._headers,
            body,
            reconnect_timeout_s=self.reconnect_timeout_s,
            open_timeout_s=self.open_timeout_s,
        )

    async def complete(self, messages: Sequence[Message] | str, **options: Any) -> str:
        """The whole answer as one string (a re-run's text replaces the earlier attempt's)."""
        stream = self.chat(messages, **options)
        async for _ in stream:
            pass
        return stream.text


__all__ = ["ChatError", "ChatStream", "Client", "ConnectionLost", "Delta", "StreamBroken"]
