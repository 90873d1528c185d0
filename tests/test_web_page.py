"""The chat page at `/` in a real headless browser (Debian's Chromium through selenium) against a real
`hkserve serve` of SmolLM2 (tests/serve_held.py, with an API key): the golden reply streamed into the
page, stop mid-stream freeing the slot, conversations kept across a reload, structured output that
validates, model text rendered as text. One server start and one browser for the whole file.

HKSERVE_WEB_SCREENSHOTS=1 also saves docs/web-chat-desktop.png and docs/web-chat-phone.png."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import httpx
import jsonschema
import pytest
from helpers import REPO
from http_helpers import FakeRunner, LiveServer
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait
from test_serve import Lines, free_port, send

from hkserve.api import web
from hkserve.api.app import create_app
from hkserve.api.limits import ServerLimits
from hkserve.checkpoint.store import ModelStore

NAME = "smollm2-135m-instruct"
KEY = "page-test-key"
HANG_S = 120  # bounds on waits for conditions: they only catch a hang, no run is expected near them
SETTINGS = ("system", "temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "stop-strings", "schema")
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
HOSTILE = '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2">'


def start_server(home, *args: str) -> tuple[subprocess.Popen, Lines]:
    """`hkserve serve --model NAME ARGS` through tests/serve_held.py (its gate shut only on request), and
    its output lines, read in the background."""
    env = {**os.environ, "HKSERVE_HOME": str(home), "PYTHONPATH": str(REPO)}
    command = [sys.executable, str(REPO / "tests" / "serve_held.py"), "serve", "--model", NAME, *args]
    pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc = subprocess.Popen(command, env=env, **pipes)
    return proc, Lines(proc.stdout)


@pytest.fixture(scope="module")
def server(smollm2_home):
    port = free_port()
    # --max-len 256 --prefill-rows 1: fewer programs to compile in the warm-up; --compile lazy: no scoring
    # programs compiled after ready (the page scores no prompt), which took the cores from the page's tests
    flags = ("--slots", "2", "--max-len", "256", "--prefill-rows", "1", "--compile", "lazy", "--api-key", KEY)
    proc, output = start_server(smollm2_home, "--port", str(port), *flags)
    try:
        output.wait_for(f"ready: {NAME}", timeout=600)
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}", proc=proc, output=output)
    finally:
        proc.kill()
        proc.wait(30)


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium from Debian's packages (`make browser` installs them); missing is a failure."""
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.fail(
            "Chromium or chromedriver is not installed: run `make browser` (as root: apt-get install chromium"
            " chromium-driver); the chat page's tests need a real browser"
        )
    options = Options()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,860"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(driver))
    yield driver
    driver.quit()


@pytest.fixture
def page(browser, server):
    """The page, loaded, with the key entered and a new conversation open."""
    browser.get(server.url + "/")
    wait(browser, lambda d: d.execute_script("return document.readyState") == "complete")
    key = browser.find_element(By.ID, "api-key")
    if key.get_attribute("value") != KEY:
        key.clear()
        key.send_keys(KEY, Keys.TAB)  # `change` saves it and asks /v1/models again
    wait(browser, lambda d: NAME in d.find_element(By.ID, "model").text)
    browser.find_element(By.ID, "new-chat").click()
    wait(browser, lambda d: not d.find_elements(By.CSS_SELECTOR, ".msg"))
    return browser


def wait(driver, condition, timeout: float = HANG_S):
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(condition)


def settings(driver, **values: str) -> None:
    """Every setting set (those not named emptied), as if typed: an `input` event saves them."""
    for field in SETTINGS:
        value = values.get(field.replace("-", "_"), "")
        driver.execute_script(
            "const e = document.getElementById(arguments[0]); e.value = arguments[1];"
            " e.dispatchEvent(new Event('input'));",
            field,
            value,
        )


def ask(driver, text: str):
    """Types `text` and presses Enter; the reply's element once it has finished (done, stopped or error)."""
    driver.find_element(By.ID, "prompt").send_keys(text, Keys.ENTER)
    wait(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) > 0)
    return driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]


def finished(driver, reply) -> str:
    wait(driver, lambda _: reply.get_attribute("data-state") != "streaming")
    return reply.get_attribute("data-state")


def gauge(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))


def test_a_typed_message_streams_the_golden_reply(page, server, golden):
    case = next(c for c in golden["cases"] if "messages" in c)
    settings(page, temperature="0", max_tokens="32")
    reply = ask(page, case["messages"][0]["content"])
    assert finished(page, reply) == "done"
    assert reply.find_element(By.CSS_SELECTOR, ".content").text == case["text"]
    stats = reply.find_element(By.CSS_SELECTOR, ".stats").text
    assert stats.startswith(f"{len(case['greedy_ids'])} tokens · ") and " tok/s · TTFT " in stats, stats
    assert f"cached 0 of {len(case['prompt_ids'])}" in stats, stats  # the prefix cache had nothing yet
    wait(page, lambda d: d.find_element(By.ID, "metrics").text == "slots 0/2 · queue 0")
    if os.environ.get("HKSERVE_WEB_SCREENSHOTS"):
        save_screenshots(page)


