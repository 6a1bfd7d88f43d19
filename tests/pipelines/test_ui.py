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

from ops.deploy import free_port

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


@pytest.mark.slow
def test_asset_graph_in_the_dagster_ui(tmp_path):
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text("nux:\n  enabled: false\ntelemetry:\n  enabled: false\n")
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
    finally:
        web.terminate()
        web.wait(timeout=20)
