"""The web page (issue #43, docs/web.md) in a real browser: Debian's Chromium driven by Playwright, against a real
supervisor serving SmolLM2 in a real runner, with a token set (as a deployment would).

Each test saves a screenshot under tests/screenshots/ (git-ignored)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from common.defaults import SMOLLM2_DIR
from tests.processes import SupervisorProcess, model_toml, wait_until

CHROMIUM = "/usr/bin/chromium"  # Debian's package (make browser); Playwright's own browsers are never downloaded
TOKEN = "web-test-token"
SCREENSHOTS = Path(__file__).resolve().parent / "screenshots"
VIEWPORT = {"width": 1180, "height": 760}


@pytest.fixture(scope="module")
def sup(tmp_path_factory):
    """One supervisor for the module: SmolLM2 as "smol", loaded at start, with memory limits to draw."""
    models = model_toml("smol", target=SMOLLM2_DIR, draft=None, soft_limit="1500MiB", hard_limit="3GiB")
    process = SupervisorProcess(tmp_path_factory.mktemp("web"), models, auth_token=TOKEN).wait_ready(180)
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        # --no-sandbox: the tests may run as root (a container's CI), where Chromium's sandbox refuses to start.
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


class Page:
    """A fresh browser context on the supervisor's page (its own localStorage), recording console errors, page
    errors and every request that leaves the supervisor's origin."""

    def __init__(self, browser, sup: SupervisorProcess, token: str | None = TOKEN, stored: dict | None = None):
        self.origin = f"http://127.0.0.1:{sup.http_port}"
        self.context = browser.new_context(viewport=VIEWPORT)
        seeded = {**({"mlxserve.token": token} if token else {}), **(stored or {})}
        if seeded:  # before the page's scripts run, at its first load only
            self.context.add_init_script(
                "if (!sessionStorage.getItem('seeded')) { sessionStorage.setItem('seeded', '1');"
                + "".join(f"localStorage.setItem({json.dumps(k)}, {json.dumps(v)});" for k, v in seeded.items())
                + "}"
            )
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.elsewhere: list[str] = []
        self.dialogs: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        self.page.on(
            "request", lambda r: r.url.startswith((self.origin, "data:", "blob:")) or self.elsewhere.append(r.url)
        )
        self.response = self.page.goto(self.origin + "/")

    def shot(self, name: str) -> None:
        SCREENSHOTS.mkdir(exist_ok=True)
        self.page.screenshot(path=str(SCREENSHOTS / f"{name}.png"))

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def page(browser, sup, request):
    opened = Page(browser, sup)
    yield opened
    opened.shot(request.node.name)
    opened.close()


def ready(page) -> None:
    """The page unlocked, with its model picked."""
    page.wait_for_selector("#main:not([hidden])")
    until(page, "document.querySelector('#model').value === 'smol'")


def until(page, expression: str, timeout: float = 30) -> None:
    """Wait for a JavaScript expression to be true in the page, evaluated from outside (the page's policy forbids
    the eval that Playwright's own wait_for_function runs inside it)."""
    deadline = time.monotonic() + timeout
    while not page.evaluate(expression):
        assert time.monotonic() < deadline, f"not within {timeout} s: {expression}"
        page.wait_for_timeout(50)


def http(sup, path: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, dict, str]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{sup.http_port}{path}",
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read().decode()


def cancelled_requests(sup) -> float:
    _, metrics = sup.probe("/metrics")
    found = re.search(r'^mlxserve_requests_total\{code="CANCELLED",model="smol"\} (\S+)$', metrics, re.M)
    return float(found.group(1)) if found else 0.0


def test_the_vendored_files_are_the_ones_named_with_their_versions_and_licences():
    """supervisor/web/vendor/README.md names each vendored file with its version, licence and sha256."""
    import hashlib

    vendor = Path(__file__).resolve().parent.parent / "supervisor" / "web" / "vendor"
    rows = []
    for line in (vendor / "README.md").read_text().splitlines():
        cells = [cell.strip().strip("`") for cell in line.strip("|").split("|")]
        if cells[0].endswith(".js"):
            rows.append((cells[0], cells[2], re.search(r"LICENSE\.\w+", cells[4]).group(0), cells[5]))
    assert sorted(name for name, *_ in rows) == sorted(p.name for p in vendor.glob("*.js"))
    for name, version, licence, digest in rows:
        assert hashlib.sha256((vendor / name).read_bytes()).hexdigest() == digest, name
        assert (vendor / licence).is_file(), licence
        assert version in (vendor / name).read_text()[:4000] or version in (vendor / name).read_text()[-4000:], name