def save_screenshots(driver) -> None:
    """The page as it is now, at desktop width and at a phone's (390 x 844 CSS pixels)."""
    driver.find_element(By.ID, "toggle-settings").click()
    driver.save_screenshot(str(REPO / "docs" / "web-chat-desktop.png"))
    driver.find_element(By.ID, "toggle-settings").click()
    phone = {"width": 390, "height": 844, "deviceScaleFactor": 2, "mobile": True}
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", phone)
    try:
        driver.save_screenshot(str(REPO / "docs" / "web-chat-phone.png"))
    finally:
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


@pytest.mark.parametrize("how", ["button", "escape"])
def test_stop_mid_stream_cancels_the_request_and_frees_the_slot(page, server, how):
    settings(page, temperature="0", max_tokens="160")
    send(server.proc, f"hold 3 {how}")  # the third decode step of the reply waits for "go"
    try:
        reply = ask(page, "Write a long story about a dragon who learns to fly.")
        server.output.wait_for(f"step held {how}")
        wait(page, lambda _: reply.find_element(By.CSS_SELECTOR, ".content").text != "")  # shown before the end
        assert reply.get_attribute("data-state") == "streaming" and gauge(server, "hkserve_requests_running") == 1
        shown = reply.find_element(By.CSS_SELECTOR, ".content").text
        if how == "button":
            page.find_element(By.ID, "stop").click()
        else:
            page.find_element(By.ID, "prompt").send_keys(Keys.ESCAPE)
        assert finished(page, reply) == "stopped"
        server.output.wait_for(f"cancel during hold {how}")  # the server saw the client leave while the reply ran
    finally:
        send(server.proc, "go")  # also when the test failed: the next tests need the engine
    wait(page, lambda _: gauge(server, "hkserve_requests_running") == 0)
    assert reply.find_element(By.CSS_SELECTOR, ".content").text == shown  # the partial reply stays
    assert reply.find_element(By.CSS_SELECTOR, ".stats").text.endswith(" · stopped")
    assert page.find_element(By.ID, "send").is_displayed() and not page.find_element(By.ID, "stop").is_displayed()


def test_a_reload_keeps_the_conversations_and_the_key_stays_out_of_local_storage(page, server):
    settings(page, temperature="0", max_tokens="4")
    assert finished(page, ask(page, "Name a colour.")) == "done"
    before = [m.text for m in page.find_elements(By.CSS_SELECTOR, ".msg")]
    listed = [c.text for c in page.find_elements(By.CSS_SELECTOR, "#conversations li")]
    page.refresh()
    wait(page, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg")) == len(before))
    assert [m.text for m in page.find_elements(By.CSS_SELECTOR, ".msg")] == before
    assert [c.text for c in page.find_elements(By.CSS_SELECTOR, "#conversations li")] == listed
    assert page.find_element(By.ID, "api-key").get_attribute("value") == KEY  # session storage
    kept = page.execute_script("return JSON.stringify(localStorage)")
    assert "Name a colour." in kept and KEY not in kept  # conversations in local storage, never the key


def test_a_json_schema_in_the_settings_gives_text_that_validates(page, server):
    settings(page, temperature="0", max_tokens="60", schema=json.dumps(PERSON))
    reply = ask(page, "Describe a person.")
    assert finished(page, reply) == "done"
    jsonschema.validate(json.loads(reply.find_element(By.CSS_SELECTOR, ".content code").text), PERSON)


def test_model_text_with_markup_is_shown_as_text(page, server):
    """The model is made to write HOSTILE (a schema whose only value it is); the user's message holds it too."""
    settings(page, temperature="0", max_tokens="60", schema=json.dumps({"const": HOSTILE}))
    reply = ask(page, "Say it. " + HOSTILE)
    assert finished(page, reply) == "done"
    assert reply.find_element(By.CSS_SELECTOR, ".content code").text == json.dumps(HOSTILE)
    assert HOSTILE in page.find_element(By.CSS_SELECTOR, ".msg.user .content").text
    assert_inert(page, "#messages")


MARKDOWN = f"""# Title {HOSTILE}
Some *em* and **bold** and `{HOSTILE}`, snake_case_name.

- item {HOSTILE}
1. first

```html
{HOSTILE}
```
"""


def test_every_markdown_path_renders_markup_as_text(page, server):
    """The renderer itself over headings, emphasis, code spans, lists and a fenced block, all with HOSTILE."""
    page.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "import('/web/markdown.js').then((m) => { const box = document.createElement('div'); box.id = 'probe';"
        " box.appendChild(m.renderMarkdown(arguments[0])); document.body.appendChild(box); done(); });",
        MARKDOWN,
    )
    probe = page.find_element(By.ID, "probe")
    tags = page.execute_script("return [...arguments[0].querySelectorAll('*')].map((e) => e.tagName)", probe)
    assert tags == ["H3", "P", "EM", "STRONG", "CODE", "UL", "LI", "OL", "LI", "DIV", "PRE", "CODE", "SPAN"]
    assert probe.find_element(By.CSS_SELECTOR, "pre code").text == HOSTILE
    assert "snake_case_name" in probe.find_element(By.CSS_SELECTOR, "p").text
    assert probe.text.count("<script>") == 4
    assert_inert(page, "#probe")


