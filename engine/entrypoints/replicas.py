"""Data-parallel replicas as processes: each a whole `polyinf serve` of the variant (with tp > 1, a tensor-parallel
group of its own) on loopback, on its own GPUs (``CUDA_VISIBLE_DEVICES``) or its share of the CPU's cores, with
its own admin token (in memory, through the pipe that starts it) and none of this process's secrets. A
``ReplicaSet`` starts them, checks them (process and /health) and starts again one whose process ended, bringing
it to the active variant before it takes requests. The router in front is engine/entrypoints/router.py's.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass

import httpx

from engine.errors import ConfigError
from engine.generated.isolation import secrets_withheld

log = logging.getLogger("polyinf.router")

RESTART_BACKOFF_S = 10.0  # a replica that keeps failing is started again at most this often
HEALTH_MISSES = 3  # health checks (one a second) a replica may fail in a row before it takes no requests


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _replica_main(config, name: str, port: int, token: str, capture_dir: str | None, capture_prompts: bool,
                  threads: int, devices: str | None, parent: int) -> None:
    """A replica's process: its devices and threads set, then an ordinary server on loopback."""
    if devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = devices  # before anything touches CUDA
    import torch

    from engine.serving.rank_group import watch_parent
    from engine.entrypoints.server import serve

    torch.set_num_threads(threads)
    threading.Thread(target=watch_parent, args=(parent,), daemon=True).start()
    serve(config, name, "127.0.0.1", port, admin_token=token, capture_dir=capture_dir,
          capture_prompts=capture_prompts)


@dataclass
class Replica:
    index: int
    config: object  # the EngineConfig it serves (dp 1)
    name: str
    devices: str | None
    threads: int
    capture_dir: str | None
    capture_prompts: bool
    url: str = ""
    token: str = ""
    process: object = None
    up: bool = False
    inflight: int = 0
    served: int = 0
    failed: int = 0
    started: float = 0.0
    starting: bool = False  # restarted, not yet brought to the active variant
    restarts: int = 0
    misses: int = 0  # health checks failed in a row
    ready_s: float = 0.0  # start to healthy, last start

    def start(self) -> None:
        import torch.multiprocessing as mp

        port = free_port()
        self.url, self.token, self.started, self.up = f"http://127.0.0.1:{port}", secrets.token_hex(16), time.time(), False
        ctx = mp.get_context("spawn")
        self.process = ctx.Process(
            target=_replica_main, name=f"polyinf-replica{self.index}", daemon=False,
            args=(self.config, self.name, port, self.token, self.capture_dir, self.capture_prompts, self.threads,
                  self.devices, os.getpid()))
        with secrets_withheld():
            self.process.start()

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.process.exitcode is not None:
                raise ConfigError(f"replica {self.index} exited with code {self.process.exitcode} while starting "
                                  "(its error is above)")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.ready_s = time.time() - self.started
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise ConfigError(f"replica {self.index} did not become healthy within {timeout_s:.0f} s")

    def admin(self) -> dict:
        return {"authorization": f"Bearer {self.token}"}

    def stop(self) -> None:
        p = self.process
        if p is not None and p.exitcode is None:
            p.terminate()
            p.join(timeout=20)
            if p.exitcode is None:
                p.kill()
                p.join(timeout=5)


@dataclass
class ReplicaSet:
    """The replicas of one data-parallel layout, started, watched and restarted together."""

    replicas: list[Replica]
    startup_s: float = 600.0
    restart: bool = True
    active_variant: dict | None = None  # the variant the admin API last made active on every replica

    @classmethod
    def start(cls, config, dp: int, name: str, capture_dir: str | None = None, capture_prompts: bool = False,
              startup_s: float = 600.0, restart: bool = True) -> "ReplicaSet":
        """``dp`` replicas of ``config``'s variant (its tp per replica): replica i on GPUs i*tp .. i*tp+tp-1, or on
        1/dp of the CPU's cores; replica i captures in ``capture_dir``/replica-i (a capture folder has one writer)."""
        variant = config.initial_variant()
        tp = variant.tp
        single = dataclasses.replace(config, variant=dataclasses.replace(variant, dp=1))
        cuda = str(config.device).startswith("cuda")
        if cuda:
            import torch

            if torch.cuda.device_count() < dp * tp:
                raise ConfigError(f"dp={dp} x tp={tp} needs {dp * tp} GPUs; this machine has "
                                  f"{torch.cuda.device_count()}")
        cores = os.cpu_count() or 1
        reps = [Replica(i, single, name, ",".join(str(i * tp + r) for r in range(tp)) if cuda else None,
                        max(1, cores // dp), os.path.join(capture_dir, f"replica-{i}") if capture_dir else None,
                        capture_prompts) for i in range(dp)]
        rs = cls(reps, startup_s, restart)
        try:
            for r in reps:
                r.start()
            for r in reps:
                r.wait_ready(startup_s)
                r.up = True
        except BaseException:
            rs.stop()
            raise
        return rs

    def stop(self) -> None:
        self.restart = False
        for r in self.replicas:
            r.stop()

    def check(self, r: Replica) -> None:
        """Marks ``r`` up or down by its process and its /health; a replica whose process ended is started again
        (in a thread: it loads its weights) and brought to the active variant before it is up."""
        if r.starting:
            return
        if r.process is not None and r.process.exitcode is not None:
            if r.up:
                r.up = False
                log.error("replica %d exited (code %s)", r.index, r.process.exitcode)
            if self.restart and time.time() - r.started >= RESTART_BACKOFF_S:
                r.starting = True
                r.restarts += 1
                r.start()
                threading.Thread(target=self._bring_up, args=(r,), daemon=True).start()
            return
        try:
            ok = httpx.get(r.url + "/health", timeout=2).status_code == 200
        except httpx.ConnectError:  # nothing listens: down at once
            r.misses, r.up = HEALTH_MISSES, False
            return
        except httpx.HTTPError:
            ok = False
        # a busy replica can answer late; down only after HEALTH_MISSES checks in a row fail
        r.misses = 0 if ok else r.misses + 1
        r.up = r.misses < HEALTH_MISSES

    def _bring_up(self, r: Replica) -> None:
        try:
            r.wait_ready(self.startup_s)
            if self.active_variant is not None:
                resp = httpx.post(r.url + "/admin/variant", json=self.active_variant, headers=r.admin(), timeout=None)
                if resp.status_code != 200:
                    log.error("restarted replica %d refused the active variant: %s", r.index, resp.text[:300])
                    r.stop()
                    return
            r.misses, r.up = 0, True
            log.warning("replica %d restarted in %.1f s", r.index, time.time() - r.started)
        except Exception as e:  # noqa: BLE001 -- it stays down; the next check tries again
            log.error("replica %d could not be restarted: %s", r.index, e)
            r.stop()
        finally:
            r.starting = False
