"""`tokenbus up` with no keys configured: a development key, printed with the chat link."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
from pathlib import Path

import websockets

from services.edge import keys as keyfile
from shared.kafka import delete_topics
from shared.topics import Topics
from tests.chat_client import recv_json, run_requests, upgrade_status
from tests.processes import descendants, running
from tests.stack import free_port, new_prefix, wait_until
from tests.test_up import TOKENBUS, settings


def test_up_makes_prints_and_reuses_a_development_key(tmp_path: Path, bootstrap: str) -> None:
    prefix, port = new_prefix(), free_port()
    env = dict(os.environ, KAFKA_BOOTSTRAP_SERVERS=bootstrap, TOKENBUS_TOPIC_PREFIX=prefix)
    env.pop("TOKENBUS_EDGE_KEYS_FILE", None)
    try:
        key = run_up_once(tmp_path, env, port)
        # The key is kept in the local state directory, as a hash in the keys file.
        assert (tmp_path / ".tokenbus" / "dev-key").read_text().strip() == key
        stored = keyfile.load(tmp_path / ".tokenbus" / "keys.json")
        assert [e.tenant for e in stored.keys] == ["dev"]
        assert key not in (tmp_path / ".tokenbus" / "keys.json").read_text()
        # The next `up` prints the same key.
        assert run_up_once(tmp_path, env, port) == key
    finally:
        asyncio.run(delete_topics(settings(bootstrap, prefix), Topics(prefix).partitions()))


def run_up_once(cwd: Path, env: dict[str, str], port: int) -> str:
    log = cwd / "up.log"
    with open(log, "wb") as out:
        up = subprocess.Popen(
            [str(TOKENBUS), "up", "--port", str(port)],
            cwd=cwd,  # its .tokenbus/ state goes here
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    tree: set[int] = set()
    try:
        banner = re.compile(r"^  API key +(tb-\S+)$", re.MULTILINE)
        wait_until(lambda: up.poll() is not None or banner.search(log.read_text()), 180, "ready")
        text = log.read_text()
        match = banner.search(text)
        assert match, text
        key = match.group(1)
        assert f"http://127.0.0.1:{port}/#key={key}" in text
        tree = descendants(up.pid)
        asyncio.run(check_the_key(port, key))
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=90) == 0, log.read_text()
        log.unlink()
        return key
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        for pid in tree:
            if running(pid):
                os.kill(pid, signal.SIGKILL)


async def check_the_key(port: int, key: str) -> None:
    url = f"ws://127.0.0.1:{port}/v1/chat"
    async with websockets.connect(url, additional_headers={"Authorization": f"Bearer {key}"}) as ws:
        done = await run_requests(ws, [{"client_id": "a", "prompt": "hi", "max_tokens": 3}])
    assert done["a"].final is not None
    assert done["a"].final["type"] == "chat.done"
    assert await upgrade_status(url, additional_headers={"Authorization": "Bearer tb-x"}) == 403
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "chat.request", "prompt": "hi"}))
        assert (await recv_json(ws))["code"] == "unauthorized"
