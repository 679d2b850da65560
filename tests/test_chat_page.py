"""The chat page in headless Chromium: a person types, the answer streams in; a conversation
of several turns, a stop button, Markdown made safe, and an edge restarted mid-answer.

On the session's shared stack: what a person types carries the sim's pace marker (15 tokens
a second), and the edge restarted mid-answer is one of the module's own."""

from __future__ import annotations

import shutil
import signal
import tempfile
from collections.abc import Iterator

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement

from services.worker.engines.sim_profiles import SimProfile
from services.worker.engines.sim_text import complete
from shared.messages import ChatMessage, ChatRequest
from shared.tokens import sim_tokens
from tests.stack import Stack, wait_until
from tests.tenants import paced

# Slow enough that "mid-answer" lasts seconds: an answer of 80 tokens takes about 5 s (each
# typed prompt asks the sim for it: `paced`).
TOKEN_RATE = 15
# The page's max-tokens field, untouched: the sim's answer runs to its end, or to that bound
# (or its context's end, which is further here).
CONTEXT = SimProfile().context_length
PAGE_MAX_TOKENS = 512
PAGE_EDGE = "edge-chat-page"


@pytest.fixture(scope="module")
def page_edge(stack: Stack) -> Iterator[int]:
    """An edge of the module's own on the shared stack (its port): the one it restarts."""
    with stack.own_edge(PAGE_EDGE) as port:
        yield port


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


def expected(turns: list[tuple[str, str]]) -> str:
    """The sim's answer to a conversation: it depends on every turn's role and text."""
    messages = [ChatMessage(role=role, content=text) for role, text in turns]  # type: ignore[arg-type]
    prompt = ChatRequest(messages=messages).prompt_text()
    return complete(prompt, budget(prompt)).text


def budget(prompt: str) -> int:
    return min(PAGE_MAX_TOKENS, CONTEXT - sim_tokens(prompt))


def tokens(turns: list[tuple[str, str]]) -> int:
    messages = [ChatMessage(role=role, content=text) for role, text in turns]  # type: ignore[arg-type]
    prompt = ChatRequest(messages=messages).prompt_text()
    return complete(prompt, budget(prompt)).completion_tokens


def open_page(browser: webdriver.Chrome, stack: Stack, port: int | None = None) -> None:
    """The page of the stack's edge (or of its edge on `port`), connected."""
    # As `tokenbus up` prints it: the key in the fragment, which the page sends in `auth`.
    url = stack.http_url_at(port) if port is not None else stack.http_url
    browser.get(f"{url}/#key={stack.keys['default']}")
    status = browser.find_element(By.ID, "status")
    wait_until(lambda: status.text.startswith("connected"), 20, "the page's WebSocket")
    assert "key=" not in browser.current_url, "the key stays out of the address bar"


def ask(browser: webdriver.Chrome, prompt: str) -> None:
    browser.find_element(By.ID, "prompt").send_keys(prompt)
    browser.find_element(By.ID, "send").click()


def answers(browser: webdriver.Chrome) -> list[WebElement]:
    return browser.find_elements(By.CSS_SELECTOR, "#log .assistant")


def shown(el: WebElement) -> str:
    """The answer's text as the page renders it (one Markdown paragraph for the sim)."""
    return str(el.get_property("textContent")).strip()


def timings(browser: webdriver.Chrome) -> list[WebElement]:
    return browser.find_elements(By.CSS_SELECTOR, "#log .timings")


def test_a_typed_message_streams_its_answer_into_the_page(
    stack: Stack, browser: webdriver.Chrome
) -> None:
    open_page(browser, stack)
    prompt = paced("hello from a real browser", TOKEN_RATE)
    ask(browser, prompt)
    text = expected([("user", prompt)])
    wait_until(lambda: answers(browser) and shown(answers(browser)[0]) == text, 30, "the answer")
    wait_until(lambda: bool(timings(browser)), 10, "the timings line")
    line = timings(browser)[0].text
    assert "tokens" in line
    assert "TTFT" in line
    assert "tokens/s" in line
    assert answers(browser)[0].get_property("innerHTML").startswith("<p>"), "rendered Markdown"
    assert not browser.find_elements(By.CSS_SELECTOR, "#log .error")
    assert browser.find_element(By.CSS_SELECTOR, "#log .user").text == prompt


def test_the_page_shows_its_bound_and_the_answer_stops_there(
    stack: Stack, browser: webdriver.Chrome
) -> None:
    """Issue 44: the page shows the max-tokens bound it sends (512 untouched) and leaves the
    temperature to the model (blank, its placeholder says so); a lower bound cuts the answer
    there, and the page says so."""
    open_page(browser, stack)
    bound = browser.find_element(By.ID, "max-tokens")
    assert bound.get_property("value") == str(PAGE_MAX_TOKENS)
    temperature = browser.find_element(By.ID, "temperature")
    assert temperature.get_property("value") == ""
    assert temperature.get_attribute("placeholder") == "model's"
    prompt = paced("tell me about buses", TOKEN_RATE)
    assert tokens([("user", prompt)]) > 5, "the sim's answer must be longer than the bound"
    bound.clear()
    bound.send_keys("5")
    ask(browser, prompt)
    wait_until(lambda: bool(timings(browser)), 30, "the answer's end")
    line = timings(browser)[0]
    assert line.text.startswith("5 tokens"), line.text
    assert "cut at max tokens" in line.text
    assert line.get_attribute("data-finish-reason") == "length"