@pytest.mark.parametrize("on", [True, False])
def test_web_page_turns_the_page_on_and_off(on):
    """``web_page``: a browser's GET / is the page, or Ollama's answer as to any other client; /web/ is there or
    not. (The app alone: its routes need nothing of the supervisor but its config.)"""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from supervisor.config import default_config
    from supervisor.http_api import create_app

    client = TestClient(create_app(SimpleNamespace(config=default_config(web_page=on))))
    page = client.get("/", headers={"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"})
    assert page.headers["content-type"].startswith("text/html" if on else "text/plain")
    assert ("content-security-policy" in page.headers) == on
    assert client.get("/", headers={"Accept": "*/*"}).text == "Ollama is running"
    assert client.get("/web/app.js").status_code == (200 if on else 404)


def test_the_page_loads_with_no_console_error_and_nothing_from_elsewhere(page, sup):
    assert page.response.status == 200
    policy = page.response.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "script-src 'self'" in policy and "connect-src 'self'" in policy
    ready(page.page)
    assert page.page.locator("#model-list option[value='smol']").count() == 1
    page.page.click(".tab[data-view='runners']")
    page.page.wait_for_selector(".runner[data-model='smol'] path.series.rss", state="attached")
    page.page.click(".tab[data-view='chat']")
    page.page.wait_for_timeout(300)
    assert page.errors == []
    assert page.elsewhere == []
    # A client that is not a browser still gets Ollama's answer at the root, which its clients check.
    status, _, text = http(sup, "/", headers={"Accept": "*/*"})
    assert (status, text) == (200, "Ollama is running")
    # The page's files come from the package alone, each with the policy.
    assert http(sup, "/web/app.js")[1]["content-security-policy"] == policy
    assert http(sup, "/web/../config.py")[0] == 404


def test_a_chat_streams_its_answer_token_by_token_and_keeps_it(page, sup):
    p = page.page
    ready(p)
    p.fill("#system", "You are a helpful assistant.")
    p.fill("#temperature", "0")
    p.fill("#max-tokens", "120")
    p.fill("#prompt", "Write a short poem about the sea.")
    p.click("#send")
    answer = p.locator(".message.assistant").last
    states = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = answer.locator(".content").inner_text()
        if text and (not states or text != states[-1]):
            states.append(text)
        if "streaming" not in (answer.get_attribute("class") or ""):
            break
        p.wait_for_timeout(15)
    final = answer.locator(".content").inner_text()
    assert final.strip(), "no answer"
    # Seen growing: several partial answers, each longer than the one before, before the whole.
    partial = [s for s in states if s != final]
    assert len(partial) >= 3, f"the answer did not stream: {len(states)} states seen"
    assert all(len(a) <= len(b) for a, b in zip(partial, partial[1:]))
    figures = answer.locator(".figures")
    for name in ("tok/s", "first token", "tokens", "cached prompt"):
        assert figures.locator(f"[data-figure='{name}']").count() == 1, name
    assert "error" not in answer.inner_html()
    assert page.errors == []
    page.shot("chat")
    # Kept in the browser: a reload shows the conversation again.
    p.reload()
    p.wait_for_selector(".message.assistant .figures")
    assert p.locator(".message.user .content").last.inner_text() == "Write a short poem about the sea."
    assert p.locator(".message.assistant .content").last.inner_text() == final
    assert p.locator("#system").input_value() == "You are a helpful assistant."


def test_stop_ends_the_request(page, sup):
    p = page.page
    ready(p)
    before = cancelled_requests(sup)
    # Greedy, on a prompt SmolLM2 answers at length (past 400 tokens): a sampled answer to a counting prompt was
    # sometimes a few words and ended before Stop could be pressed (CI, 2026-12-06).
    p.fill("#temperature", "0")
    p.fill("#max-tokens", "2000")
    p.fill("#prompt", "Write a long essay about the history of the Roman empire.")
    p.click("#send")
    answer = p.locator(".message.assistant").last
    until(p, "document.querySelector('.message.assistant:last-child .content').innerText.length > 20", 60)
    p.click("#stop")
    p.wait_for_selector("#send:not([hidden])", timeout=5000)
    assert answer.locator(".error").inner_text() == "stopped"
    # The supervisor saw the client go and cancelled the runner's generation: counted CANCELLED, and the runner
    # is left with nothing to do, long before its 2000 tokens.
    assert wait_until(lambda: cancelled_requests(sup) == before + 1, 10), "no cancelled request counted"
    assert wait_until(lambda: sup.client.model("smol").in_flight == 0, 5)
    generated = sup.client.model("smol").generated_tokens
    time.sleep(0.6)
    assert sup.client.model("smol").generated_tokens == generated


