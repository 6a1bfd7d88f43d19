"""Secrets reach no child process, log line, capture record or error body; isolated children have no network."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from engine.generated.isolation import isolated_env, project_env, run_isolated, without_secrets

SECRETS = {"OPENAI_API_KEY": "sk-live-0123456789abcdef", "AWS_SECRET_ACCESS_KEY": "aws-secret-0123456789",
           "POLYINF_ADMIN_TOKEN": "admin-token-0123456789", "DB_PASSWORD": "hunter2-0123456789",
           "HF_TOKEN": "hf_0123456789abcdef"}
TINY = Path(__file__).parent / "tiny_moe"


def test_an_isolated_child_sees_none_of_the_parents_secrets(monkeypatch):
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    env = isolated_env()
    assert not set(SECRETS) & set(env)
    r = run_isolated([sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"], 60)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    assert not any(v in json.dumps(seen) for v in SECRETS.values())
    assert seen["HOME"] == seen["TMPDIR"] and "polyinf-isolated-" in seen["HOME"]
    assert not Path(seen["HOME"]).exists()  # the private directory is gone with the child
    kept = without_secrets()
    assert not set(SECRETS) & set(kept) and "PATH" in kept


def test_a_child_running_the_projects_code_gets_the_project_on_its_path_and_no_secret(monkeypatch, tmp_path):
    """``project_env``: the environment of the project's own children (a server, the live load client, board
    workers): no secret of this process, only the one given to it, and this project importable first."""
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    env = project_env({"POLYINF_ADMIN_TOKEN": "given-0123456789"})
    code = "import json, os, engine; print(json.dumps([dict(os.environ), engine.__file__]))"
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    seen, engine_file = json.loads(r.stdout)
    assert not any(v in r.stdout for v in SECRETS.values())
    assert seen["POLYINF_ADMIN_TOKEN"] == "given-0123456789" and "PATH" in seen
    root = Path(__file__).resolve().parents[2]
    assert seen["PYTHONPATH"].split(os.pathsep) == [str(root), str(tmp_path)]
    assert Path(engine_file).resolve().is_relative_to(root)
    monkeypatch.delenv("PYTHONPATH")
    assert project_env()["PYTHONPATH"] == str(root)


def test_an_isolated_child_has_no_network():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        code = ("import socket, sys; from engine.generated.isolation import confine; ok = confine()['network_namespace']\n"
                f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected', ok)\n"
                "except OSError as e:\n    print('refused', ok, type(e).__name__)")
        r = run_isolated([sys.executable, "-c", code], 60)
    assert r.stdout.startswith("refused True"), r.stdout + r.stderr


def test_a_hung_child_is_killed_with_everything_it_started():
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
            "print(p.pid, flush=True); time.sleep(600)")
    t0 = time.perf_counter()
    r = run_isolated([sys.executable, "-c", code], 3)
    assert r.timed_out and time.perf_counter() - t0 < 30
    grandchild = int(r.stdout.split()[0])
    time.sleep(0.5)
    assert not Path(f"/proc/{grandchild}").exists() or "Z" in Path(f"/proc/{grandchild}/stat").read_text().split()[2]


def test_the_server_keeps_its_token_out_of_children_logs_captures_and_errors(tmp_path, monkeypatch):
    from ops.release.deploy import ServerProcess

    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    cap = tmp_path / "capture"
    server = ServerProcess(["--model", str(TINY), "--synthetic", "--num-kv-blocks", "64"], "tiny", cap)
    try:
        pid = server.proc.pid
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
        environ = Path(f"/proc/{pid}/environ").read_bytes().decode()
        assert server.token not in cmdline  # any local user can read a command line
        assert not any(v in environ for v in SECRETS.values())  # the parent's secrets stay with the parent
        assert f"POLYINF_ADMIN_TOKEN={server.token}" in environ  # its own token, in its environment
        bodies = []
        auth = {"Authorization": f"Bearer {server.token}"}
        for headers in ({"Authorization": "Bearer " + server.token[:-1]}, {"Authorization": server.token}, {}):
            r = httpx.get(server.url + "/admin/variant", headers=headers)
            assert r.status_code == 401
            bodies.append(r.text)
        r = httpx.post(server.url + "/v1/completions", headers=auth, json={
            "model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True, "user": server.token})
        assert r.status_code == 200
        bad = httpx.post(server.url + "/v1/completions", headers=auth, json={"model": server.token, "prompt": [1]})
        assert bad.status_code == 404
        bodies.append(bad.text.replace(server.token, ""))  # the client's own model name is echoed, nothing else
        spec = {**httpx.get(server.url + "/admin/variant", headers=auth).json()["active"]}
        spec.pop("variant_id")
        spec.update(kernels={"silu_and_mul": "generated:m.silu_and_mul"},
                    generated_source={"m": "import os\nprint(os.environ)\n"})
        r = httpx.post(server.url + "/admin/variant", headers=auth, json=spec, timeout=60)
        assert r.status_code == 422
        bodies.append(r.text)
    finally:
        server.stop()
    log = server.log_text()
    for text in (*bodies, log, *(p.read_text() for p in cap.iterdir())):
        assert server.token not in text
        assert not any(v in text for v in SECRETS.values())
    assert len([ln for p in cap.iterdir() for ln in p.read_text().splitlines()]) == 1
