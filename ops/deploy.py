"""Deploying a build to a running `polyinf serve` through its admin API, watching it, rolling back.

Embedded mode starts the server on loopback. After the hot swap, live metrics are watched for a
window while probe traffic runs; if the time per output token regresses beyond the allowed
margin against the window measured before the swap, the deployment is rolled back and says so.
"""
from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from engine.isolation import without_secrets
from engine.variant import VariantSpec


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A `polyinf serve` on loopback, started and stopped by us."""

    def __init__(self, model_args: list[str], served_name: str, capture_dir: Path | None = None,
                 startup_s: float = 300.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = secrets.token_hex(16)
        self.name = served_name
        args = [sys.executable, "-m", "pipelines.cli", "serve", *model_args, "--port", str(self.port),
                "--served-model-name", served_name]
        if capture_dir is not None:
            args += ["--capture-dir", str(capture_dir)]
        root = str(Path(__file__).resolve().parents[1])
        # the server gets its own token and none of this process's secrets (LLM keys, cloud credentials);
        # the token goes in its environment, not on its command line (which any local user can read)
        env = {**without_secrets(), "POLYINF_ADMIN_TOKEN": self.token,
               "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                                     cwd=root)
        deadline = time.time() + startup_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"polyinf serve exited: {self.proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError("polyinf serve did not become healthy in time")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@dataclass
class Deployment:
    endpoint: str
    build_id: str  # the variant id now serving
    previous_build: str | None
    time: float
    status: str  # "deployed" | "rolled back" | "refused" | "kept" (already serving it: nothing swapped)
    reason: str
    live_before: dict = field(default_factory=dict)
    live_after: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def _histogram(text: str, name: str) -> tuple[float, float]:
    s = c = 0.0
    for line in text.splitlines():
        if line.startswith(name + "_sum"):
            s += float(line.rsplit(" ", 1)[1])
        elif line.startswith(name + "_count"):
            c += float(line.rsplit(" ", 1)[1])
    return s, c


def _window(url: str, model: str, probes: list[list[int]], max_tokens: int, concurrency: int) -> dict:
    """Runs probe traffic and returns the mean inter-token latency and TTFT it produced, from /metrics."""
    before = httpx.get(url + "/metrics", timeout=10).text

    def one(p):
        r = httpx.post(url + "/v1/completions", timeout=300, json={"model": model, "prompt": p, "max_tokens": max_tokens,
                                                                   "temperature": 0, "ignore_eos": True})
        r.raise_for_status()

    t = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, probes))
    wall = time.perf_counter() - t
    after = httpx.get(url + "/metrics", timeout=10).text
    (s0, c0), (s1, c1) = _histogram(before, "vllm:inter_token_latency_seconds"), \
        _histogram(after, "vllm:inter_token_latency_seconds")
    (t0, n0), (t1, n1) = _histogram(before, "vllm:time_to_first_token_seconds"), \
        _histogram(after, "vllm:time_to_first_token_seconds")
    return {"itl_mean_s": (s1 - s0) / max(1.0, c1 - c0), "ttft_mean_s": (t1 - t0) / max(1.0, n1 - n0),
            "requests": len(probes), "wall_s": wall}


def deploy(url: str, token: str, model: str, variant: VariantSpec, probes: list[list[int]], max_tokens: int = 8,
           concurrency: int = 4, tolerance: float = 0.25, spread: float = 0.0) -> Deployment:
    """Hot-swaps ``variant`` in, watches a window of probe traffic, rolls back on regression.

    Regression: mean inter-token latency after > before x (1 + tolerance) + spread (seconds).
    """
    auth = {"Authorization": f"Bearer {token}"}
    current = httpx.get(url + "/admin/variant", headers=auth, timeout=10).json()["active"]["variant_id"]
    if current == variant.variant_id:
        return Deployment(url, current, None, time.time(), "kept",
                          f"the endpoint already serves {current} ({variant.name}): nothing deployed")
    live_before = _window(url, model, probes, max_tokens, concurrency)
    r = httpx.post(url + "/admin/variant", headers=auth, json=variant.to_json(), timeout=600)
    if r.status_code != 200:
        return Deployment(url, current, current, time.time(), "refused",
                          f"the server refused the variant: {r.json().get('error', {}).get('message', r.text)}",
                          live_before)
    live_after = _window(url, model, probes, max_tokens, concurrency)
    limit = live_before["itl_mean_s"] * (1 + tolerance) + spread
    if live_after["itl_mean_s"] > limit:
        httpx.post(url + "/admin/rollback", headers=auth, timeout=600).raise_for_status()
        return Deployment(url, current, variant.variant_id, time.time(), "rolled back",
                          f"live inter-token latency regressed: {1e3 * live_after['itl_mean_s']:.1f} ms after vs "
                          f"{1e3 * live_before['itl_mean_s']:.1f} ms before (limit {1e3 * limit:.1f} ms); "
                          f"rolled back to {current}", live_before, live_after)
    return Deployment(url, variant.variant_id, current, time.time(), "deployed",
                      f"live inter-token latency {1e3 * live_after['itl_mean_s']:.1f} ms vs "
                      f"{1e3 * live_before['itl_mean_s']:.1f} ms before (limit {1e3 * limit:.1f} ms)",
                      live_before, live_after)