def test_a_models_markdown_with_script_and_img_onerror_does_nothing(browser, sup):
    crafted = (
        "# Heading\n\nSome **bold** text.\n\n<script>window.pwned = 'script'; alert('script')</script>\n\n"
        "<img src=\"x\" onerror=\"window.pwned = 'img'; alert('img')\">\n\n"
        "[a link](javascript:window.pwned='link')\n\n"
        '<a href="javascript:alert(1)" onclick="window.pwned=\'click\'">click me</a>\n\n'
        "```python\nprint('<b>not bold</b>')\n```\n"
    )
    conversation = {
        "id": "crafted",
        "title": "crafted",
        "system": "",
        "updated": 0,
        "messages": [
            {"role": "user", "content": "<img src=x onerror=\"window.pwned='user'\">"},
            {"role": "assistant", "model": "smol", "content": crafted},
            {"role": "user", "content": "And the weather?"},
            {
                "role": "assistant",
                "model": "smol",
                "content": "",
                "reasoning": "The user asks <b>the weather</b>: call the tool.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "<img src=x onerror=alert(1)>"}'},
                    }
                ],
            },
        ],
    }
    opened = Page(browser, sup, stored={"mlxserve.conversations": json.dumps([conversation])})
    try:
        p = opened.page
        p.wait_for_selector(".message.assistant .content h1")
        content = p.locator(".message.assistant .content").first
        # The Markdown was rendered (the same path a streamed answer takes) ...
        assert content.locator("h1").inner_text() == "Heading"
        assert content.locator("strong").inner_text() == "bold"
        assert content.locator("pre code").inner_text().strip() == "print('<b>not bold</b>')"
        assert content.locator("pre b").count() == 0
        # ... and everything that would run was taken out before it reached the document.
        assert p.locator("#messages script, #messages img, #messages [onerror], #messages [onclick]").count() == 0
        hrefs = p.eval_on_selector_all("#messages a", "links => links.map(a => a.getAttribute('href') || '')")
        assert not [h for h in hrefs if h.lower().startswith("javascript")]
        assert p.locator(".message.user .content").first.inner_text() == "<img src=x onerror=\"window.pwned='user'\">"
        # Reasoning folded, tool calls shown, as text.
        reasoning = p.locator(".message.assistant details.reasoning")
        assert reasoning.count() == 1 and reasoning.get_attribute("open") is None
        assert reasoning.locator(".reasoning-text").text_content() == "The user asks <b>the weather</b>: call the tool."
        reasoning.locator("summary").click()
        assert reasoning.locator(".reasoning-text").is_visible()
        call = p.locator(".message.assistant .tool-call")
        assert call.locator(".tool-name").inner_text() == "tool call: get_weather"
        assert call.locator("pre").inner_text() == '{"city": "<img src=x onerror=alert(1)>"}'
        p.get_by_text("click me").click()
        p.get_by_text("a link").click()
        p.wait_for_timeout(300)
        assert p.evaluate("window.pwned") is None
        assert opened.dialogs == []
        opened.shot("test_markdown")
    finally:
        opened.close()


def test_an_attached_image_goes_to_the_model_as_an_image_url(page, tmp_path):
    """SmolLM2 reads text only: the runner's refusal of the image shows the picture reached it, as OpenAI's
    image_url part with a data: URL, and the page shows the refusal as the answer's error."""
    from PIL import Image

    picture = tmp_path / "red.png"
    Image.new("RGB", (32, 32), (200, 30, 30)).save(picture)
    p = page.page
    ready(p)
    p.set_input_files("#image", str(picture))
    p.wait_for_selector("#attachment:not([hidden])")
    assert p.locator("#attachment-preview").get_attribute("src").startswith("data:image/png;base64,")
    p.fill("#prompt", "What colour is this?")
    p.click("#send")
    p.wait_for_selector("#send:not([hidden])", timeout=30_000)
    assert p.locator(".message.user img.attached").count() == 1
    error = p.locator(".message.assistant").last.locator(".error").inner_text()
    assert "does not take images" in error, error
    assert p.locator("#attachment").is_hidden()


