"""The web console in a real browser (Debian's Chromium driven by Playwright) against a real
`modelyard serve`: sign in, a streamed chat in the playground, keys created and revoked, a batch
uploaded and completed, the usage chart; screenshots at 1280 px and 375 px are kept as artifacts
(under the pytest tmp dir, and in `MODELYARD_SCREENSHOT_DIR` when it is set)."""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.platform_harness import (
    PlatformProcess,
    batch_line,
    create_key,
    create_tenant,
    deploy,
    jsonl,
    wait_status,
)
from tests.tiny_encoders import build_embedding_model
from tests.tiny_models import build_model

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WIDE = {"width": 1280, "height": 860}
PHONE = {"width": 375, "height": 812}


def _require_browser() -> None:
    """Skip (saying why) without Chromium or Playwright; under CI that is a failure instead."""
    missing = None
    if not CHROMIUM.exists():
        missing = f"{CHROMIUM} is missing (apt-get install chromium; `make test` does it as root)"
    elif not _has_playwright():
        missing = "the playwright package is missing (pip install -e '.[test]')"
    if missing is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"browser tests cannot run under CI: {missing}")
    print(f"skipping the console browser tests: {missing}")
    pytest.skip(missing)


def _has_playwright() -> bool:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return False
    return True


class Shots:
    """Screenshots as test artifacts: always under the tmp dir, also in MODELYARD_SCREENSHOT_DIR."""

    def __init__(self, folder: Path) -> None:
        self.folders = [folder]
        extra = os.environ.get("MODELYARD_SCREENSHOT_DIR")
        if extra:
            self.folders.append(Path(extra))
        for f in self.folders:
            f.mkdir(parents=True, exist_ok=True)

    def take(self, page: Any, name: str) -> Path:
        png = page.screenshot(full_page=False)
        for f in self.folders:
            (f / f"{name}.png").write_bytes(png)
        print(f"screenshot {name}: {[str(f / (name + '.png')) for f in self.folders]}")
        return self.folders[0] / f"{name}.png"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _require_browser()
    root = tmp_path_factory.mktemp("console-models")
    build_model(root / "tiny", "llama")
    build_embedding_model(root / "tiny-embed")
    return root


@pytest.fixture(scope="module")
def platform(
    tmp_path_factory: pytest.TempPathFactory, cache_dir: Path, models: Path
) -> Iterator[PlatformProcess]:
    env = {
        "MODELYARD_BATCH_POLL_INTERVAL_S": "0.2",
        # The cache folder too: the README's screenshot deploys SmolLM2 from there.
        "MODELYARD_LOCAL_ARTIFACT_ROOTS": json.dumps([str(models), str(cache_dir)]),
        "MODELYARD_PRICES": json.dumps({"tiny": {"input": 1.0, "output": 2.0}}),
        "MODELYARD_WORKER_ENGINE": json.dumps({"kv_cache_memory": "64MiB", "dtype": "float32"}),
    }
    p = PlatformProcess(tmp_path_factory.mktemp("console-data"), env).start()
    try:
        # The playground shows a chat model's defaults; the Embeddings page lists only embedders.
        embed = deploy(p.api(), "tiny-embed", str(models / "tiny-embed"), wait=False, public=True)
        deploy(p.api(), "tiny", str(models / "tiny"), public=True,
               sampling_defaults={"temperature": 0.2})  # fmt: skip
        wait_status(p.api(), embed, "ready")
        yield p
    finally:
        p.stop()


@pytest.fixture(scope="module")
def tenant_key(platform: PlatformProcess) -> str:
    admin = platform.api()
    tenant_id = create_tenant(admin, "console-tenant")
    return str(create_key(admin, tenant_id, scopes=["admin", "inference"])["key"])


@pytest.fixture(scope="module")
def browser(platform: PlatformProcess) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture()
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport=WIDE)
    p = context.new_page()
    p.set_default_timeout(30_000)
    problems: list[str] = []
    # A CSP violation or a script error fails the test: the console must work under its policy.
    p.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    p.on(
        "console",
        lambda msg: (
            problems.append(f"console {msg.type}: {msg.text}")
            if msg.type == "error" and "Content Security Policy" in msg.text
            else None
        ),
    )
    p.problems = problems
    try:
        yield p
    finally:
        context.close()
    assert not problems, problems


