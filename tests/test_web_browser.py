"""The `llamem serve` page in headless Chromium (Debian's /usr/bin/chromium, driven by Playwright).

Never skipped: without chromium or playwright these tests fail, and `make test` installs both.
The screenshots land in docs/screenshots/ (the README links them)."""

from __future__ import annotations

import io
import json
import re
import threading
from pathlib import Path

import pytest
from playwright.sync_api import expect, sync_playwright

from llamem.web.server import make_server

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]
SCREENSHOTS = Path(__file__).resolve().parent.parent / "docs" / "screenshots"
TIMEOUT_MS = 30_000
expect.set_options(timeout=TIMEOUT_MS)  # a first 8B plan takes seconds on a laptop CPU
# A model too large for a T4 that still plans in a fraction of a second: the debug preset, widened.
TOO_BIG = "model=debug&task=infer&gpu=t4&exact=true&no-truncation=true&override=vocab_size%3D4000000&" \
          "override=hidden_size%3D2048"


@pytest.fixture(scope="module")
def base_url():
    srv = make_server("127.0.0.1", 0, log=io.StringIO())
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/"
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    page = browser.new_page(viewport={"width": 1366, "height": 768})
    page.set_default_timeout(TIMEOUT_MS)
    errors = []
    page.on("pageerror", lambda error: errors.append(error))
    yield page
    page.close()
    assert not errors, errors


def bar_total(page, phase: str) -> str:
    return page.locator(f"#phases svg text:has-text('{phase}') tspan.row-value").first.text_content()


def test_the_page_loads_with_the_charts_and_the_tables(page, base_url):
    page.goto(base_url + "?model=llama-3.2-1b&task=lora&batch=4&gpu=rtx-4090")
    expect(page.locator("#fits table tbody tr")).not_to_have_count(0)
    expect(page.locator("#phases g.bar")).to_have_count(5)  # load, forward, backward, optimizer, on the card
    expect(page.locator("#plan svg.chart")).to_be_visible()
    expect(page.locator("#summary .tile").first).to_contain_text("GiB")
    expect(page.locator("#commands pre").first).to_have_text(
        "llamem estimate llama-3.2-1b --task lora --batch 4 --seq 2048 --gpus 1")
    assert page.locator("#message").is_hidden()
    page.click("#bundle-button")  # the --emit files, answered in memory
    expect(page.locator("#bundle .tabs button", has_text="train.py")).to_have_count(1)
    expect(page.locator("#bundle pre")).to_contain_text("# llama-3.2-1b")


def test_changing_the_batch_updates_the_chart_and_the_link(page, base_url):
    page.goto(base_url + "?model=llama-3.2-1b&task=lora&batch=4&gpu=rtx-4090")
    expect(page.locator("#phases g.bar")).to_have_count(5)
    before = bar_total(page, "forward")
    page.fill("#batch", "8")
    expect(page.locator("#phases svg text:has-text('forward') tspan.row-value").first).not_to_have_text(before)
    after = float(bar_total(page, "forward").split()[0])
    assert after > float(before.split()[0])
    assert "batch=8" in page.url
    expect(page.locator("#commands pre").first).to_contain_text("--batch 8")


def test_a_workload_that_does_not_fit_shows_the_shortfall_and_the_closest_plan(page, base_url):
    page.goto(base_url + "?" + TOO_BIG)
    expect(page.locator("#plan-title")).to_contain_text("Does not fit 1 × t4: the closest plan is")
    expect(page.locator("#summary")).to_contain_text("closest plan")
    expect(page.locator("#summary")).to_contain_text("shortfall")
    expect(page.locator("#plan svg rect.step.short")).to_have_count(1)
    shortfall = re.search(r"closest plan is ([\d.]+) GiB short", page.locator("#plan-title").text_content())[1]
    assert float(shortfall) > 0
    expect(page.locator("#commands")).to_contain_text("The closest configuration")


def test_a_negative_batch_and_a_malformed_config_show_a_clear_message(page, base_url):
    page.goto(base_url + "?model=debug&gpu=t4")
    expect(page.locator("#phases g.bar")).to_have_count(5)
    page.fill("#batch", "-1")
    expect(page.locator("#message")).to_contain_text("--batch must be an integer from 1 to 65,536, got -1")
    page.fill("#batch", "2")
    expect(page.locator("#message")).to_be_hidden()
    page.set_input_files("#upload", files=[{"name": "config.json", "mimeType": "application/json",
                                            "buffer": b'{"hidden_size": 64,'}])
    expect(page.locator("#message")).to_contain_text("config.json: not valid JSON")
    bad = {"model_type": "llama", "hidden_size": "big", "num_hidden_layers": 2}
    page.set_input_files("#upload", files=[{"name": "config.json", "mimeType": "application/json",
                                            "buffer": json.dumps(bad).encode()}])
    expect(page.locator("#message")).to_contain_text("hidden_size")


def test_an_uploaded_config_is_sized(page, base_url):
    from llamem.presets import PRESETS

    page.goto(base_url + "?model=llama-3.2-1b&gpu=t4")
    expect(page.locator("#phases g.bar")).to_have_count(5)
    page.set_input_files("#upload", files=[{"name": "config.json", "mimeType": "application/json",
                                            "buffer": json.dumps(PRESETS["debug"][2]).encode()}])
    expect(page.locator("#commands pre").first).to_contain_text("llamem estimate --config config.json")
    expect(page.locator("#message")).to_contain_text("Using the uploaded config.json")


@pytest.mark.parametrize("width, height, name", [(1366, 768, "serve-desktop"), (390, 844, "serve-phone")])
def test_screenshots(browser, base_url, width, height, name):
    page = browser.new_page(viewport={"width": width, "height": height})
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(base_url + "?model=llama-3.1-8b&task=lora&batch=4&seq=2048&gpu=rtx-4090&gpus=1")
    expect(page.locator("#fits table tbody tr")).not_to_have_count(0)
    expect(page.locator("#plan svg.chart")).to_be_visible()
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=width > 1000)
    page.locator("#results").scroll_into_view_if_needed()
    if width < 1000:
        page.locator("#summary").scroll_into_view_if_needed()
        page.screenshot(path=str(SCREENSHOTS / f"{name}-results.png"))
    page.close()
    assert (SCREENSHOTS / f"{name}.png").stat().st_size > 10_000
