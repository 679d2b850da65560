"""Cross-site WebSocket hijacking: a page of another origin cannot open a socket on the edge."""

from __future__ import annotations

import json

import websockets

from tests.chat_client import recv_json, run_requests, upgrade_status
from tests.stack import Stack


async def test_a_foreign_origin_is_refused_with_403_even_with_a_valid_key(stack: Stack) -> None:
    header = {"Authorization": f"Bearer {stack.keys['alice']}"}
    for origin in (
        "https://evil.example",
        f"http://rebind.evil.example:{stack.edge_port}",  # DNS rebinding to 127.0.0.1
        f"http://127.0.0.1:{stack.edge_port + 1}",  # another local server's page
        "null",
    ):
        status = await upgrade_status(
            stack.ws_url_as(None), origin=origin, additional_headers=header
        )
        assert status == 403, origin


async def test_the_edges_own_page_origin_is_allowed(stack: Stack) -> None:
    for host in ("127.0.0.1", "localhost"):
        origin = f"http://{host}:{stack.edge_port}"
        async with websockets.connect(stack.ws_url_as(None), origin=origin) as ws:
            # A browser cannot set headers: the page authenticates with a frame.
            await ws.send(json.dumps({"type": "auth", "api_key": stack.keys["alice"]}))
            done = await run_requests(ws, [{"client_id": "a", "prompt": "hi", "max_tokens": 3}])
            assert done["a"].final is not None
            assert done["a"].final["type"] == "chat.done"


async def test_a_browser_cannot_authenticate_with_ambient_basic_credentials(stack: Stack) -> None:
    """Credentials a browser cached for the edge (Basic) are not a key: only Bearer or a frame."""
    origin = f"http://127.0.0.1:{stack.edge_port}"
    assert await upgrade_status(stack.ws_url_as("alice"), origin=origin) == 403
    async with websockets.connect(stack.ws_url_as(None), origin=origin) as ws:
        await ws.send(json.dumps({"type": "chat.request", "prompt": "hi", "max_tokens": 3}))
        frame = await recv_json(ws)
        assert frame["code"] == "unauthorized"
