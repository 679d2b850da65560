"""`make run ENGINE=vllm` as a newcomer runs it: `tokenbus up --engine vllm` serves the real
model, and the chat page, in headless Chromium, shows its answer.

`up` runs from the services' environment (`.venv/bin/tokenbus`, which `make` builds), as
`make run` does, on the session's broker with a topic prefix of its own; it starts the
worker in the vLLM environment itself.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By

from deploy import test_ledger
from tests.processes import descendants, running
from tests.stack import free_port, new_prefix, wait_until
from tests.test_chat_page import answers, browser, shown  # noqa: F401 (a fixture)
from tokenbus.local_engine import MODEL_NAME, LocalEngine

ROOT = Path(__file__).resolve().parents[2]
TOKENBUS = ROOT / ".venv" / "bin" / "tokenbus"

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def up_vllm(bootstrap: str, tmp_path: Path, local_engine: LocalEngine) -> Iterator[tuple[int, str]]:
    assert TOKENBUS.exists(), f"{TOKENBUS} is missing: `make venv` builds it"
    port = free_port()
    env = {
        **os.environ,
        "KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "TOKENBUS_TOPIC_PREFIX": new_prefix(),
        "TOKENBUS_EDGE_KEYS_FILE": str(tmp_path / "keys.json"),
    }
    log = tmp_path / "up.log"
    test_ledger.note(test_ledger.VLLM_LOAD, where="tokenbus up --engine vllm")
    with open(log, "wb") as out:
        up = subprocess.Popen(
            [str(TOKENBUS), "up", "--engine", "vllm", "--port", str(port)],
            cwd=tmp_path,  # its .tokenbus/ (the development key) goes there
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_until(
            lambda: up.poll() is not None or "ready in" in log.read_text(),
            480,
            "tokenbus up --engine vllm ready",
            interval=0.5,
        )
        text = log.read_text()
        assert up.poll() is None, f"tokenbus up exited with {up.returncode}:\n{text}"
        assert f"model      {MODEL_NAME} on vllm" in text, text
        assert "loading smollm2 on vllm" in text, text  # progress while the model loads
        key = re.search(r"^  API key +(\S+)$", text, re.M)
        assert key is not None, text
        yield port, key.group(1)
    finally:
        left = descendants(up.pid)
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
            try:
                up.wait(timeout=60)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait()
        for pid in left:
            if running(pid):
                os.kill(pid, signal.SIGKILL)


# Issue 44: a newcomer who types this and touches nothing else must get the right answer.
FRANCE = "What is the capital of France?"
CONVERSATIONS = 10


def test_the_chat_page_with_its_defaults_answers_with_the_real_model(
    up_vllm: tuple[int, str],
    browser: webdriver.Chrome,  # noqa: F811
) -> None:
    """The page's fields untouched (no temperature: the model's own sampling defaults; its
    max-tokens bound), ten fresh conversations: "Paris" in at least nine, and every answer
    ends on its own (finish_reason stop) within the page's bound."""
    port, key = up_vllm
    ended: list[tuple[str, str, int]] = []  # (text, finish_reason, tokens)
    for _ in range(CONVERSATIONS):
        # A fresh page, a new conversation: the same URL again would only move to its
        # fragment (the page stays, its conversation too), so leave it first.
        browser.get("about:blank")
        browser.get(f"http://127.0.0.1:{port}/#key={key}")
        wait_until(
            lambda: browser.find_element(By.ID, "status").text.startswith("connected"),
            20,
            "the page's WebSocket",
        )
        assert browser.find_element(By.ID, "temperature").get_property("value") == ""
        bound = int(str(browser.find_element(By.ID, "max-tokens").get_property("value")))
        browser.find_element(By.ID, "prompt").send_keys(FRANCE)
        browser.find_element(By.ID, "send").click()
        wait_until(
            lambda: bool(browser.find_elements(By.CSS_SELECTOR, "#log .timings")),
            120,
            "the answer to end",
        )
        assert not browser.find_elements(By.CSS_SELECTOR, "#log .error")
        assert len(answers(browser)) == 1, "a fresh conversation holds one answer"
        line = browser.find_element(By.CSS_SELECTOR, "#log .timings")
        tokens = int(line.text.split(" tokens", 1)[0])
        ended.append(
            (shown(answers(browser)[0]), str(line.get_attribute("data-finish-reason")), tokens)
        )
        assert tokens <= bound, ended[-1]
    assert all(reason == "stop" for _, reason, _ in ended), ended
    texts = [text for text, _, _ in ended]
    assert sum("Paris" in text for text in texts) >= CONVERSATIONS - 1, texts
