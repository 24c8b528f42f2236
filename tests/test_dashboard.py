"""The dashboard in a real headless browser: Debian's Chromium (installed by `make setup` when
missing) driven by Playwright. The page loads without console errors; its tiles, charts and table
hold what /stats reports; a row opens its timing record; the KV warning appears when the pool is
nearly full; it fits a phone's width and follows dark mode. Under CI=true a missing browser fails
the test instead of skipping it."""

from __future__ import annotations

import os
import shutil

import pytest

from server_utils import Gate, LiveServer, tiny_engine
from shoal.config import SpeculativeConfig
from shoal.server import ServerSettings

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# What the machine's closed network needs: no background connections, no first-run work.
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        if os.environ.get("CI") == "true":
            pytest.fail("Chromium is missing: `make setup` installs Debian's chromium package")
        pytest.skip("Chromium is not installed (`make setup` installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        yield b
        b.close()


def open_page(browser, url, errors, **context):
    page = browser.new_context(**context).new_page()
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url + "/")  # the root links (redirects) to the dashboard
    assert page.url.endswith("/dashboard")
    return page


def test_the_page_shows_what_stats_reports(browser, tiny_llama_path, tmp_path):
    # 32 blocks and a second tier: the asks below evict blocks into it, and the last one restores them
    engine = tiny_engine(tiny_llama_path, max_model_len=256, num_blocks=32, prefix_cache_dir=str(tmp_path / "tier"),
                         prefix_cache_restore="always", speculative=SpeculativeConfig(method="ngram"))
    with LiveServer(engine, ServerSettings(log_requests=False, api_key="k")) as srv:
        client = srv.openai(api_key="k")
        ask = [{"role": "user", "content": "A question asked twice, so the second comes from the cache."}]
        other = [{"role": "user", "content": "Something else entirely, long enough to need the blocks. " * 5}]
        for messages, max_tokens in ((ask, 3), (other, 5), (ask, 4)):
            client.chat.completions.create(model=srv.state.model_name, messages=messages, max_tokens=max_tokens, temperature=0.0,
                                           extra_body={"ignore_eos": True})
        with srv.http() as h:
            stats = h.get("/stats", headers={"x-api-key": "k"}).json()
        errors: list[str] = []
        page = open_page(browser, srv.url, errors)
        page.fill("#key", "k")
        page.dispatch_event("#key", "change")
        page.wait_for_function("document.querySelectorAll('#requests tbody tr').length === 3", timeout=15000)
        recent = stats["recent_requests"]
        assert page.inner_text("#tile-requests") == str(stats["total_requests"])
        assert page.inner_text("#tile-generated") == str(stats["tokens_generated"])
        assert page.inner_text("#tile-cached") == str(stats["cached_prompt_tokens"])
        rows = page.eval_on_selector_all("#requests tbody tr", "rs => rs.map(r => r.dataset.id)")
        assert rows == [r["request_id"] for r in recent]  # newest first
        ttft = page.eval_on_selector_all("#chart-ttft rect.bar", "rs => rs.map(r => [r.dataset.label, Number(r.dataset.value)])")
        assert ttft == [[r["request_id"], pytest.approx(r["time_to_first_token"])] for r in reversed(recent)]
        cached = page.eval_on_selector_all("#chart-cache rect.bar", "rs => rs.map(r => Number(r.dataset.value))")
        assert cached == [v for r in reversed(recent) for v in (r["cached_prompt_tokens"], r["computed_prompt_tokens"])]
        assert sum(r["cached_prompt_tokens"] for r in recent) > 0  # the repeated prompt hit the cache
        assert page.is_hidden("#warning")
        tier = stats["prefix_cache_tier"]
        assert tier["spilled_blocks"] > 0 and tier["restored_blocks"] > 0  # the other prompt evicted the first; it came back
        shown = page.eval_on_selector_all("#chart-tier rect.bar", "rs => rs.map(r => [r.dataset.label, Number(r.dataset.value)])")
        assert shown == [["restored", tier["restored_blocks"]], ["spilled", tier["spilled_blocks"]],
                         ["evicted", tier["evictions"]], ["rejected", tier["rejected_entries"]]]
        assert "on disk" in page.inner_text("#tier-text")
        spec = stats["speculative"]
        shown = page.eval_on_selector_all("#chart-spec rect.bar", "rs => rs.map(r => [r.dataset.label, Number(r.dataset.value)])")
        assert shown == [["drafted", spec["drafted_tokens"]], ["accepted", spec["accepted_tokens"]]]
        assert page.inner_text("#spec-text").startswith(f"ngram proposer: {spec['drafts']} drafts")
        # The table is drawn again on every poll: an event sent to the row, not a click at coordinates that a
        # redraw under load can move, then the panel's text once the handler has run.
        page.dispatch_event(f"#requests tbody tr[data-id='{recent[-1]['request_id']}']", "click")
        page.wait_for_selector("#detail:not([hidden])", timeout=15000)
        detail = page.inner_text("#detail")
        assert recent[-1]["request_id"] in detail and "time_to_first_token" in detail
        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        assert (tmp_path / "dashboard.png").stat().st_size > 0
        assert errors == []


