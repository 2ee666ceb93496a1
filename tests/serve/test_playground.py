"""The playground page end to end in headless Chromium (Debian's `chromium`, driven by Playwright).

A user opens the page, types a prompt, moves the temperature slider, sets top-k, generates, and
watches the text stream in and the chart redraw. The oracles are the library on the same run:
the chart's probabilities are `tinylm.generate.sampling`'s distribution at the page's settings
for the text before the cursor, and the streamed text is `generate` with the page's seed.

This test needs a Chromium binary. Playwright's own browser download is not used (it needs its
CDN); the system's ``chromium`` is driven through ``executable_path``. Without it the test fails
with the command that installs it: a missing browser must not pass as a skipped test.
"""

from __future__ import annotations

import io
import shutil

import httpx
import pytest
from PIL import Image
from servekit import ThreadServer

from tinylm.generate import SamplingParams, generate
from tinylm.generate.inspect import attention_maps, drawable_logits
from tinylm.generate.sampling import sampling_distribution

INSTALL = "install Chromium with `apt-get install -y chromium` (Debian/Ubuntu) so that `chromium` is on PATH"


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.fail(f"the playground test needs a Chromium browser: {INSTALL}", pytrace=False)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the playground test needs Playwright: pip install -e '.[test]'", pytrace=False)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        yield browser
        browser.close()


def chart(page) -> list[tuple[int, float, bool]]:
    """The bars on the page: (token id, probability, dropped by a filter)."""
    return page.eval_on_selector_all("#chart .bar-row", "rows => rows.map(r => [Number(r.dataset.tokenId), "
                                     "Number(r.dataset.probability), r.classList.contains('dropped')])")


def expected_chart(run, text: str, ids: list[int], **settings) -> list[float]:
    """The library's sampling distribution after ``text`` at the page's settings, for the charted ``ids`` (over the
    ids a sample may take: padding and BOS are never drawn, so they are never charted)."""
    logits = drawable_logits(run.model, run.tokenizer, run.start_ids + run.tokenizer.encode(text))
    probs = sampling_distribution(logits[None], SamplingParams(**settings))[0]  # (V,)
    return [float(probs[i]) for i in ids]


def wait_for_caption(page, text: str) -> None:
    """Until the chart is the one for ``text`` (its caption quotes the text's end, up to the closing quote)."""
    page.wait_for_function("end => document.querySelector('#chart-caption').textContent.includes(end + '\u201d')",
                           arg=text[-30:])


def wait_for_chart(page, temperature: str) -> None:
    page.wait_for_function(f"document.querySelector('#chart').dataset.temperature === '{temperature}' "
                           "&& document.querySelectorAll('#chart .bar-row').length > 0")


def test_the_playground_streams_text_and_charts_the_next_token(browser, server, run, run_dir, tmp_path):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.base_url + "/")
    page.wait_for_function(f"document.querySelector('#model-name').textContent.startsWith('{run_dir.name}')")

    # type a prompt; the chart shows the distribution at the cursor (the end of the text)
    prompt = "To be, or not"
    page.fill("#prompt", "")
    page.type("#prompt", prompt)
    wait_for_caption(page, prompt)
    wait_for_chart(page, "0.8")
    ids = [i for i, _, _ in chart(page)]
    assert len(ids) == 12
    shown = [p for _, p, _ in chart(page)]
    assert shown == pytest.approx(expected_chart(run, prompt, ids, temperature=0.8), abs=1e-5)

    # move the temperature slider: 0.8 -> 1.3 in ten steps of 0.05; the chart redraws at once
    page.focus("#temperature")
    for _ in range(10):
        page.keyboard.press("ArrowRight")
    assert page.text_content("#temperature-value") == "1.3"
    wait_for_chart(page, "1.3")
    hotter = [p for _, p, _ in chart(page)]
    assert hotter == pytest.approx(expected_chart(run, prompt, ids, temperature=1.3), abs=1e-5)
    assert hotter[0] < shown[0]  # a higher temperature flattens the distribution

    # top-k 3: the other tokens are struck out with probability 0, the three share the mass
    page.fill("#top-k", "3")
    page.wait_for_function("document.querySelectorAll('#chart .bar-row.dropped').length === 9")
    bars = chart(page)
    assert [dropped for _, _, dropped in bars] == [False] * 3 + [True] * 9
    assert [p for _, p, _ in bars] == pytest.approx(
        expected_chart(run, prompt, ids, temperature=1.3, top_k=3), abs=1e-5)

    # generate with a seed: the text streams into the box; it is the library's sample with these settings
    page.fill("#seed", "3")
    page.fill("#max-tokens", "20")
    page.click("#generate")
    page.wait_for_selector("#status[data-state='done']", timeout=30_000)
    text = page.input_value("#prompt")
    [expected] = generate(run.model, run.tokenizer, prompt,
                          SamplingParams(temperature=1.3, top_k=3, seed=3, max_new_tokens=20), start_ids=run.start_ids)
    # a textarea's value holds line breaks as "\n" (HTML normalizes "\r\n" and "\r"), whatever the model wrote
    written = expected.text.replace("\r\n", "\n").replace("\r", "\n")
    assert text == prompt + written and len(expected.text) > 0

    # after the completion the chart follows the cursor to the end of the new text
    wait_for_caption(page, text)
    wait_for_chart(page, "1.3")
    ids = [i for i, _, _ in chart(page)]
    assert [p for _, p, _ in chart(page)] == pytest.approx(
        expected_chart(run, text, ids, temperature=1.3, top_k=3), abs=1e-5)

    shot = tmp_path / "playground.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    assert errors == []
    page.close()


