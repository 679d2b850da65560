"""A link carrying another API key does not silently replace the one a chat page tab holds
(headless Chromium; issue 37, Low): the user is asked, and a refusal keeps the tab's key."""

from __future__ import annotations

import pytest
from selenium import webdriver
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import WebDriverWait

from tests.stack import Stack
from tests.test_chat_page import browser, open_page  # noqa: F401


def held_key(page: webdriver.Chrome) -> str | None:
    key: str | None = page.execute_script("return sessionStorage.getItem('tokenbus-key');")
    return key


@pytest.mark.parametrize("answer", ["dismiss", "accept"])
def test_a_link_with_another_key_asks_before_it_replaces_the_tabs_key(
    stack: Stack,
    browser: webdriver.Chrome,  # noqa: F811 (the fixture of tests/test_chat_page.py)
    answer: str,
) -> None:
    open_page(browser, stack)  # the tab holds `default`'s key
    assert held_key(browser) == stack.keys["default"]
    # Someone's link, opened in the same tab (a query makes it load the page anew).
    browser.get(f"{stack.http_url}/?from=link#key={stack.keys['bob']}")
    alert = WebDriverWait(browser, 10).until(expected_conditions.alert_is_present())
    assert "another API key" in alert.text
    getattr(alert, answer)()
    expected = stack.keys["bob"] if answer == "accept" else stack.keys["default"]
    assert held_key(browser) == expected
    assert "key=" not in browser.current_url, "the key stays out of the address bar"


def test_a_link_with_the_same_key_asks_nothing(
    stack: Stack,
    browser: webdriver.Chrome,  # noqa: F811
) -> None:
    open_page(browser, stack)
    browser.get(f"{stack.http_url}/?again=1#key={stack.keys['default']}")
    assert not expected_conditions.alert_is_present()(browser)
    assert held_key(browser) == stack.keys["default"]
