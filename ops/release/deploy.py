"""Deploying a build to a running `polyinf serve` through its admin API, watching it, rolling back.

Embedded mode starts the server on loopback. Before the hot swap a window of the deployment's traffic
is replayed against it, after the swap another: if SLO attainment (the metric the decision rested on)
is significantly worse after than before, the deployment is rolled back and says so.
"""
from __future__ import annotations

import secrets
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from engine.generated.isolation import project_env
from engine.config.variant import VariantSpec


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackServer:
    """A ``polyinf`` server subcommand on a free loopback port, started and stopped by us, healthy on return."""

    def __init__(self, command: list[str], label: str, startup_s: float = 300.0) -> None:
        """``command``: the subcommand and its arguments (``--port`` is added)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = secrets.token_hex(16)
        args = [sys.executable, "-m", "pipelines.cli", *command, "--port", str(self.port)]
        root = str(Path(__file__).resolve().parents[2])
        # the server gets its own token and none of this process's secrets (LLM keys, cloud credentials);
        # the token goes in its environment, not on its command line (which any local user can read)
        env = project_env({"POLYINF_ADMIN_TOKEN": self.token})
        # its stderr goes to a file: a pipe nobody reads while it serves would stall it once full
        self.log = tempfile.NamedTemporaryFile("w+", prefix="polyinf-serve-", suffix=".log")
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=self.log, text=True, env=env, cwd=root)
        deadline = time.time() + startup_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{label} exited: {self.log_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{label} did not become healthy in {startup_s:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log_text(self) -> str:
        """What the server wrote to its stderr so far."""
        self.log.flush()
        self.log.seek(0)
        return self.log.read()


class ServerProcess(LoopbackServer):
    """A `polyinf serve` on loopback, started and stopped by us."""

    def __init__(self, model_args: list[str], served_name: str, capture_dir: Path | None = None,
                 startup_s: float = 300.0) -> None:
        self.name = served_name
        command = ["serve", *model_args, "--served-model-name", served_name]
        if capture_dir is not None:
            command += ["--capture-dir", str(capture_dir)]
        super().__init__(command, "polyinf serve", startup_s)


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


@dataclass
class LiveWindows:
    """The traffic a deployment is verified on: two disjoint windows of the deployment's traffic (the judge's
    held-out part), replayed over HTTP with their arrival pattern at ``rate`` req/s, the first before the swap
    and the second after it; each request meets ``slo`` or not (the decision's own metric). ``spare``: further
    (before, after) pairs, each replayed in a round of its own when the round before was void."""

    before: tuple[list, list[list[int]]]  # (TraceRecords, prompts)
    after: tuple[list, list[list[int]]]
    rate: float
    slo: object  # ops.bench.SLO
    max_output: int | None = None
    max_lag_s: float = 0.05  # a window whose load generator lagged more than this is void, not a verdict
    predicted_before: float = float("nan")  # the simulator's attainment of the serving and of the new form there
    predicted_after: float = float("nan")
    spare: list = field(default_factory=list)  # [(before, after)] for the rounds after a void one


def _live_window(url: str, model: str, records: list, prompts: list[list[int]], rate: float, slo,
                 max_output: int | None) -> tuple[list[bool], float, int]:
    """(met the SLO per request, the load generator's worst send lag, requests failed). Replayed by a client
    process of its own (``replay_in_child``), so this job's own work cannot delay a send."""
    from ops.measure.tiers import own_rate
    from ops.traffic.replay import replay_in_child

    scale = own_rate(records) / rate if rate > 0 else 0.0
    results = replay_in_child(records, prompts, url + "/v1", model, time_scale=scale, max_output=max_output)
    met = [r.ok and slo.met(r.ttft, (r.e2e - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else None,
                            r.input_tokens, r.output_tokens) for r in results]
    return met, max((r.lag for r in results), default=0.0), sum(not r.ok for r in results)


def _warm(url: str, model: str, prompt: list[int]) -> None:
    """One request that is not counted, so that a window does not time a form's first steps (the judge's replays
    skip them the same way)."""
    httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt[:32] or [1], "max_tokens": 2,
                                              "temperature": 0.0, "ignore_eos": True}, timeout=600)


def deploy(url: str, token: str, model: str, variant: VariantSpec, live: LiveWindows) -> Deployment:
    """Hot-swaps ``variant`` in and verifies it on the decision's own metric: SLO attainment of the traffic's
    windows before and after the swap, compared with Newcombe's interval (ops/judge.verify_live); significantly
    worse rolls back. A round whose load generator lagged is void: the serving form is swapped back and the next
    pair of windows (``live.spare``) replayed; when every round is void the swap stays (said so)."""
    auth = {"Authorization": f"Bearer {token}"}
    current = httpx.get(url + "/admin/variant", headers=auth, timeout=10).json()["active"]["variant_id"]
    if current == variant.variant_id:
        return Deployment(url, current, None, time.time(), "kept",
                          f"the endpoint already serves {current} ({variant.name}): nothing deployed")
    return _deploy_judged(url, auth, model, variant, current, live)


def _deploy_judged(url: str, auth: dict, model: str, variant: VariantSpec, current: str,
                   live: LiveWindows) -> Deployment:
    from ops.judge.rule import verify_live

    at = f" at {live.rate:.3f} req/s"
    voids = []  # a clause per void round
    for k, (win_b, win_a) in enumerate([(live.before, live.after), *live.spare]):
        if k:  # the round before was void: the serving form back, then both windows again on fresh traffic
            httpx.post(url + "/admin/rollback", headers=auth, timeout=600).raise_for_status()
        _warm(url, model, win_b[1][0] if win_b[1] else [1])
        before, lag_b, failed_b = _live_window(url, model, *win_b, live.rate, live.slo, live.max_output)
        r = httpx.post(url + "/admin/variant", headers=auth, json=variant.to_json(), timeout=600)
        if r.status_code != 200:
            return Deployment(url, current, current, time.time(), "refused",
                              f"the server refused the variant: {r.json().get('error', {}).get('message', r.text)}",
                              {"attainment": sum(before) / max(1, len(before)), "requests": len(before)})
        _warm(url, model, win_a[1][0] if win_a[1] else [1])
        after, lag_a, failed_a = _live_window(url, model, *win_a, live.rate, live.slo, live.max_output)
        check = verify_live(before, after, live.predicted_before, live.predicted_after)
        figures = ({"attainment": sum(before) / max(1, len(before)), "requests": len(before), "lag_s": lag_b,
                    "failed": failed_b, "predicted": live.predicted_before, "round": k + 1},
                   {"attainment": sum(after) / max(1, len(after)), "requests": len(after), "lag_s": lag_a,
                    "failed": failed_a, "predicted": live.predicted_after, "check": check.to_json(), "round": k + 1})
        if max(lag_b, lag_a) <= live.max_lag_s:
            break
        voids.append(f"round {k + 1} void (the load generator lagged {1e3 * max(lag_b, lag_a):.0f} ms behind its "
                     "schedule)")
    else:
        return Deployment(url, variant.variant_id, current, time.time(), "deployed",
                          f"{check.line()}{at}; {'; '.join(voids)}: the windows say nothing about the engine "
                          "(kept the swap, unverified)", *figures)
    said = f"{'; '.join(voids)}; round {len(voids) + 1}: " if voids else ""
    if check.worse:
        httpx.post(url + "/admin/rollback", headers=auth, timeout=600).raise_for_status()
        return Deployment(url, current, variant.variant_id, time.time(), "rolled back",
                          f"{said}{check.line()}{at}: significantly worse; rolled back to {current}", *figures)
    return Deployment(url, variant.variant_id, current, time.time(), "deployed",
                      f"{said}{check.line()}{at}: not significantly worse", *figures)
