"""No API key, secret or prompt in any service log line (the services log at INFO in tests)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import websockets

from tests.chat_client import recv_json, run_requests
from tests.stack import Stack


async def test_keys_secrets_and_prompts_never_reach_a_log(stack: Stack, log_dir: Path) -> None:
    prompt = "secret-prompt-" + uuid.uuid4().hex
    wrong = "tb-wrong-" + uuid.uuid4().hex
    alice = stack.keys["alice"]
    # Every way a key arrives, a refused key, and a prompt that is answered and one refused.
    async with websockets.connect(stack.ws_url) as ws:  # Basic, in the URL
        done = await run_requests(ws, [{"client_id": "a", "prompt": prompt, "max_tokens": 5}])
        assert done["a"].final is not None
        assert done["a"].final["type"] == "chat.done"
    headers = {"Authorization": f"Bearer {alice}"}
    async with websockets.connect(stack.ws_url_as(None), additional_headers=headers) as ws:
        done = await run_requests(ws, [{"client_id": "b", "prompt": prompt, "max_tokens": 5}])
        assert done["b"].final is not None
    async with websockets.connect(stack.ws_url_as(None)) as ws:
        await ws.send(json.dumps({"type": "auth", "api_key": wrong}))
        await ws.send(json.dumps({"type": "chat.request", "prompt": prompt}))
        assert (await recv_json(ws))["code"] == "unauthorized"  # the key
        assert (await recv_json(ws))["code"] == "unauthorized"  # the request
        await ws.send(json.dumps({"type": "auth", "api_key": stack.keys["bob"]}))
        done = await run_requests(ws, [{"client_id": "c", "prompt": prompt, "max_tokens": 5}])
        assert done["c"].final is not None

    secrets = {
        **{f"key of {tenant}": key for tenant, key in stack.keys.items()},
        "a refused key": wrong,
        "the prompt": prompt,
        "the resume secret": "test-secret",
    }
    assert find_in_logs(log_dir, secrets, expect=(stack.log("edge"), "auth.refused")) == []


def find_in_logs(log_dir: Path, secrets: dict[str, str], expect: tuple[Path, str]) -> list[str]:
    """`what is in which log` for each secret found in any service log of the session."""
    logs = sorted(log_dir.glob("*.log"))  # this module's stack and any other's so far
    # The edge logged this test's refusal: the files read are the ones being written.
    log, line = expect
    assert log in logs
    assert line in log.read_text()
    found = []
    for log in logs:
        text = log.read_text(errors="replace")
        found += [f"{what} is in {log.name}" for what, secret in secrets.items() if secret in text]
    return found