@pytest.fixture()
def shots(tmp_path_factory: pytest.TempPathFactory) -> Shots:
    return Shots(tmp_path_factory.getbasetemp() / "console-screenshots")


def throttle(page: Any, bytes_per_s: int) -> Any:
    """Slow the page's downloads (-1: no limit), so that a stream is visibly mid-way."""
    cdp = page.context.new_cdp_session(page)
    cdp.send(
        "Network.emulateNetworkConditions",
        {"offline": False, "latency": 0, "downloadThroughput": bytes_per_s, "uploadThroughput": -1},
    )
    return cdp


def sign_in(page: Any, url: str, key: str) -> None:
    page.goto(url + "/")
    page.get_by_label("API key", exact=True).fill(key)
    page.get_by_role("button", name="Sign in").click()
    page.locator("#shell").wait_for(state="visible")
    page.locator("#signin").wait_for(state="hidden")


def test_console_is_served_with_a_strict_policy_and_docs_keep_schemas(
    platform: PlatformProcess,
) -> None:
    r = httpx.get(platform.url + "/")
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert "unsafe-inline" not in csp
    again = httpx.get(platform.url + "/", headers={"if-none-match": r.headers["etag"]})
    assert again.status_code == 304
    js = httpx.get(platform.url + "/console/app.js")
    assert js.headers["content-type"].startswith("text/javascript")
    assert httpx.get(platform.url + "/console/..%2Fapp.py").status_code == 404
    spec = httpx.get(platform.url + "/openapi.json").json()
    assert "/" not in spec["paths"] and not any(p.startswith("/console") for p in spec["paths"])
    assert spec["components"]["securitySchemes"], "bearer auth is declared"
    chat = spec["paths"]["/v1/chat/completions"]["post"]
    assert "requestBody" in chat


def test_sign_in_shows_the_api_message_for_a_bad_key(page: Any, platform: PlatformProcess) -> None:
    page.goto(platform.url + "/")
    page.get_by_label("API key", exact=True).fill("sk-my-not-a-real-key")
    page.get_by_label("API key", exact=True).press("Enter")  # the keyboard works: Enter submits
    error = page.locator("#signin-error")
    error.wait_for(state="visible")
    assert "key" in error.inner_text().lower()
    assert page.evaluate("sessionStorage.length") == 0


