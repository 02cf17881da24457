"""The web page at `/` (host/rudder/server/static/), in a real headless browser: Debian's
Chromium driven by selenium (chromium and chromium-driver come from `make setup`). One browser
for the module, against `rudder serve` with SmolLM2 and API keys on; every wait is explicit.
Screenshots of each state go to the test's temporary folder.

The plain-HTTP checks (the page and its files are served without a key, offline, and
/v1/status follows the key) use the tiny model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import jsonschema
import pytest
from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from rudder.server import ServerConfig
from rudder.server.auth import KeyRing
from serve_util import LiveServer, build_rewind

STATIC = Path(__file__).resolve().parents[1] / "host" / "rudder" / "server" / "static"
KEY, OTHER_KEY = "sk-web-user", "sk-other-user"
RUN_S = 240  # the most one generation may take on a loaded two-core machine


def keys() -> KeyRing:
    return KeyRing([(KEY, "user", "web"), (OTHER_KEY, "user", "other")])


# -- the page over plain HTTP (tiny model) -----------------------------------------------------

@pytest.fixture(scope="module")
def tiny_server():
    with LiveServer(ServerConfig(model="tiny", api_keys=keys())) as s:
        yield s


def test_the_page_and_its_files_need_no_key_and_nothing_from_elsewhere(tiny_server):
    page = httpx.get(tiny_server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    files = sorted(p.name for p in STATIC.iterdir())
    assert {"index.html", "app.js", "style.css"} <= set(files)
    for name in files:
        r = httpx.get(f"{tiny_server.url}/static/{name}")
        assert r.status_code == 200, name
        if name.endswith(".js"):
            assert "javascript" in r.headers["content-type"]  # or browsers refuse the modules
        # offline: no URL of another host anywhere (the page calls its own server only)
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", r.text, re.I), name
    assert httpx.get(tiny_server.url + "/static/nothing.js").status_code == 404


def test_status_names_the_model_and_the_keys_tenant(tiny_server):
    assert httpx.get(tiny_server.url + "/v1/status").status_code == 401
    s = httpx.get(tiny_server.url + "/v1/status", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert s["model"] == "tiny" and s["tenant"] == "web" and s["role"] == "user" and s["keys"] is True
    assert s["dtype"] in ("fp32", "bf16", "int8") and s["threads"]["torch"] >= 1
    assert s["kv"]["blocks_total"] > 0 and 0 <= s["kv"]["usage"] <= 1 and s["vocab_size"] == 512
    assert "json" in s["builtin"] and s["running"] == 0 and s["queued"] == 0


# -- the page in a browser (SmolLM2) ------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with LiveServer(ServerConfig(model="smollm2", api_keys=keys(), max_tokens=512)) as s:
        rewind = build_rewind(tmp_path_factory.mktemp("rewind"))
        with s.client(headers={"Authorization": f"Bearer {OTHER_KEY}"}) as c:  # another tenant's tag
            module = c.post("/v1/controllers", content=rewind).json()["module_id"]
            assert c.post("/v1/controllers/tags", json={"tag": "others-rewind", "module_id": module}).status_code == 200
        yield s


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    driver.downloads = tmp_path_factory.mktemp("downloads")
    driver.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(driver.downloads)})
    yield driver
    driver.quit()


def wait(driver, condition, timeout=30, poll=0.05):
    return WebDriverWait(driver, timeout, poll_frequency=poll).until(lambda d: condition())


def find(driver, css):
    return driver.find_element(By.CSS_SELECTOR, css)


def finds(driver, css):
    return driver.find_elements(By.CSS_SELECTOR, css)


def open_page(driver, server, key: str | None, tab: str = "chat"):
    """A fresh load of the page with `key` in local storage, on `tab`."""
    driver.get(server.url + "/healthz")  # the same origin: the page's local storage
    driver.execute_script("localStorage.clear(); if (arguments[0]) localStorage.setItem('rudder.apiKey', arguments[0]);",
                          key)
    driver.get(f"{server.url}/#{tab}")
    if key == KEY:
        wait(driver, lambda: "smollm2" in find(driver, "#status").text)


def shot(driver, tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.png"
    driver.save_screenshot(str(path))
    return path


def set_field(driver, css: str, value: str):
    field = find(driver, css)
    field.clear()
    field.send_keys(value)


@pytest.mark.model
def test_a_missing_or_wrong_key_says_so_and_the_right_one_opens_the_page(server, browser, tmp_path):
    open_page(browser, server, None)
    banner = find(browser, "#error")
    wait(browser, lambda: banner.is_displayed() and "needs an API key" in banner.text)
    set_field(browser, "#api-key", "sk-wrong")
    find(browser, "#key-save").click()
    wait(browser, lambda: "the API key is not valid" in banner.text)
    assert "Enter a valid key in the field at the top right" in banner.text
    shot(browser, tmp_path, "wrong-key")
    set_field(browser, "#api-key", KEY)
    find(browser, "#key-save").click()
    wait(browser, lambda: not banner.is_displayed() and "smollm2" in find(browser, "#status").text)
    status = find(browser, "#status").text
    assert "web (user)" in status and "dtype" in status.lower() and "queued" in status
    assert browser.execute_script("return localStorage.getItem('rudder.apiKey')") == KEY
    browser.refresh()  # kept across loads
    wait(browser, lambda: "smollm2" in find(browser, "#status").text)
    assert find(browser, "#api-key").get_attribute("value") == KEY


def last_answer(driver):
    answers = finds(driver, ".message.assistant")
    return answers[-1] if answers else None


def send(driver, text: str):
    set_field(driver, "#chat-input", text)
    find(driver, "#chat-send").click()


@pytest.mark.model
def test_chat_streams_stops_and_regenerates(server, browser, tmp_path):
    open_page(browser, server, KEY)
    set_field(browser, "#max_tokens", "48")
    set_field(browser, "#seed", "3")
    send(browser, "Why do ships have rudders?")
    partial = []

    def streaming_text():  # the answer while it streams: some text, not yet done
        node = last_answer(browser)
        if node is None or "streaming" not in node.get_attribute("class"):
            return False
        text = node.find_element(By.CSS_SELECTOR, ".content").text
        if text:
            partial.append(text)
        return bool(text)

    wait(browser, streaming_text, RUN_S, poll=0.02)
    shot(browser, tmp_path, "chat-streaming")
    wait(browser, lambda: "done" in last_answer(browser).get_attribute("class"), RUN_S)
    answer = last_answer(browser)
    final = answer.find_element(By.CSS_SELECTOR, ".content").text
    assert len(final) > len(partial[0]) and final.startswith(partial[0])
    assert int(answer.get_attribute("data-chunks")) > 1  # many deltas, shown as they came
    assert "finish: " in answer.text
    shot(browser, tmp_path, "chat-done")

    find(browser, "#chat-regenerate").click()  # the same turn, answered again in place of the answer
    wait(browser, lambda: "done" in last_answer(browser).get_attribute("class"), RUN_S)
    assert len(finds(browser, ".message.assistant")) == 1 and len(finds(browser, ".message.user")) == 1

    set_field(browser, "#max_tokens", "400")
    send(browser, "Tell me a long story about the sea.")
    wait(browser, lambda: len(finds(browser, ".message.assistant")) == 2 and "streaming" in
         last_answer(browser).get_attribute("class") and last_answer(browser).find_element(By.CSS_SELECTOR, ".content").text,
         RUN_S)
    find(browser, "#chat-stop").click()
    wait(browser, lambda: "stopped" in last_answer(browser).text)
    wait(browser, lambda: httpx.get(server.url + "/healthz").json()["running"] == 0)  # the server let it go
    assert not find(browser, "#chat-send").get_attribute("disabled")


@pytest.mark.model
def test_chat_json_schema_gives_a_parsed_valid_document(server, browser, tmp_path):
    open_page(browser, server, KEY)
    Select(find(browser, "#so-mode")).select_by_value("json")
    Select(find(browser, "#json-example")).select_by_visible_text("A person")
    schema = json.loads(find(browser, "#json-schema").get_attribute("value"))
    set_field(browser, "#max_tokens", "80")
    send(browser, "Invent a person.")
    wait(browser, lambda: last_answer(browser) and "done" in last_answer(browser).get_attribute("class"), RUN_S)
    shot(browser, tmp_path, "chat-json")
    parsed = last_answer(browser).find_element(By.CSS_SELECTOR, ".parsed")
    assert parsed.find_element(By.CSS_SELECTOR, ".label.ok").text.lower() == "parsed json"
    document = json.loads(parsed.find_element(By.CSS_SELECTOR, "pre").text)
    jsonschema.validate(document, schema)
    # a schema that is not JSON is caught in the editor, before any request
    set_field(browser, "#json-schema", "{not json")
    assert "not valid JSON" in find(browser, "#json-schema-check").text


@pytest.mark.model
def test_chat_tool_calls_come_as_cards(server, browser, tmp_path):
    open_page(browser, server, KEY)
    Select(find(browser, "#so-mode")).select_by_value("tools")
    Select(find(browser, "#tool-choice")).select_by_value("required")
    set_field(browser, "#max_tokens", "60")
    send(browser, "What is the weather in Paris?")
    wait(browser, lambda: last_answer(browser) and "done" in last_answer(browser).get_attribute("class"), RUN_S)
    shot(browser, tmp_path, "chat-tools")
    [card] = last_answer(browser).find_elements(By.CSS_SELECTOR, ".tool-card")
    name = card.find_element(By.CSS_SELECTOR, ".name").text
    args = json.loads(card.find_element(By.CSS_SELECTOR, "pre").text)
    assert name in ("get_weather()", "get_time()") and "city" in args
    assert "finish: tool_calls" in last_answer(browser).text


def run_controller(driver, name: str, arg: str | None = None, prompt: str | None = None, max_tokens: int = 40):
    Select(find(driver, "#pg-controller")).select_by_value(name)
    if arg is not None:
        set_field(driver, "#pg-arg", arg)
    if prompt is not None:
        set_field(driver, "#pg-prompt", prompt)
    set_field(driver, "#pg-max-tokens", str(max_tokens))
    find(driver, "#pg-run").click()
    summary = find(driver, "#pg-summary")
    wait(driver, lambda: {"done", "bad"} & set(summary.get_attribute("class").split()), RUN_S)
    assert "done" in summary.get_attribute("class"), summary.text


def open_playground(driver, server):
    open_page(driver, server, KEY, "playground")
    wait(driver, lambda: len(Select(find(driver, "#pg-controller")).options) >= 9)


@pytest.mark.model
def test_playground_json_controller_with_a_schema_gives_a_valid_document(server, browser, tmp_path):
    open_playground(browser, server)
    Select(find(browser, "#pg-controller")).select_by_value("json")
    schema = json.loads(find(browser, "#pg-arg").get_attribute("value"))  # the example schema
    run_controller(browser, "json", max_tokens=80)
    column = find(browser, ".column")
    jsonschema.validate(json.loads(column.find_element(By.CSS_SELECTOR, ".text").text), schema)
    assert column.find_elements(By.CSS_SELECTOR, ".chip.masked") and column.find_elements(By.CSS_SELECTOR, ".chip.forced")
    assert finds(browser, "#pg-columns .chip.stop")
    chip = column.find_elements(By.CSS_SELECTOR, ".chip.masked")[0]
    ActionChains(browser).move_to_element(chip).perform()
    detail = find(browser, "#pg-detail")
    wait(browser, lambda: "sampled under a mask" in detail.text)
    assert re.search(r"allowed \d+ of 49152", detail.text) and "%" in detail.text
    assert "allowed" in chip.get_attribute("title") and "p = " in chip.get_attribute("title")
    shot(browser, tmp_path, "playground-json")

    find(browser, "#pg-export").click()
    exported = browser.downloads / "rudder-trace.json"
    wait(browser, exported.exists)
    wait(browser, lambda: exported.stat().st_size > 0 and json.loads(exported.read_text()))
    run = json.loads(exported.read_text())
    assert run["request"]["controller"] == "json" and run["request"]["trace"] is True
    assert len(run["trace"]) == len(finds(browser, "#pg-strip .tick")) and run["done"]["type"] == "done"  # a tick a step


@pytest.mark.model
def test_playground_backtrack_strikes_through_the_tokens_it_took_back(server, browser, tmp_path):
    open_playground(browser, server)
    run_controller(browser, "backtrack", arg="e", prompt="Describe the sea.", max_tokens=16)
    struck = finds(browser, "#pg-columns .chip.taken-back")
    assert struck and "e" in struck[0].text  # a backtrack takes back from the token holding the word
    assert browser.execute_script("return getComputedStyle(arguments[0]).textDecorationLine", struck[0]) == "line-through"
    assert "taken back at step" in struck[0].get_attribute("title")
    shot(browser, tmp_path, "playground-backtrack")


@pytest.mark.model
def test_playground_fork_three_shows_three_columns(server, browser, tmp_path):
    open_playground(browser, server)
    run_controller(browser, "fork", arg="3", prompt="Give me a name for a boat.", max_tokens=24)
    columns = finds(browser, ".column")
    assert len(columns) == 3
    heads = [c.find_element(By.CSS_SELECTOR, ".column-head").text for c in columns]
    assert heads[0].startswith("sequence 0") and all("forked from 0" in h for h in heads[1:])
    assert all(c.find_elements(By.CSS_SELECTOR, ".chip.free") for c in columns)
    assert all(c.get_attribute("data-finish") for c in columns)
    ActionChains(browser).move_to_element(columns[1].find_elements(By.CSS_SELECTOR, ".chip.free")[2]).perform()
    wait(browser, lambda: "sampled freely" in find(browser, "#pg-detail").text)
    shot(browser, tmp_path, "playground-fork")


@pytest.mark.model
def test_playground_lists_only_the_tenants_tags_and_takes_an_upload(server, browser, tmp_path):
    with server.client(headers={"Authorization": f"Bearer {KEY}"}) as c:
        tags = {t["tag"]: t["module_id"] for t in c.get("/v1/controllers/tags").json()["tags"]}
        assert c.post("/v1/controllers/tags", json={"tag": "my-rewind", "module_id": tags["others-rewind"]}).status_code == 200
    open_playground(browser, server)
    picker = Select(find(browser, "#pg-controller"))
    wait(browser, lambda: "my-rewind" in [o.get_attribute("value") for o in picker.options])
    values = [o.get_attribute("value") for o in picker.options]
    assert "others-rewind" not in values and "json" in values
    wasm = tmp_path / "rewind.wasm"
    wasm.write_bytes(build_rewind(tmp_path))
    find(browser, "#pg-upload").send_keys(str(wasm))
    wait(browser, lambda: "uploaded rewind.wasm" in find(browser, "#pg-summary").text, RUN_S)
    module = Select(find(browser, "#pg-controller")).first_selected_option
    assert "Uploads of web" in module.find_element(By.XPATH, "..").get_attribute("label")
    try:
        run_controller(browser, module.get_attribute("value"), arg="Once upon a time", prompt="Go on.", max_tokens=12)
    except TimeoutException:
        shot(browser, tmp_path, "playground-upload-timeout")
        raise
    assert len(finds(browser, "#pg-columns .chip.taken-back")) == 2 and finds(browser, "#pg-columns .chip.forced")
    shot(browser, tmp_path, "playground-upload")
