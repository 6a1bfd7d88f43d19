"""Served latency on a GPU: `polyinf serve` with the Llama-3.1-8B-shaped model (synthetic bf16 weights)
and the variant the tuner chose (Triton kernels + CUDA graphs), then `polyinf replay` of the Azure
conversation slice at three request rates. Each replay checks that every request was answered with
exactly its requested number of output tokens.

    PYTHONPATH=$PWD python3 -m bench gpu.serving.serve --out $OUT

A GPU host without the serving packages installs them from wheels carried in bench/wheels
(`pip download` them there first; the folder is ignored by git).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench.lib import cli
from bench.lib.server import Server  # noqa: E402
from bench.lib.table import Table

ROOT = Path(__file__).resolve().parents[3]


def ensure_serving_packages(deps: Path) -> dict:
    env = dict(os.environ)
    try:
        import fastapi  # noqa: F401
        import openai  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
        return env
    except ImportError:
        pass
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(ROOT / "bench/wheels"),
                    "--target", str(deps), "fastapi", "uvicorn", "openai", "prometheus-client"], check=True)
    sys.path.append(str(deps))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", ""), str(deps)])
    return env


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", type=Path, default=Path("/tmp"))
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--trace", type=Path, default=ROOT / "bench/data/azure_conv_400.csv")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-input", type=int, default=2048)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--time-scales", type=float, nargs="+", default=[1.0, 0.25, 0.1])
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--vocab-size", type=int, default=128256)
    ap.add_argument("--num-kv-blocks", type=int, default=8192)
    ap.add_argument("--reference-kernels", action="store_true", help="the default variant (a CPU smoke run)")


def main(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    env = ensure_serving_packages(Path("/tmp/polyinf-serving-deps"))
    from engine.config.presets import preset_variant
    from engine.config.variant import VariantSpec

    variant = preset_variant("triton-paged", name="tuned: triton + graphs",
                             cuda_graph_batch_sizes=(1, 2, 4, 8, 16, 32, 64))
    if args.reference_kernels:
        variant = VariantSpec(name="default")
    vfile = args.out / "variant.json"
    vfile.write_text(json.dumps(variant.to_json()))
    server = Server(["--model", args.model, "--device", args.device, "--dtype", args.dtype, "--variant", str(vfile),
                     "--num-kv-blocks", str(args.num_kv_blocks), "--served-model-name", "llama8b"],
                    args.out / "server.log", env=env, port=args.port)
    url = server.url
    table = Table()
    try:
        server.start()
    except RuntimeError as e:
        print(e)
        return 1
    try:
        table.row("server ready (load synthetic 8B, warm-up, graph capture)", f"{server.ready_s:.1f} s")
        from ops.traffic.traces import load_trace

        records = load_trace(args.trace)[: args.requests]
        expected_out = sum(max(1, min(r.output_tokens, args.max_output)) for r in records)
        for ts in args.time_scales:
            res = args.out / f"replay_{ts}.json"
            cmd = [sys.executable, "-m", "pipelines.cli", "replay", "--trace", str(args.trace), "--base-url",
                   url + "/v1", "--model", "llama8b", "--vocab-size", str(args.vocab_size), "--max-requests", str(args.requests),
                   "--time-scale", str(ts), "--max-input", str(args.max_input), "--max-output", str(args.max_output),
                   "--slo-ttft-ms", "1000", "--slo-tpot-ms", "50", "--json", str(res)]
            p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
            print(p.stdout, p.stderr[-2000:], flush=True)
            d = json.loads(res.read_text())
            ok = d["completed"] == d["requests"] == len(records) and d["total_output_tokens"] == expected_out
            table.row(f"replay x{ts}: every request answered with its requested output length",
                         f"{'OK' if ok else 'NO'} ({d['completed']}/{d['requests']}, {d['total_output_tokens']}"
                         f"/{expected_out} tokens)")
            table.row(f"replay x{ts} arrivals: served req/s, output tok/s",
                         f"{d['completed']}/{d['requests']} done; {d['request_throughput']:.2f} req/s, "
                         f"{d['output_throughput']:.0f} tok/s, goodput {d['goodput']:.2f}")
            table.row(f"replay x{ts}: TTFT p50/p90/p99 ms",
                         "/".join(f"{d['ttft_ms'][k]:.0f}" for k in ("p50", "p90", "p99")))
            table.row(f"replay x{ts}: TPOT p50/p90/p99 ms",
                         "/".join(f"{d['tpot_ms'][k]:.1f}" for k in ("p50", "p90", "p99")))
    finally:
        server.stop()
    print("\n" + table.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(__doc__, add_cli_args, main))
