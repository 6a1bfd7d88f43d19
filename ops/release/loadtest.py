"""Load and faults against a live server and the board: every request answered and captured exactly once.

- ``closed_loop``: N completion requests from C concurrent clients; each answer's id is kept.
- ``check_capture``: the capture against those ids: missing, duplicated, and captured-but-unanswered.
- ``kill_and_restart``: SIGKILL the server mid-load, restart it on the same capture directory.
- ``swap_under_load``: a hot swap and a rollback while the load runs.
- ``board_faults``: workers SIGKILLed while they claim, renew and complete; their leases expire and the
  experiments are resumed; nothing is lost or counted twice.
bench/load_faults.py prints these as figures; tests/ops/test_loadtest.py runs smaller versions.
"""
from __future__ import annotations

import asyncio
import collections
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from engine.generated.isolation import project_env
from engine.serving.capture import read_capture_dir
from ops.search.board import DONE, RUNNING, Board
from ops.release.deploy import ServerProcess


@dataclass
class LoadResult:
    sent: int = 0
    ids: list[str] = field(default_factory=list)  # response ids of the requests answered in full
    failed: int = 0
    errors: collections.Counter = field(default_factory=collections.Counter)
    seconds: float = 0.0

    @property
    def ok(self) -> int:
        return len(self.ids)

    @property
    def duplicated_answers(self) -> int:
        return len(self.ids) - len(set(self.ids))


async def _closed_loop(url: str, model: str, n: int, concurrency: int, max_tokens: int, stop: threading.Event | None,
                       started: threading.Event | None) -> LoadResult:
    res = LoadResult()
    counter = iter(range(n))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        async def one_client():
            for i in counter:
                if stop is not None and stop.is_set():
                    return
                res.sent += 1
                if started is not None and res.sent >= concurrency:
                    started.set()
                body = {"model": model, "prompt": [1 + i % 50, 2, 3 + i % 7, 4], "max_tokens": max_tokens,
                        "ignore_eos": True, "temperature": 0}
                try:
                    r = await client.post("/v1/completions", json=body)
                    if r.status_code == 200 and r.json()["usage"]["completion_tokens"] == max_tokens:
                        res.ids.append(r.json()["id"])
                    else:
                        res.failed += 1
                        res.errors[f"HTTP {r.status_code}"] += 1
                except (httpx.HTTPError, ValueError, KeyError) as e:
                    res.failed += 1
                    res.errors[type(e).__name__] += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        res.seconds = time.perf_counter() - t0
    return res


def closed_loop(url: str, model: str, n: int, concurrency: int, max_tokens: int = 4,
                stop: threading.Event | None = None, started: threading.Event | None = None) -> LoadResult:
    """``n`` completions of ``max_tokens`` tokens from ``concurrency`` clients, each sending its next request
    when its last is answered; stops early when ``stop`` is set; sets ``started`` once all clients are busy."""
    return asyncio.run(_closed_loop(url, model, n, concurrency, max_tokens, stop, started))


def check_capture(capture_dir: str | Path, answered: list[str]) -> dict:
    """How the capture holds the answered requests: each exactly once is the contract."""
    counts = collections.Counter(r.request_id for r in read_capture_dir(capture_dir))
    answered_set = set(answered)
    return {"captured": sum(counts.values()),
            "missing": sum(1 for i in answered_set if counts[i] == 0),
            "duplicated": sum(1 for i, c in counts.items() if c > 1),
            "unanswered": sum(1 for i in counts if i not in answered_set),  # finished, but the client never saw it
            "without_id": counts[None]}


def start_server(model_args: list[str], capture_dir: Path) -> ServerProcess:
    return ServerProcess(model_args, "load", capture_dir)


