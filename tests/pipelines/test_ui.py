"""The Dagster UI on loopback, opened by headless Chromium: our asset graph is there; a screenshot is kept."""
from __future__ import annotations

import pytest

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

from ops.release.deploy import free_port

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
ASSETS = ["traffic_traces", "traffic_profile", "model_spec", "hardware_profile", "cost_model_plan",
          "variant_candidates", "fast_bench_results", "slow_bench_results", "engine_build", "deployed_endpoint"]
GROUPS = {"traffic": ["traffic_traces", "traffic_profile"],
          "plan": ["model_spec", "hardware_profile", "cost_model_plan", "variant_candidates"],
          "measure": ["fast_bench_results", "slow_bench_results"], "ship": ["engine_build", "deployed_endpoint"]}
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--window-size=1600,1000",
                  "--virtual-time-budget=30000"]


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    assert exe, "chromium is not installed (scripts/test.sh installs it with apt-get)"
    return exe


def _rendered_plot(chromium: str, page: str, title: str, profile: Path) -> str:
    """Opens ``page`` in headless Chromium over the DevTools protocol, clicks the '[Show Markdown]' of the
    metadata row ``title`` and returns the size ('WxH') of the PNG image the dialog renders ('none' if none)."""
    import json

    from websockets.sync.client import connect

    port = free_port()
    browser = subprocess.Popen([chromium, *CHROMIUM_FLAGS[:-1], f"--remote-debugging-port={port}",
                                f"--user-data-dir={profile}", "about:blank"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                pages = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=1).json()
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        ws_url = next(p["webSocketDebuggerUrl"] for p in pages if p["type"] == "page")
        with connect(ws_url, max_size=None) as ws:
            ids = iter(range(1, 10**6))

            def call(method, **params):
                i = next(ids)
                ws.send(json.dumps({"id": i, "method": method, "params": params}))
                while True:
                    msg = json.loads(ws.recv(timeout=60))
                    if msg.get("id") == i:
                        return msg

            def js(expr):
                return call("Runtime.evaluate", expression=expr, returnByValue=True)["result"]["result"].get("value")

            call("Page.navigate", url=page)
            click = ("(() => {const row = [...document.querySelectorAll('tr')].find(r => r.cells.length && "
                     f"r.cells[0].innerText.trim() === {json.dumps(title)}); const b = row ? [...row.querySelectorAll("
                     "'a, button')].find(b => b.textContent.includes('Show Markdown')) : null;"
                     "if (b) {b.click(); return 'clicked';} return 'none';})()")
            size = ("(() => {const i = document.querySelector('img[src^=\"data:image/png\"]');"
                    "return i && i.complete && i.naturalWidth ? i.naturalWidth + 'x' + i.naturalHeight : 'none';})()")
            for _ in range(150):
                if js(click) == "clicked":
                    break
                time.sleep(0.3)
            for _ in range(60):
                got = js(size)
                if got != "none":
                    return got
                time.sleep(0.3)
            return "none"
    finally:
        browser.terminate()
        browser.wait(timeout=20)


@pytest.mark.slow
def test_asset_graph_in_the_dagster_ui(tmp_path):
    import dagster as dg

    from assets.pipeline import plot_metadata
    from assets.plots import attainment_vs_rate, throughput_vs_tpot

    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text("nux:\n  enabled: false\ntelemetry:\n  enabled: false\n")
    # a slow tier's plots, in the metadata form the asset writes, recorded in the instance the UI reads
    pngs = {"throughput vs TPOT": throughput_vs_tpot([("static-best", 15.5, 384.0), ("grid", 9.5, 250.0)], 405.0),
            "SLO attainment vs rate": attainment_vs_rate([("static-best", [[0.4, 0.2], [0.2, 1.0]])])}
    instance = dg.DagsterInstance.local_temp(tempdir=str(home))
    instance.add_dynamic_partitions("deployments", ["smollm2|cpu|embedded"])
    instance.report_runless_asset_event(dg.AssetMaterialization(
        asset_key="slow_bench_results", partition="smollm2|cpu|embedded",
        metadata=plot_metadata(pngs, {t: f"/tmp/{t}.png" for t in pngs})))
    port = free_port()
    web = subprocess.Popen([str(Path(sys.executable).parent / "dagster-webserver"), "-h", "127.0.0.1", "-p", str(port),
                            "-w", "workspace.yaml"], cwd=ROOT, env={**os.environ, "DAGSTER_HOME": str(home)},
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                if httpx.get(url + "/server_info", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        chromium = _chromium()
        profile = tmp_path / "chromium"
        dom = subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom", url + "/assets"],
                             capture_output=True, text=True, timeout=120).stdout
        missing = [a for a in ASSETS if a not in dom]
        assert not missing, f"the asset catalog lacks {missing}"
        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "dagster-asset-graph.png"
        shot.unlink(missing_ok=True)
        subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--screenshot={shot}",
                        url + "/locations/pipelines.definitions/asset-groups/measure"], capture_output=True,
                       timeout=120)
        assert shot.is_file() and shot.stat().st_size > 20_000
        # the graph in groups by stage, left to right: traffic, plan, measure, ship
        for group, members in GROUPS.items():
            graph_dom = subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom",
                                        url + f"/locations/pipelines.definitions/asset-groups/{group}"],
                                       capture_output=True, text=True, timeout=120).stdout
            assert all(a in graph_dom for a in members), (group, [a for a in members if a not in graph_dom])
        # the plot renders on the asset's page, at the size it was drawn
        assert _rendered_plot(chromium, url + "/assets/slow_bench_results", "throughput vs TPOT",
                              tmp_path / "cdp") == "640x420"
    finally:
        web.terminate()
        web.wait(timeout=20)