def test_kv_warning_phone_width_and_dark_mode(browser, tiny_llama_path, tmp_path):
    # 10 blocks of 8 tokens: one 70-token prompt holds 9 of them (90%) while it runs
    engine = tiny_engine(tiny_llama_path, max_model_len=80, num_blocks=10, block_size=8, enable_prefix_cache=False)
    with LiveServer(engine, ServerSettings(log_requests=False)) as srv, Gate(engine, after_steps=1) as gate:
        import threading

        prompt = list(range(5, 75))
        t = threading.Thread(target=lambda: srv.openai().completions.create(model=srv.state.model_name, prompt=prompt, max_tokens=5,
                                                                           extra_body={"ignore_eos": True}))
        t.start()
        assert gate.blocked.wait(30)
        errors: list[str] = []
        page = open_page(browser, srv.url, errors, viewport={"width": 375, "height": 800}, color_scheme="dark")
        page.wait_for_selector("#warning:not([hidden])", timeout=15000)
        assert "KV cache 90% full" in page.inner_text("#warning")
        assert page.is_hidden("#tier")  # no second tier configured: no figure for one
        assert page.is_hidden("#spec")  # speculative decoding off (auto, on sdpa attention): none for it
        assert page.is_hidden("#models") and page.is_hidden("#model-select")  # one model: no list of models
        assert page.evaluate("document.documentElement.scrollWidth") <= 375  # no sideways scrolling on a phone
        background = page.evaluate("getComputedStyle(document.body).backgroundColor")
        assert sum(int(c) for c in background[background.index("(") + 1 : -1].split(",")[:3]) < 150  # dark
        page.screenshot(path=str(tmp_path / "dashboard-phone-dark.png"), full_page=True)
        gate.open()
        t.join(30)
        page.wait_for_selector("#warning[hidden]", state="attached", timeout=15000)
        assert errors == []


def test_several_models_are_listed_and_the_charts_follow_the_one_picked(browser, tiny_llama_path, tmp_path):
    from tiny_models import make_tiny_model

    from server_utils import tiny_engine_config
    from shoal.server.models import Lifecycle, ModelSpec

    from test_server_vision import PNG, data_uri
    from tiny_models import make_tiny_vl_model

    coder = make_tiny_model("qwen2", tmp_path / "coder", seed=1)
    eyes = make_tiny_vl_model("qwen2_vl", tmp_path / "eyes")
    specs = [ModelSpec("chat", tiny_engine_config(tiny_llama_path)), ModelSpec("coder", tiny_engine_config(coder)),
             ModelSpec("idle", tiny_engine_config(coder)), ModelSpec("eyes", tiny_engine_config(eyes, max_model_len=256))]
    with LiveServer(specs, lifecycle=Lifecycle(preload="none")) as srv:
        client = srv.openai()
        client.completions.create(model="chat", prompt="one", max_tokens=3, extra_body={"ignore_eos": True})
        client.completions.create(model="coder", prompt="two", max_tokens=7, extra_body={"ignore_eos": True})
        for _ in range(2):  # a vision model: the same image twice, encoded once
            client.chat.completions.create(model="eyes", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_uri(PNG)}}, {"type": "text", "text": "and?"}]}])
        errors: list[str] = []
        page = open_page(browser, srv.url, errors)
        page.wait_for_function("document.querySelectorAll('#models-table tbody tr').length === 4", timeout=15000)
        rows = page.eval_on_selector_all("#models-table tbody tr", "rs => rs.map(r => [...r.cells].slice(0, 2).map(c => c.innerText))")
        assert rows == [["chat", "loaded"], ["coder", "loaded"], ["idle", "unloaded"], ["eyes", "loaded"]]
        assert page.inner_text("#tile-generated") == "3"  # the default model's, at first
        assert page.is_hidden("#vision")  # a text model has no image panel
        page.select_option("#model-select", "coder")
        page.wait_for_function("document.getElementById('tile-generated').innerText === '7'", timeout=15000)
        assert page.inner_text("#model") == "coder"
        page.select_option("#model-select", "eyes")
        page.wait_for_selector("#vision:not([hidden])", timeout=15000)
        vision = srv.state.models.find("eyes").engine.snapshot.vision
        shown = page.eval_on_selector_all("#chart-vision rect.bar", "rs => rs.map(r => [r.dataset.label, Number(r.dataset.value)])")
        assert shown == [["encoded", 1], ["cache hits", vision["cache_hits"]]] and vision["images_encoded"] == 1
        assert page.inner_text("#vision-text").startswith("2 images in requests")
        assert errors == []