def test_the_second_answer_is_conditioned_on_the_first_turn(
    stack: Stack, browser: webdriver.Chrome
) -> None:
    open_page(browser, stack)
    first, second = paced("what is a bus", TOKEN_RATE), paced("go on", TOKEN_RATE)
    ask(browser, first)
    a1 = expected([("user", first)])
    wait_until(lambda: len(timings(browser)) == 1, 40, "the first answer's end")
    assert shown(answers(browser)[0]) == a1
    ask(browser, second)
    # The sim's text is a function of the whole prompt: the second answer is this one only
    # if the request carried the first question, its answer and the second question.
    a2 = expected([("user", first), ("assistant", a1), ("user", second)])
    assert a2 != expected([("user", second)])
    wait_until(lambda: len(timings(browser)) == 2, 40, "the second answer's end")
    assert shown(answers(browser)[1]) == a2
    assert not browser.find_elements(By.CSS_SELECTOR, "#log .error")


def test_stop_cancels_the_answer_mid_way(stack: Stack, browser: webdriver.Chrome) -> None:
    open_page(browser, stack)
    prompt = paced("a long answer please", TOKEN_RATE)
    full = expected([("user", prompt)])
    assert tokens([("user", prompt)]) > 60, "the answer must outlast the stop"
    ask(browser, prompt)
    wait_until(lambda: len(shown(answers(browser)[0]).split()) >= 3, 30, "the answer's start")
    browser.find_element(By.ID, "stop").click()
    wait_until(
        lambda: browser.find_elements(By.CSS_SELECTOR, "#log .stopped"), 20, "the edge's cancel"
    )
    text = shown(answers(browser)[0])
    assert full.startswith(text)
    assert len(text) < len(full), "stopped before the end"
    assert not timings(browser), "a stopped answer has no chat.done"
    assert not browser.find_elements(By.CSS_SELECTOR, "#log .error")
    assert browser.find_element(By.ID, "send").is_enabled()


def test_the_edge_restarted_mid_answer_the_page_shows_the_whole_text_once(
    stack: Stack, page_edge: int, browser: webdriver.Chrome
) -> None:
    open_page(browser, stack, page_edge)
    prompt = paced("describe the scheduler", TOKEN_RATE)
    full = expected([("user", prompt)])
    assert tokens([("user", prompt)]) > 100, "the answer must outlast the kill"
    ask(browser, prompt)
    wait_until(lambda: len(shown(answers(browser)[0]).split()) >= 5, 30, "the answer's start")
    stack.stop_service(PAGE_EDGE, signal.SIGKILL)
    at_kill = shown(answers(browser)[0])
    assert full.startswith(at_kill)
    assert at_kill != full, "killed mid-answer"
    assert not timings(browser)
    # The same port: the page reconnects to where it came from.
    stack.start_service("edge", key=PAGE_EDGE, TOKENBUS_EDGE_PORT=str(page_edge))
    wait_until(lambda: stack.edge_ready(page_edge), 60, "the edge back")
    wait_until(lambda: bool(timings(browser)), 60, "the answer's end after the restart")
    assert len(answers(browser)) == 1
    assert shown(answers(browser)[0]) == full, "the whole text, once"
    assert len(timings(browser)) == 1
    assert browser.find_element(By.ID, "status").text.startswith("connected")
    assert not browser.find_elements(By.CSS_SELECTOR, "#log .error")


def test_markdown_and_code_are_rendered_and_script_is_removed(
    stack: Stack, browser: webdriver.Chrome
) -> None:
    open_page(browser, stack)
    answer = (
        "# Title\n\nSome **bold** text.\n\n```python\nprint('hi')\n```\n\n"
        '<img src="x" onerror="window.pwned = 1"><script>window.pwned = 2</script>'
        "[link](javascript:window.pwned=3)"
    )
    html = browser.execute_script(
        "const el = document.createElement('div');"
        "el.innerHTML = renderMarkdown(arguments[0]);"
        "document.getElementById('log').appendChild(el);"
        "return el.innerHTML;",
        answer,
    )
    assert "<h1>Title</h1>" in html
    assert "<strong>bold</strong>" in html
    assert '<pre><code class="language-python">' in html
    assert "onerror" not in html
    assert "<script" not in html
    assert "javascript:" not in html
    assert "<img" not in html, "no image in an answer (a beacon; tests/security/)"
    link = browser.find_element(By.CSS_SELECTOR, "#log a")
    assert link.get_attribute("href") is None, "a javascript: link keeps no href"
    link.click()
    assert browser.execute_script("return window.pwned === undefined")