def test_the_page_and_its_script_are_served_from_the_package(server):
    page = httpx.get(server.base_url + "/")
    script = httpx.get(server.base_url + "/static/playground.js")
    assert page.status_code == script.status_code == 200
    assert '<script src="/static/playground.js">' in page.text and "samplingDistribution" in script.text
    assert httpx.get(server.base_url + "/static/inside.js").status_code == 200 and "/static/inside.js" in page.text
    assert '<link rel="icon" href="data:' in page.text  # inline: browsers ask for no /favicon.ico (a 404)
    assert script.headers["content-type"].startswith(("application/javascript", "text/javascript"))


def assert_refused(page, box: str, value: str, phrase: str, prompt_before: str) -> None:
    """Generating with ``value`` in ``box`` is refused: the status says ``phrase``, the box is marked invalid,
    and the prompt is left as it was (no request went out)."""
    page.fill(box, value)
    page.click("#generate")
    page.wait_for_selector("#status[data-state='error']")
    assert phrase in page.text_content("#status")
    assert page.get_attribute(box, "aria-invalid") == "true" and page.input_value("#prompt") == prompt_before


def test_the_page_recovers_from_a_wrong_key_and_checks_max_tokens(browser, run):
    """Opened without the key the server asks for, the page shows the 401; once the key is entered, the model loads
    and the old error goes. A max-tokens box of 0 is refused with a message (not silently made 64). No request
    of the page gets a 404 (the icon is inline)."""
    with ThreadServer(run, api_key="s3cret") as served:
        page = browser.new_page()
        missing: list[str] = []
        page.on("response", lambda r: missing.append(r.url) if r.status == 404 else None)
        page.goto(served.base_url + "/")
        page.wait_for_selector("#status[data-state='error']")
        assert "API key" in page.text_content("#status")
        page.click("details summary")
        page.fill("#api-key", "s3cret")
        page.press("#api-key", "Tab")  # the key is taken when the box changes
        page.wait_for_function("document.querySelector('#model-name').textContent.startsWith('tiny-run')")
        page.wait_for_function("document.querySelector('#chart .bar-row')")
        assert page.get_attribute("#status", "data-state") != "error" and page.text_content("#status") == ""

        before = page.input_value("#prompt")
        assert_refused(page, "#max-tokens", "0", "max tokens", before)
        page.fill("#max-tokens", "2")
        page.wait_for_function("document.querySelector('#status').dataset.state !== 'error'")
        assert_refused(page, "#seed", "1.5", "seed must be a whole number", before)  # not silently seed 1
        page.fill("#seed", "")
        page.click("#generate")
        page.wait_for_selector("#status[data-state='done']", timeout=30_000)
        assert page.input_value("#prompt") != before
        page.close()
    assert missing == []


def test_the_chart_says_when_the_server_cannot_be_reached(browser, run):
    """A chart request that fails in the network (the server has stopped) is an error on the status line, not an
    unhandled promise rejection."""
    served = ThreadServer(run)
    page = browser.new_page()
    rejections: list[str] = []
    page.on("pageerror", lambda e: rejections.append(str(e)))
    page.goto(served.base_url + "/")
    page.wait_for_function("document.querySelector('#chart .bar-row')")
    served.close()
    page.type("#prompt", "x")  # the cursor moves: the chart asks the server again
    page.wait_for_selector("#status[data-state='error']", timeout=10_000)
    assert "cannot reach the server" in page.text_content("#status")
    assert rejections == []
    page.close()


