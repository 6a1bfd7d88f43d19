"""Every benchmark script with options answers --help on a machine without a GPU (imports resolve, no CUDA at
import), so a script broken by a change to the packages shows here, not on the GPU host."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_bench_script_answers_help():
    scripts = sorted(p for p in (ROOT / "bench").glob("*.py") if "argparse" in p.read_text())
    assert len(scripts) >= 8
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    procs = {p.name: subprocess.Popen([sys.executable, str(p), "--help"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True) for p in scripts}
    failed = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        if proc.returncode != 0 or "usage:" not in out:
            failed[name] = (proc.returncode, err[-500:])
    assert not failed, failed
