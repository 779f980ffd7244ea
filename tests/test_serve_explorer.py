"""The cache explorer page in a real browser: headless Debian chromium driven by Playwright's Python API,
opened on a live `kvlab serve` (with an API key, passed as /#key=...) with cached prefixes and requests
in flight. The screenshot is kept at bench/out/explorer.png (the path is printed)."""

from __future__ import annotations

import shutil
import threading

import httpx
import pytest

from serve_helpers import ROOT, ServerProcess

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--no-first-run", "--disable-component-update", "--disable-sync"]
PROLOGUE = ("Two households, both alike in dignity, in fair Verona, where we lay our scene, from ancient "
            "grudge break to new mutiny, where civil blood makes civil hands unclean. ")

KEY = "explorer-key"
AUTH = {"Authorization": f"Bearer {KEY}"}

pytestmark = pytest.mark.skipif(shutil.which(CHROMIUM) is None,
                                reason=f"{CHROMIUM} is missing (apt-get install chromium; .ci/run does it)")


def test_explorer_renders_the_pool_the_tree_and_running_requests(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    # 256 blocks hold everything below (no eviction); one sequence at a time keeps requests in flight longer
    # with an API key: the page must pass it on from its #key= fragment
    server = ServerProcess("--num-blocks", "256", "--max-num-seqs", "1", log_dir=tmp_path,
                           env={"KVLAB_API_KEY": KEY})
    streams: list[threading.Thread] = []
    stop = threading.Event()
    try:
        # two prompts that share the prologue and then diverge: a fork in the prefix tree
        for ending in ("But soft, what light through yonder window breaks? It is the east, and Juliet is the "
                       "sun. Arise, fair sun, and kill the envious moon.",
                       "O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name, or if "
                       "thou wilt not, be but sworn my love."):
            r = server.post("/v1/completions", {"prompt": PROLOGUE + ending, "max_tokens": 20, "temperature": 0},
                            headers=AUTH)
            assert r.status_code == 200, r.text
        cached = {b["hash"] for b in server.cache_state(headers=AUTH)["blocks"] if b["hash"]}
        assert len(cached) >= 5

        def long_stream(i: int) -> None:
            body = {"prompt": PROLOGUE + f"Enter chorus {i}.", "max_tokens": 180, "stream": True,
                    "temperature": 0, "ignore_eos": True}
            try:
                with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120,
                                  headers=AUTH) as r:
                    for _ in r.iter_lines():
                        if stop.is_set():
                            return   # hang up: the server aborts the request
            except httpx.HTTPError:
                return   # the server was stopped under a waiting request

        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                keyless = browser.new_page()
                keyless.goto(server.url + "/")
                keyless.wait_for_selector("#status.err", timeout=30_000)
                assert "401" in keyless.locator("#status").inner_text()
                keyless.close()
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                page.goto(f"{server.url}/#key={KEY}")   # polling before the load starts: it sees requests run
                page.wait_for_function("Number(document.body.dataset.refreshes || 0) >= 1", timeout=30_000)
                streams.extend(threading.Thread(target=long_stream, args=(i,), daemon=True) for i in range(10))
                for t in streams:
                    t.start()
                # the page's own refresh(), called until it has drawn a few times with requests in flight:
                # waiting for its 1 s poll raced the load (ten 180-token streams can finish within 3 polls)
                seen = [0, 0, 0]
                while not (seen[0] >= 4 and seen[1] >= 2 and seen[2] >= 1):
                    assert any(t.is_alive() for t in streams), f"the load ended before the page showed it: {seen}"
                    seen = page.evaluate("async () => { await refresh(); return ["
                                         "Number(document.body.dataset.refreshes || 0), "
                                         "document.querySelectorAll('#requests tr.request').length, "
                                         "document.querySelectorAll('#pool .block.used').length]; }")
                assert page.locator("#pool .block").count() == 256
                assert page.locator("#pool .block.cached").count() >= 1
                shown = set(page.locator("#tree .node").evaluate_all("nodes => nodes.map(n => n.dataset.hash)"))
                assert cached <= shown                                         # every cached block is drawn
                assert page.locator("#tree .node.fork").count() >= 1          # the shared prologue branches
                assert "Two households" in page.locator("#tree").inner_text()
                assert "payload" in page.locator("#bytes").inner_text()
                assert page.locator("#status.ok").count() == 1
                out = ROOT / "bench" / "out"
                out.mkdir(parents=True, exist_ok=True)
                shot = out / "explorer.png"
                page.screenshot(path=str(shot), full_page=True)
                assert shot.stat().st_size > 10_000
                print(f"explorer screenshot: {shot}")
            finally:
                browser.close()
    finally:
        stop.set()
        server.stop()
        for t in streams:
            t.join(10)
