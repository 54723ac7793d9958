"""The dashboard in a real headless browser: Debian's chromium driven by selenium through
Debian's chromedriver (installed by .ci/run; no browser download). The page is served by
`fractus-pod dashboard` from a copy of the recorded pod (tests/fixtures/recorded_pod).

It checks what a person sees: one curve per GPU in each chart, a new point after a metrics
line is appended, the rollback marker drawn on the canvas and listed; and it keeps a
screenshot (test-artifacts/dashboard.png) for people to look at.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from tests.support.dashboard import REPO, DashboardProcess, copy_recorded_pod

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
SCREENSHOT = REPO / "test-artifacts" / "dashboard.png"
ROLLBACK_RGB = (0xd6, 0x27, 0x28)        # timeline.MARKER_COLORS["rollback"]

BROWSER_MISSING = ("needs Debian's chromium and chromium-driver (apt-get install chromium "
                   "chromium-driver; .ci/run installs them)")
if not (CHROMIUM and CHROMEDRIVER) and os.environ.get("CI"):
    # CI installs the browser itself: there a missing one is a broken set-up, never a skip.
    pytest.fail(BROWSER_MISSING, pytrace=False)
pytestmark = pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER), reason=BROWSER_MISSING)


@pytest.fixture
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1250", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def wait_js(driver, script: str, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = driver.execute_script(script)
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


# Per chart: its GPU series' labels and each one's count of drawn (non-null) points.
CHART_STATE = """
const out = {};
for (const [name, u] of Object.entries(window.dashboard.charts)) {
  out[name] = u.series.slice(1).map((s, i) => ({
    label: s.label, points: u.data[i + 1].filter(v => v !== null && v !== undefined).length,
    lastX: u.data[0][u.data[0].length - 1]}));
}
return out;
"""

# The rollback marker's column on the ema_tf canvas: how many of its pixels have its colour.
ROLLBACK_PIXELS = """
const u = window.dashboard.charts.ema_tf, d = window.dashboard.data;
const m = d.markers.find(m => m.kind === "rollback");
const x = Math.round(u.valToPos(m.x, "x", true));
const px = u.ctx.getImageData(x, u.bbox.top, 1, u.bbox.height).data;
let hits = 0;
for (let i = 0; i < px.length; i += 4) {
  if (Math.abs(px[i] - arguments[0]) < 12 && Math.abs(px[i + 1] - arguments[1]) < 12 &&
      Math.abs(px[i + 2] - arguments[2]) < 12) hits++;
}
return [hits, u.bbox.height];
"""


def test_dashboard_page_in_chromium(tmp_path, browser):
    pod = copy_recorded_pod(tmp_path / "pod")
    dash = DashboardProcess(pod)
    try:
        browser.get(dash.url)
        wait_js(browser, "return window.dashboard && window.dashboard.data && "
                         "Object.keys(window.dashboard.charts).length === 3", 60, "the charts")
        charts = browser.execute_script(CHART_STATE)
        lines = {gpu: sum(1 for line in (pod / "logs" / f"metrics_gpu{gpu}.jsonl").open()
                          if line.startswith('{"type": "metrics"')) for gpu in (0, 1)}
        for name in ("ema_tf", "lb", "tok_s"):         # one curve per GPU, every line drawn
            assert [(s["label"], s["points"]) for s in charts[name]] == [
                ("gpu0", lines[0]), ("gpu1", lines[1])], name
        legend = [e.text for e in browser.find_elements(
            "css selector", "#chart-ema_tf .u-legend .u-series th")]
        assert [t for t in legend if t.startswith("gpu")] == ["gpu0", "gpu1"]

        # The rollback: listed, and drawn as a solid red line across the plot.
        kinds = [li.get_attribute("data-kind") for li in
                 browser.find_elements("css selector", "#markers li")]
        assert "rollback" in kinds and "hub_push" in kinds and "stage" in kinds
        times = [li.text.split(" ")[0] for li in
                 browser.find_elements("css selector", "#markers li")]
        assert all(re.fullmatch(r"\d\d:\d\d:\d\d", t) for t in times), times  # as status
        hits, height = browser.execute_script(ROLLBACK_PIXELS, *ROLLBACK_RGB)
        assert hits > 0.5 * height, (hits, height)
        rows = browser.find_elements("css selector", "#gpu-table tbody tr")
        assert [r.get_attribute("data-gpu") for r in rows] == ["0", "1"]
        assert "7d0491ed2631" in rows[1].text            # the hub revision, as `status`
        # The goodput panel: the ledger's line, then trained and each cause that lost time.
        from launcher.dashboard.goodput_files import pod_ledger
        ledger = pod_ledger(pod).to_dict()
        assert browser.find_element("id", "goodput-line").text.startswith(
            f"goodput {100 * ledger['goodput']:.1f}% of {ledger['gpu_hours']:.2f} GPU-h")
        causes = {r.get_attribute("data-cause"): r.text for r in browser.find_elements(
            "css selector", "#goodput-table tbody tr")}
        assert list(causes)[0] == "trained"
        assert set(causes) == {"trained"} | {c for c, s in ledger["lost_s"].items() if s > 0}
        assert causes["retrain_rollback"].startswith("re-training after a rollback")
        assert len(browser.find_elements("css selector", "#goodput-bar span")) == len(causes)
        SCREENSHOT.parent.mkdir(exist_ok=True)
        browser.save_screenshot(str(SCREENSHOT))
        # x: the tokens trained (the default), labelled so; the clock on request.
        assert browser.execute_script("return window.dashboard.data.x.mode") == "tokens"
        assert "tokens trained" in browser.execute_script(
            "return window.dashboard.charts.ema_tf.axes[0].label")
        from selenium.webdriver.support.ui import Select
        Select(browser.find_element("id", "x-mode")).select_by_value("time")
        wait_js(browser, "return window.dashboard.data.x.mode === 'time' && "
                         "window.dashboard.charts.ema_tf.xMode === 'time'", 30, "the time axis")
        charts = browser.execute_script(CHART_STATE)
        for name in ("ema_tf", "lb", "tok_s"):         # the same lines on the other axis
            assert [s["points"] for s in charts[name]] == [lines[0], lines[1]], name
        hits, height = browser.execute_script(ROLLBACK_PIXELS, *ROLLBACK_RGB)
        assert hits > 0.5 * height, (hits, height)
        browser.save_screenshot(str(SCREENSHOT.with_name("dashboard_time.png")))

        # Live: a metrics line appended to GPU 1's file appears without a reload.
        path = pod / "logs" / "metrics_gpu1.jsonl"
        last = json.loads([line for line in path.read_text().splitlines()
                           if line.startswith('{"type": "metrics"')][-1])
        new_ts = last["ts"] + 3.0
        with open(path, "a") as f:
            f.write(json.dumps({**last, "ts": new_ts, "step": last["step"] + 2,
                                "next_token": last["next_token"] + 64,
                                "ema_tf": last["ema_tf"] - 0.5}) + "\n")
        wait_js(browser, "const u = window.dashboard.charts.ema_tf; return u.data[2]"
                         ".filter(v => v !== null && v !== undefined).length === "
                         f"{lines[1] + 1};", 30, "the appended point")
        charts = browser.execute_script(CHART_STATE)
        assert [s["points"] for s in charts["ema_tf"]] == [lines[0], lines[1] + 1]
    finally:
        dash.stop()
