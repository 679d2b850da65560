"""The services' event loop (`shared/process.py`): uvloop, with a bounded TLS close (ADR 0040).

The TLS close itself is measured against a secured broker in tests/test_kafka_security.py
(`test_clients_stopped_mid_request_on_tls_stop_at_once`).
"""

from __future__ import annotations

import asyncio

import uvicorn
import uvloop

from shared.process import UVICORN_LOOP, ServiceLoop, new_service_loop


def test_uvicorn_runs_the_edge_on_the_services_loop() -> None:
    factory = uvicorn.Config("services.edge.app:build_app", loop=UVICORN_LOOP).get_loop_factory()
    assert factory is not None
    loop = factory()
    try:
        assert isinstance(loop, ServiceLoop)
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()


def test_a_plaintext_connection_gets_no_tls_setting() -> None:
    """uvloop refuses `ssl_shutdown_timeout` without `ssl`: plaintext connections (every
    client of an unsecured cluster) must still connect."""

    async def connect_once() -> bytes:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(await reader.readexactly(4))
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"ping")
            echoed = await reader.readexactly(4)
            writer.close()
            await writer.wait_closed()
        return echoed

    with asyncio.Runner(loop_factory=new_service_loop) as runner:
        assert runner.run(connect_once()) == b"ping"