def test_streamed_chat_keys_batch_and_usage(
    page: Any, platform: PlatformProcess, tenant_key: str, shots: Shots
) -> None:
    sign_in(page, platform.url, tenant_key)
    assert platform.url + "/" == page.url.split("#")[0]  # the key never reaches the URL
    assert page.evaluate("document.cookie") == ""

    # ----- playground: tokens arrive over time, TTFT shows ------------------------------------
    page.locator("#chat-model").select_option("tiny")
    page.get_by_label("Temperature").fill("0")
    page.get_by_label("Max tokens").fill("48")
    page.get_by_label("System prompt").fill("You are a concise assistant.")
    page.get_by_label("Message").fill("Tell me about paged attention.")
    # The output's length each time the DOM changed: growth in steps means tokens streamed.
    page.evaluate(
        """() => { window.__lengths = [];
        new MutationObserver(() => window.__lengths.push(
          document.getElementById('chat-output').textContent.length))
        .observe(document.getElementById('chat-output'), {childList: true, subtree: true,
                                                          characterData: true}); }"""
    )
    throttle(page, 3000)
    page.get_by_role("button", name="Send").click()
    page.wait_for_function(
        "() => document.getElementById('chat-output').textContent.length > 15", timeout=60_000
    )
    if page.locator("#chat-output.streaming").count():
        shots.take(page, "console-playground-1280")  # mid-stream
    page.locator("#chat-send:not([disabled])").wait_for(timeout=60_000)
    throttle(page, -1)
    assert page.locator("#flash").inner_text() == ""
    lengths = [n for n in page.evaluate("window.__lengths") if n > 0]
    assert len(set(lengths)) >= 3 and lengths == sorted(lengths), lengths
    assert page.locator("#chat-ttft").inner_text().endswith(" ms")
    assert page.locator("#chat-output").get_attribute("aria-live") == "polite"
    if not (shots.folders[0] / "console-playground-1280.png").exists():
        shots.take(page, "console-playground-1280")
    page.set_viewport_size(PHONE)
    shots.take(page, "console-playground-375")
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
    page.set_viewport_size(WIDE)

    # ----- keys: created (shown once), works, revoked, refused --------------------------------
    page.get_by_role("link", name="API keys").click()
    page.locator("#key-name").fill("from-console")
    page.get_by_role("button", name="Create key").click()
    secret = page.locator("#key-secret")
    secret.wait_for(state="visible")
    new_key = secret.input_value()
    assert new_key.startswith("sk-")
    with httpx.Client(base_url=platform.url, headers={"authorization": f"Bearer {new_key}"}) as c:
        assert c.get("/v1/models").status_code == 200
        # Rotated: a new secret shown once; the old one still works (a 24 h grace).
        page.get_by_role("button", name="Rotate key from-console").click()
        page.wait_for_function(
            "old => document.getElementById('key-secret').value !== old", arg=new_key
        )
        rotated = secret.input_value()
        assert rotated.startswith("sk-") and "works until" in page.inner_text("#key-created")
        assert c.get("/v1/models").status_code == 200
        auth = {"authorization": f"Bearer {rotated}"}
        assert httpx.get(f"{platform.url}/v1/models", headers=auth).status_code == 200
        page.get_by_role("button", name="Revoke key from-console").click()
        page.locator("#keys-list .badge.revoked").wait_for()
        assert c.get("/v1/models").status_code == 401

    # ----- batch: upload a JSONL, see it complete, results downloadable -----------------------
    page.get_by_role("link", name="Files & batches").click()
    lines = [batch_line(f"item-{i}", f"Hello {i}", max_tokens=3) for i in range(3)]
    page.get_by_label("Batch input (JSONL)").set_input_files(
        {"name": "requests.jsonl", "mimeType": "application/jsonl", "buffer": jsonl(lines)}
    )
    page.get_by_role("button", name="Upload and start").click()
    page.locator("#batches-list .badge.completed").wait_for(timeout=60_000)
    assert "3/3 done" in page.locator("#batches-list").inner_text()
    with page.expect_download() as download:
        page.get_by_role("button", name="Download results", exact=False).first.click()
    results = Path(download.value.path()).read_text().splitlines()
    assert sorted(json.loads(x)["custom_id"] for x in results) == ["item-0", "item-1", "item-2"]

    # ----- usage: an SVG bar for today ------------------------------------------------------
    page.get_by_role("link", name="Usage").click()
    today = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    bar = page.locator(f'#usage-day svg rect.bar[data-label="{today}"]')
    bar.wait_for()
    assert float(bar.get_attribute("data-value") or 0) > 0
    assert page.locator('#usage-model svg rect.bar[data-label="tiny"]').count() == 1
    assert page.locator("#usage-key svg rect.bar").count() >= 1  # spend per key (budgets)
    assert page.locator('#usage-team svg rect.bar[data-label="(no team)"]').count() == 1
    shots.take(page, "console-usage-1280")
    page.set_viewport_size(PHONE)
    shots.take(page, "console-usage-375")
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]

    # ----- sign out clears the key -------------------------------------------------------
    page.set_viewport_size(WIDE)
    page.get_by_role("button", name="Sign out").click()
    page.locator("#signin").wait_for(state="visible")
    assert page.evaluate("sessionStorage.length") == 0


