"""Every benchmark answers --help on a machine without a GPU (imports resolve, no CUDA at
import), so a script broken by a change to the packages shows here, not on the GPU host."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_every_bench_script_answers_help():
    """Each benchmark, run as ``python -m bench NAME --help``; ``python -m bench`` lists them all."""
    listing = subprocess.run([sys.executable, "-m", "bench"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    names = [line.split()[0] for line in listing.stdout.splitlines()[1:] if line.startswith("  ")]
    scripts = names  # each one a module with add_cli_args and main (bench/lib/cli.py)
    assert len(scripts) >= 17 and "tuning.tune_vs_static" in scripts and "gpu.suite" in names, listing.stdout
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    procs = {n: subprocess.Popen([sys.executable, "-m", "bench", n, "--help"], cwd=ROOT, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in scripts}
    failed = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        if proc.returncode != 0 or f"usage: python -m bench {name}" not in out:
            failed[name] = (proc.returncode, err[-500:])
    assert not failed, failed
    unknown = subprocess.run([sys.executable, "-m", "bench", "no_such"], cwd=ROOT, capture_output=True, text=True)
    assert unknown.returncode == 2 and "unknown benchmark" in unknown.stderr


@pytest.mark.slow
def test_gpu_scripts_smoke_run_on_the_cpu(tmp_path):
    """The GPU scripts that can take a CPU run there end to end on SmolLM2 (a slice of its layers): the gates on
    the reference form, and a served replay with the default variant, every request answered in full."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    gates = subprocess.run([sys.executable, "-m", "bench", "gpu.gates", "--model", "smollm2", "--device", "cpu", "--dtypes",
                            "float32", "--layers", "1", "--only", "reference"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=600)
    assert gates.returncode == 0, gates.stderr[-2000:]
    assert "| float32 | reference (against itself) | pass |" in gates.stdout, gates.stdout[-2000:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve = subprocess.run([sys.executable, "-m", "bench", "gpu.serving.serve", "--out", str(tmp_path), "--model", "smollm2",
                            "--device", "cpu", "--dtype", "float32", "--reference-kernels", "--requests", "2", "--trace",
                            str(ROOT / "traces" / "AzureLLMInferenceTrace_conv.csv"),
                            "--max-input", "48", "--max-output", "4", "--vocab-size", "49152", "--num-kv-blocks", "256",
                            "--time-scales", "0.5", "--port", str(port)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
    assert serve.returncode == 0, (serve.stdout[-2000:], serve.stderr[-2000:])
    assert serve.stdout.count("every request answered with its requested output length | OK (2/2") == 1, \
        serve.stdout[-2000:]