def heatmap_colour(weight: float) -> tuple[int, int, int]:
    """inside.js's cellColour: pale blue at 0 to deep blue at 1, by the square root of the weight."""
    a = min(max(weight, 0.0), 1.0) ** 0.5
    return tuple(round(f + (t - f) * a) for f, t in zip((226, 234, 250), (14, 48, 140)))


def piece_label(data: bytes) -> str:
    """A piece as the page writes it: its text, or its bytes (\\xc3) when they are only part of a character."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "".join(f"\\x{b:02x}" for b in data)


def test_the_inside_view_shows_the_tokens_and_draws_the_attention_heatmap(browser, server, run, run_dir):
    """Open the inside view on a typed text: the pieces are `Tokenizer.pieces`'s, and the heatmap's cells are the
    colours of `attention_maps`'s weights for the chosen layer and head below the diagonal, the background above
    it. Every request the page makes goes to the server (it works offline)."""
    page = browser.new_page(viewport={"width": 1280, "height": 1400})
    errors: list[str] = []
    elsewhere: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: None if r.url.startswith((server.base_url, "data:")) else elsewhere.append(r.url))
    page.goto(server.base_url + "/")
    page.wait_for_function(f"document.querySelector('#model-name').textContent.startsWith('{run_dir.name}')")
    text = "Naïve café, to be"
    page.fill("#prompt", "")
    page.type("#prompt", text)
    page.click("#inside-toggle")

    pieces = run.tokenizer.pieces(text)
    ids = run.start_ids + [i for i, _ in pieces]
    page.wait_for_function(f"document.querySelectorAll('#pieces .piece').length === {len(pieces)} "
                           f"&& document.querySelector('#heatmap').dataset.tokens === '{len(ids)}'")
    shown = page.eval_on_selector_all("#pieces .piece", "ps => ps.map(p => [Number(p.dataset.tokenId), "
                                      "p.querySelector('.piece-text').textContent, "
                                      "p.querySelector('.piece-id').textContent])")
    assert [(i, int(label)) for i, _, label in shown] == [(i, i) for i, _ in pieces]
    assert [t for _, t, _ in shown] == [piece_label(data) for _, data in pieces]
    assert any("\\x" in t for _, t, _ in shown)  # the text has pieces that are part of a character: shown as bytes
    assert len({p.get_attribute("style") for p in page.query_selector_all("#pieces .piece")[:2]}) == 2  # coloured apart

    page.select_option("#inside-layer", "1")
    page.select_option("#inside-head", "2")
    page.wait_for_function("document.querySelector('#heatmap-caption').textContent.startsWith('layer 1, head 2')")
    weights = attention_maps(run.model, ids)[1][2]  # (T, T)
    cell = int(page.get_attribute("#heatmap", "data-cell"))
    image = Image.open(io.BytesIO(page.locator("#heatmap").screenshot())).convert("RGB")
    T = len(ids)
    border = (image.width - cell * T) // 2  # the element's screenshot includes its CSS border
    for i in range(T):
        for j in range(T):
            pixel = image.getpixel((border + j * cell + cell // 2, border + i * cell + cell // 2))
            if j > i:
                assert pixel == (255, 255, 255), (i, j)  # masked: nothing drawn
            else:
                assert pixel != (255, 255, 255), (i, j)
                expected = heatmap_colour(float(weights[i, j]))
                assert max(abs(a - b) for a, b in zip(pixel, expected)) <= 2, (i, j, pixel, expected)
    assert errors == [] and elsewhere == []
    page.close()


def test_the_api_docs_render_offline_from_the_package(browser, server):
    """/docs draws the API with Swagger UI's files served by tinylm itself: with every request off this server
    refused (no internet), the page still lists the endpoints and throws nothing."""
    page = browser.new_page()
    local = server.base_url.rstrip("/")
    outside: list[str] = []
    errors: list[str] = []

    def route(r) -> None:
        if r.request.url.startswith(local):
            r.continue_()
        else:
            outside.append(r.request.url)
            r.abort()

    page.route("**/*", route)
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(local + "/docs")
        page.wait_for_selector(".opblock-summary-path", timeout=30_000)
        paths = {p.strip().replace("\u200b", "") for p in page.locator(".opblock-summary-path").all_inner_texts()}
    finally:
        page.close()
    assert {"/v1/completions", "/v1/chat/completions"} <= paths, paths
    assert errors == [] and outside == [], (errors, outside)