def test_deploy_from_the_registry_with_progress_and_api_errors_shown(
    page: Any, platform: PlatformProcess, tenant_key: str, models: Path
) -> None:
    from modelyard.registry_client import RegistryClient

    RegistryClient(platform.url, tenant_key).push(models / "tiny", "tiny-reg")
    sign_in(page, platform.url, tenant_key)
    page.get_by_role("link", name="Endpoints").click()
    page.get_by_label("Registry model").select_option("tiny-reg:1")
    assert page.get_by_label("Endpoint model name").input_value() == "tiny-reg"
    page.locator("#deploy-max").fill("2")  # room for the canary added below beside the stable
    page.get_by_role("button", name="Deploy").click()
    progress = page.locator("#deploy-progress")
    progress.get_by_text("tiny-reg: ready").wait_for(timeout=90_000)
    assert progress.locator("progress").get_attribute("value") == "100"
    page.locator("#endpoints-list .badge.ready").wait_for()
    assert "1/1 ready" in page.locator("#endpoints-list").inner_text()
    # A loading replica's {phase, fraction} is a bar on its endpoint (drawn by the console's own
    # module from an endpoint view shaped as GET /v1/endpoints returns it); a ready one, none.
    shown = page.evaluate("""async () => {
      const { loadCell } = await import("/console/endpoints.js");
      const replicas = (...progress) => ({ items: progress.map((p) => ({ load_progress: p })) });
      const cell = loadCell({ model_name: "m", replicas: replicas(
        { phase: "ready", fraction: 1 }, { phase: "loading", fraction: 0.5 }) });
      const bar = cell.querySelector("progress");
      return [bar.value, bar.getAttribute("aria-label"), cell.textContent.trim(),
              loadCell({ model_name: "m", replicas: replicas({ phase: "ready", fraction: 1 }) })];
    }""")
    assert shown == [60, "m loading: loading 50%", "loading 50%", "–"]
    # A second deploy of the same name: the API refuses it, and its own message is shown.
    page.get_by_role("button", name="Deploy").click()
    flash = page.locator("#flash")
    flash.wait_for(state="visible")
    message = flash.inner_text()
    duplicate = page.request.post(
        platform.url + "/v1/models/deploy",
        headers={"authorization": f"Bearer {tenant_key}"},
        data={"model_name": "tiny-reg", "model_artifact": "tiny-reg:1"},
    )
    assert duplicate.status >= 400 and message == duplicate.json()["error"]["message"]

    # A 10 % canary of a second version: the endpoint's row shows both versions and their shares.
    RegistryClient(platform.url, tenant_key).push(models / "tiny", "tiny-reg")
    api = platform.api(tenant_key)
    [endpoint_id] = [e["endpoint_id"] for e in api.get("/v1/endpoints").json()["data"]
                     if e["model_name"] == "tiny-reg"]  # fmt: skip
    added = api.post(f"/v1/endpoints/{endpoint_id}/versions",
                     json={"model_artifact": "tiny-reg:2", "weight": 10})  # fmt: skip
    assert added.status_code == 201, added.text
    wait_status(api, endpoint_id, "ready")
    deadline = time.monotonic() + 90
    while api.get(f"/v1/endpoints/{endpoint_id}").json()["versions"]["canary"]["status"] != (
        "serving"
    ):
        assert time.monotonic() < deadline, "the canary did not start serving"
        time.sleep(0.3)
    page.get_by_role("link", name="Playground").click()
    page.get_by_role("link", name="Endpoints").click()  # the list is read when the view opens
    row = page.locator("#endpoints-list tr", has_text="tiny-reg")
    row.get_by_text("tiny-reg:1 90% · tiny-reg:2 10% canary").wait_for()
    assert "canary serving" in row.inner_text()


def test_keyboard_reaches_every_section(page: Any, platform: PlatformProcess) -> None:
    sign_in(page, platform.url, platform.admin_key)
    page.keyboard.press("Shift+Tab")  # from <main> back into the navigation
    for _ in range(12):
        focused = page.evaluate("document.activeElement.dataset.view || ''")
        if focused == "fleet":
            break
        page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.dataset.view") == "fleet"
    page.keyboard.press("Enter")
    page.locator("#view-fleet").wait_for(state="visible")
    page.locator("#fleet-devices table").wait_for()


def fits(page: Any) -> list[int]:
    """What overflows the viewport's width: the page's scroll width, the right edge of each
    table in the view shown (a table scrolling inside its box overflows too)."""
    return list(
        page.evaluate("""() => [document.documentElement.scrollWidth,
          ...[...document.querySelectorAll('.view:not([hidden]) table')].map(
            (t) => Math.ceil(t.getBoundingClientRect().right))].filter((x) => x > innerWidth)""")
    )