def test_the_token_prompt_comes_first_and_the_apis_refuse_without_it(browser, sup):
    for path, body in (("/v1/models", None), ("/mlxserve/status", None), ("/api/ps", None)):
        assert http(sup, path, body)[0] == 401, path
    chat = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}]}
    assert http(sup, "/v1/chat/completions", chat)[0] == 401
    assert http(sup, "/mlxserve/status", headers={"Authorization": f"Bearer {TOKEN}"})[0] == 200
    opened = Page(browser, sup, token=None)
    try:
        p = opened.page
        p.wait_for_selector("#token-dialog[open]")
        assert p.locator("#main").is_hidden() and p.locator("#tabs").is_hidden()
        assert p.locator(".message, .runner").count() == 0
        opened.shot("test_token_prompt")
        p.fill("#token-input", "wrong")
        p.click("#token-submit")
        p.wait_for_selector("#token-error:not([hidden])")
        assert "refused" in p.locator("#token-error").inner_text()
        assert p.locator("#main").is_hidden()
        p.fill("#token-input", TOKEN)
        p.click("#token-submit")
        ready(p)
        assert p.locator("#token-dialog").is_hidden()
        assert p.evaluate("localStorage.getItem('mlxserve.token')") == TOKEN
        opened.shot("test_token_accepted")
    finally:
        opened.close()


def cell(name: str) -> str:
    """JavaScript for the text of the smol card's field ``name`` ("" while there is none)."""
    return f"(document.querySelector(\".runner[data-model='smol'] td[data-field='{name}']\")?.innerText ?? '')"


BADGE = "(document.querySelector(\".runner[data-model='smol'] .badge\")?.innerText ?? '')"


def test_the_runners_view_follows_a_runner_killed_and_restarted(page, sup):
    p = page.page
    ready(p)
    p.click(".tab[data-view='runners']")
    card = p.locator(".runner[data-model='smol']")
    status = sup.client.model("smol")
    pid, restarts = status.pid, status.restarts
    assert pid
    until(p, f"{cell('pid')} === '{pid}'")
    rss = p.evaluate(cell("RSS"))
    assert re.match(r"\d+(\.\d)? MiB", rss), rss
    assert card.locator(".badge").inner_text() == "serving"
    assert card.locator("path.series.rss").count() == 1
    assert p.evaluate(cell("restarts")) == str(restarts)
    # Unload and load again with the card's buttons (Ollama's keep_alive 0 and an empty generate).
    card.locator("button.unload").click()
    until(p, f"{cell('pid')} === '-' && {BADGE} === 'stopped'", 30)
    assert sup.client.model("smol").pid == 0
    card.locator("button.load").click()
    until(p, f"!['-', '', '{pid}'].includes({cell('pid')}) && {BADGE} === 'serving'", 60)
    pid, restarts = sup.client.model("smol").pid, sup.client.model("smol").restarts
    until(p, f"{cell('pid')} === '{pid}' && /MiB/.test({cell('RSS')})")
    rss = p.evaluate(cell("RSS"))
    os.kill(pid, signal.SIGKILL)
    seen = set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        shown = p.evaluate(f"[{cell('pid')}, {cell('RSS')}, {cell('restarts')}]")
        seen.add(shown[1])
        if shown[0] not in ("", "-", str(pid)) and p.evaluate(BADGE) == "serving":
            break
        p.wait_for_timeout(100)
    new_pid = sup.client.model("smol").pid
    assert new_pid not in (0, pid)
    until(p, f"{cell('pid')} === '{new_pid}'")
    assert p.evaluate(cell("restarts")) == str(restarts + 1)
    assert "killed by SIGKILL" in p.evaluate(cell("last failure"))
    # The RSS shown followed the new process: other figures than the killed one's while it started.
    assert len(seen - {rss}) >= 1, seen
    assert re.match(r"\d+(\.\d)? MiB", p.evaluate(cell("RSS")))
    p.wait_for_timeout(1500)  # the chart's new line, for the screenshot (README)
    page.shot("runners")
    assert page.errors == []