def kill_and_restart(model_args: list[str], capture_dir: Path, n: int, concurrency: int, kill_after: int,
                     max_tokens: int = 4) -> dict:
    """Load until ``kill_after`` requests are answered, SIGKILL the server, restart it on the same capture, and
    load it again. The capture must hold every request answered before the kill, and after, exactly once."""
    server = start_server(model_args, capture_dir)
    stop, out = threading.Event(), {}
    worker = threading.Thread(target=lambda: out.update(r=closed_loop(server.url, "load", n, concurrency, max_tokens,
                                                                      stop)))
    worker.start()
    while worker.is_alive() and _answered(server) < kill_after:
        time.sleep(0.05)
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait()
    stop.set()
    worker.join()
    before = out["r"]
    restarted = start_server(model_args, capture_dir)
    try:
        after = closed_loop(restarted.url, "load", n // 4, concurrency, max_tokens)
    finally:
        restarted.stop()
    check = check_capture(capture_dir, before.ids + after.ids)
    return {"before_kill": before, "after_restart": after, **check}


def _answered(server: ServerProcess) -> int:
    try:
        text = httpx.get(server.url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:request_success_total")))


def swap_under_load(server: ServerProcess, variants: list[dict], n: int, concurrency: int,
                    max_tokens: int = 4) -> dict:
    """Loads the server while each variant is swapped in and the last is rolled back; every request must be
    answered. Returns the load's result and each swap's scopes and seconds."""
    auth = {"Authorization": f"Bearer {server.token}"}
    started, out, swaps = threading.Event(), {}, []
    worker = threading.Thread(target=lambda: out.update(r=closed_loop(server.url, "load", n, concurrency, max_tokens,
                                                                      started=started)))
    worker.start()
    started.wait(timeout=120)
    for spec in variants:
        r = httpx.post(server.url + "/admin/variant", headers=auth, json=spec, timeout=600)
        swaps.append({"status": r.status_code, **(r.json() if r.status_code == 200 else {"error": r.text[:300]})})
    r = httpx.post(server.url + "/admin/rollback", headers=auth, timeout=600)
    swaps.append({"status": r.status_code, "rollback": True, **(r.json() if r.status_code == 200 else {})})
    worker.join()
    return {"load": out["r"], "swaps": swaps}


_BOARD_WORKER = """
import random, sys, time
from ops.search.board import Board
board = Board(sys.argv[1], lease_s=float(sys.argv[3]))
while True:
    exp = board.claim(f"w{sys.argv[4]}", sys.argv[2])
    if exp is None:
        time.sleep(0.01)
        continue
    for _ in range(random.randint(1, 4)):  # a benchmark's heartbeats
        time.sleep(random.random() * 0.05)
        if not board.renew(exp):
            break
    board.complete(exp, f"w{sys.argv[4]}", {"output_tok_s": float(exp.id), "worker_pid": __import__("os").getpid()})
"""

_BOARD_PRODUCER = """
import sys
from engine.config.variant import VariantSpec
from ops.search.board import Board
board = Board(sys.argv[1])
for i in range(int(sys.argv[3])):
    board.enqueue(sys.argv[2], VariantSpec(max_num_seqs=i + 1), "fast", "producer", f"experiment {i}")
    board.post("producer", "note", {"i": i})
"""


def board_faults(path: str | Path, experiments: int, kills: int, lease_s: float = 0.5, seed: int = 0) -> dict:
    """A producer enqueues ``experiments`` (and is itself SIGKILLed and re-run until it finishes: re-enqueueing
    is idempotent), two workers drain them and are SIGKILLed ``kills`` times while holding a claim (mid-renew
    or mid-write) and restarted; then the board is checked: every experiment once, done once, with one result."""
    rng = random.Random(seed)
    root = str(Path(__file__).resolve().parents[2])
    env = project_env()  # the producers and workers run our code: none of this process's secrets
    search = "faults"
    Board(path).create_search(search, {})

    def spawn(code: str, *args) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", code, str(path), search, *map(str, args)], env=env, cwd=root)

    t0 = time.perf_counter()
    producer = spawn(_BOARD_PRODUCER, experiments)
    producer_kills = 0
    workers = {i: spawn(_BOARD_WORKER, lease_s, i) for i in range(2)}
    done_kills = 0
    board = Board(path)
    deadline = time.time() + 600
    while time.time() < deadline:
        time.sleep(rng.random() * 0.1)
        if producer.poll() is not None and producer.returncode != 0:
            producer = spawn(_BOARD_PRODUCER, experiments)  # a killed producer runs again
        elif producer.poll() is None and producer_kills < max(1, kills // 5) and rng.random() < 0.3:
            producer.send_signal(signal.SIGKILL)
            producer.wait()
            producer_kills += 1
            continue
        i = rng.randrange(2)
        holding = any(e["status"] == RUNNING and e["worker"] == f"w{i}" for e in board.experiments(search))
        if done_kills < kills and holding:  # only a worker holding a claim: killed mid-experiment
            workers[i].send_signal(signal.SIGKILL)
            workers[i].wait()
            workers[i] = spawn(_BOARD_WORKER, lease_s, i)
            done_kills += 1
        counts = board.counts(search)
        if producer.poll() == 0 and counts.get(DONE, 0) >= experiments:
            break
    for w in workers.values():
        w.send_signal(signal.SIGKILL)
        w.wait()
    if producer.poll() is None:
        producer.kill()
    rows = board.experiments(search)
    results = board.results(search)
    per_exp = collections.Counter(r.experiment_id for r, _ in results)
    variants = collections.Counter(e["variant_id"] for e in rows)
    requeued = [m for m in board.messages("note") if "re-queued" in str(m["body"].get("note", ""))]
    integrity = board._db.execute("PRAGMA integrity_check").fetchone()[0]
    return {"experiments": len(rows), "expected": experiments,
            "lost": experiments - len(variants), "duplicated": sum(1 for c in variants.values() if c > 1),
            "done": sum(1 for e in rows if e["status"] == DONE),
            "results": len(results), "double_results": sum(1 for c in per_exp.values() if c > 1),
            "worker_kills": done_kills, "producer_kills": producer_kills, "leases_expired": len(requeued),
            "integrity": integrity, "seconds": time.perf_counter() - t0}