def test_pickers_list_their_kind_chat_sends_only_what_was_set_and_tables_fit_a_phone(
    page: Any, platform: PlatformProcess, shots: Shots
) -> None:
    sign_in(page, platform.url, platform.admin_key)
    page.locator("#chat-model option").first.wait_for(state="attached")
    assert page.locator("#chat-model option").all_inner_texts() == ["tiny"]
    assert page.get_by_label("Temperature").get_attribute("placeholder") == "model default: 0.2"
    # The body of each chat request the page sends.
    bodies: list[dict[str, Any]] = []
    page.on(
        "request",
        lambda r: (
            bodies.append(json.loads(r.post_data))
            if r.url.endswith("/v1/chat/completions")
            else None
        ),
    )
    page.get_by_label("Max tokens").fill("3")
    page.get_by_label("Message").fill("Hello")
    for temperature in ("", "0.5"):
        page.get_by_label("Temperature").fill(temperature)
        page.get_by_role("button", name="Send").click()
        page.locator("#chat-stop[disabled]").wait_for(state="attached", timeout=60_000)
        assert page.locator("#flash").inner_text() == ""
    assert len(bodies) == 2 and "temperature" not in bodies[0], bodies
    assert bodies[1]["temperature"] == 0.5

    page.get_by_role("link", name="Embeddings").click()
    page.locator("#embed-model option").first.wait_for(state="attached")
    assert page.locator("#embed-model option").all_inner_texts() == ["tiny-embed"]
    page.locator("#embed-input").fill("a phone is narrow\nso are its tables")
    page.get_by_role("button", name="Embed").click()
    page.locator("#embed-result table, #flash:not(:empty)").first.wait_for(timeout=60_000)
    assert page.locator("#flash").inner_text() == ""
    # Every view with a table, at a desktop's width and at a phone's.
    views = {"embeddings": "#embed-result table", "endpoints": "#endpoints-list table",
             "keys": "#keys-list table", "tenants": "#tenants-list table",
             "fleet": "#fleet-devices table"}  # fmt: skip
    for view, ready in views.items():
        if view != "embeddings":
            page.locator(f'#nav a[data-view="{view}"]').click()
            page.locator(ready).wait_for()
        assert fits(page) == [], (view, "at 1280 px")
        page.set_viewport_size(PHONE)
        assert fits(page) == [], (view, "at 375 px")
        if view in ("embeddings", "endpoints"):
            shots.take(page, f"console-{view}-375")
            page.set_viewport_size(WIDE)
            shots.take(page, f"console-{view}-1280")
        page.set_viewport_size(WIDE)


def test_platform_admin_sees_tenants_and_fleet(
    page: Any, platform: PlatformProcess, shots: Shots
) -> None:
    sign_in(page, platform.url, platform.admin_key)
    page.get_by_role("link", name="Fleet").click()
    page.locator("#fleet-devices table").wait_for()
    assert "tiny" in page.locator("#fleet-scaling").inner_text()
    assert "tiny (rep-" in page.locator("#fleet-devices").inner_text()
    shots.take(page, "console-fleet-1280")
    page.get_by_role("link", name="Tenants").click()
    page.locator("#tenants-list table").wait_for()
    assert "system" in page.locator("#tenants-list").inner_text()
    tenant_id = create_tenant(platform.api(), "console-tiers")
    page.reload()  # the tenant list is read when the view opens
    page.locator("#tenants-list table").wait_for()
    page.locator("#view-tenants").get_by_label("Tenant", exact=True).select_option(tenant_id)
    page.get_by_label("New tier").select_option("priority")
    page.locator("#view-tenants").get_by_label("Max replicas").fill("3")
    page.get_by_role("button", name="Update tenant").click()
    row = page.locator("#tenants-list tr", has_text="console-tiers")
    row.locator(".badge.priority").wait_for()
    assert "replicas 3" in row.inner_text()
    assert platform.api().get(f"/v1/tenants/{tenant_id}").json()["max_replicas"] == 3


@pytest.mark.skipif(
    not os.environ.get("MODELYARD_SCREENSHOT_DIR"),
    reason="makes the README picture (docs/console.png) only with MODELYARD_SCREENSHOT_DIR set",
)
def test_readme_screenshot(
    page: Any, platform: PlatformProcess, smollm2_folder: Path, shots: Shots
) -> None:
    """The playground mid-stream at 1280 px, with SmolLM2 so that the reply reads as text."""
    deploy(platform.api(), "smollm2", str(smollm2_folder), public=True)
    sign_in(page, platform.url, platform.admin_key)
    page.locator("#chat-model").select_option("smollm2")
    page.get_by_label("Max tokens").fill("160")
    page.get_by_label("System prompt").fill("You are a concise assistant.")
    page.get_by_label("Message").fill("Explain what a paged KV cache is, in a short paragraph.")
    throttle(page, 1500)
    page.get_by_role("button", name="Send").click()
    page.wait_for_function(
        "() => document.getElementById('chat-output').textContent.length > 160", timeout=120_000
    )
    page.wait_for_timeout(400)  # let the tokens/s figure settle
    assert page.locator("#chat-output.streaming").count() == 1
    shots.take(page, "console")
    page.get_by_role("button", name="Stop").click()
