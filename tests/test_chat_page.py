"""The chat page in headless Chromium: a person types, the answer streams in."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

from services.worker.engines.sim_text import complete
from shared.settings import TokenbusSettings
from tests.stack import Stack


def _require(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is missing: `make test` installs Debian's chromium and chromium-driver"
    return path


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = _require("chromium")
    profile = tempfile.mkdtemp(prefix="tokenbus-chromium-")
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(_require("chromedriver")))
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _poll(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_a_typed_message_streams_its_answer_into_the_page(
    stack: Stack, browser: webdriver.Chrome
) -> None:
    # As `tokenbus up` prints it: the key in the fragment, which the page sends in `auth`.
    browser.get(f"{stack.http_url}/#key={stack.keys['default']}")
    status = browser.find_element(By.ID, "status")
    _poll(lambda: status.text.startswith("connected"), 20, "the page's WebSocket")
    assert "key=" not in browser.current_url, "the key stays out of the address bar"

    prompt = "hello from a real browser"
    browser.find_element(By.ID, "prompt").send_keys(prompt)
    browser.find_element(By.ID, "send").click()

    expected = complete(prompt, TokenbusSettings().default_max_tokens).text
    answers = lambda: browser.find_elements(By.CSS_SELECTOR, "#log .assistant")  # noqa: E731
    _poll(
        lambda: answers() and answers()[0].get_property("textContent") == expected,
        30,
        "the streamed answer",
    )
    _poll(lambda: bool(browser.find_elements(By.CSS_SELECTOR, "#log .meta")), 10, "chat.done")
    meta = browser.find_elements(By.CSS_SELECTOR, "#log .meta")
    assert "tokens" in meta[0].text
    assert not browser.find_elements(By.CSS_SELECTOR, "#log .error")
    assert browser.find_element(By.CSS_SELECTOR, "#log .user").text == prompt
