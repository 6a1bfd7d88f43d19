"""A `polyinf serve` on loopback for a benchmark: started with the benchmark's options, ready once /health answers,
its stderr kept in a log file (a pipe nobody reads would stall it), stopped on leaving the ``with`` block. Needs
only the standard library on the client side (a GPU host has no httpx of ours)."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, options: list[str], log: Path, env: dict | None = None, port: int | None = None,
                 startup_s: float = 900.0) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.ready_s = float("nan")
        self._options, self._env, self._startup_s = options, env, startup_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Server":
        return self.start()

    def start(self) -> "Server":
        """Starts the server and waits until /health answers; raises RuntimeError (with the log's tail) if it exits
        or does not become healthy in time."""
        t0 = time.time()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "serve", *self._options, "--port",
                                          str(self.port)], cwd=ROOT, env=self._env, stdout=subprocess.DEVNULL,
                                         stderr=err)
        while time.time() - t0 < self._startup_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"polyinf serve exited ({self.proc.returncode}): {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        self.ready_s = time.time() - t0
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"polyinf serve not healthy after {self._startup_s:.0f} s: {self.log_tail()}")

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