def assert_inert(driver, selector: str) -> None:
    """No element was made of the markup, and none of its script ran."""
    found = driver.execute_script(
        "return document.querySelector(arguments[0]).querySelectorAll('script, img').length", selector
    )
    assert found == 0 and driver.execute_script("return window.pwned") is None


def test_the_page_fits_a_phone_screen(page, server):
    phone = {"width": 390, "height": 844, "deviceScaleFactor": 2, "mobile": True}
    page.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", phone)
    try:
        assert page.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
        assert all(page.find_element(By.ID, name).is_displayed() for name in ("prompt", "send", "api-key"))
        assert not page.find_element(By.ID, "side").is_displayed()  # the list folds away behind its button
        page.find_element(By.ID, "toggle-side").click()
        page.find_element(By.ID, "new-chat").click()  # reachable, and picking folds the list again
        assert not page.find_element(By.ID, "side").is_displayed()
    finally:
        page.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def test_the_page_loads_without_the_key_behind_the_same_guard_while_the_api_needs_the_key(smollm2_home):
    tokenizer = ModelStore(smollm2_home).tokenizer(NAME)
    app = create_app(
        FakeRunner([tokenizer.eos_id]), tokenizer, NAME, 256, api_key=KEY, limits=ServerLimits(max_body_bytes=64)
    )
    server = LiveServer(app)
    try:
        page = httpx.get(server.url + "/", timeout=30)
        assert page.status_code == 200 and page.headers["content-type"] == web.ASSETS["index.html"]
        assert "default-src 'self'" in page.headers["content-security-policy"]
        for name in web.ASSETS:
            asset = httpx.get(f"{server.url}/web/{name}", timeout=30)
            assert name == "index.html" or (asset.status_code, asset.headers["content-type"]) == (200, web.ASSETS[name])
        assert httpx.get(server.url + "/web/other.js", timeout=30).status_code == 401  # only the page's own files
        assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 401
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=30).status_code == 401
        authorized = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        assert authorized.status_code == 200
        too_big = httpx.request("GET", server.url + "/", content=b"x" * 65, timeout=30)  # the client limits hold
        assert too_big.status_code == 413
    finally:
        server.stop()


def test_no_web_leaves_slash_a_404(smollm2_home):
    """`hkserve serve --no-web`: / is a 404 (checked as soon as uvicorn answers, before the warm-up ends)."""
    port = free_port()
    proc, output = start_server(smollm2_home, "--port", str(port), "--slots", "1", "--max-len", "128", "--no-web")
    try:
        output.wait_for("Started server process")
        page = httpx.get(f"http://127.0.0.1:{port}/", timeout=60)
        assert page.status_code == 404 and page.json()["error"]["type"] == "not_found_error"
        assert httpx.get(f"http://127.0.0.1:{port}/web/app.js", timeout=60).status_code == 404
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=60).status_code == 200  # the API is there
    finally:
        proc.kill()
        proc.wait(30)


def test_an_earlier_message_edited_is_asked_again_and_what_followed_goes_and_copy_copies_it(page, server, golden):
    case = next(c for c in golden["cases"] if "messages" in c)
    settings(page, temperature="0", max_tokens="4")
    prompt = page.find_element(By.ID, "prompt")
    prompt.send_keys("Name a colour.", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "Just one.")  # Shift+Enter: a new line
    assert prompt.get_attribute("value") == "Name a colour.\nJust one." and not page.find_elements(
        By.CSS_SELECTOR, ".msg"
    )
    assert finished(page, ask(page, "")) == "done"  # Enter sends
    assert finished(page, ask(page, "Name a fruit.")) == "done"
    settings(page, temperature="0", max_tokens="32")
    page.find_elements(By.CSS_SELECTOR, ".msg.user .edit")[0].click()
    area = page.find_element(By.CSS_SELECTOR, ".msg.user textarea")
    area.clear()
    area.send_keys(case["messages"][0]["content"])
    page.find_element(By.CSS_SELECTOR, ".msg.user .content button").click()  # its Send
    wait(page, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg")) == 2)
    reply = page.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]
    assert finished(page, reply) == "done"
    texts = [m.text for m in page.find_elements(By.CSS_SELECTOR, ".msg .content")]
    assert texts == [case["messages"][0]["content"], case["text"]]
    clipboard = {"origin": server.url, "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]}
    page.execute_cdp_cmd("Browser.grantPermissions", clipboard)
    reply.find_element(By.CSS_SELECTOR, ".copy").click()
    wait(page, lambda _: reply.find_element(By.CSS_SELECTOR, ".copy").text == "Copied")
    copied = page.execute_async_script("navigator.clipboard.readText().then(arguments[arguments.length - 1])")
    assert copied == case["text"]  # the copy button copies the reply's own text
