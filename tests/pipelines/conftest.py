"""A real S3-compatible server (moto's, in its own process) on a free loopback port."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ops.release.deploy import free_port


@pytest.fixture()
def s3_server(monkeypatch):
    """The server's URL; AWS credentials for it in the environment (moto accepts any)."""
    port = free_port()
    exe = Path(sys.executable).parent / "moto_server"
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            httpx.get(url, timeout=1)
            break
        except httpx.HTTPError:
            assert proc.poll() is None, "moto_server exited"
            time.sleep(0.1)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    yield url
    proc.terminate()
    proc.wait(timeout=10)
