"""Experiment throughput: variants evaluated per minute on the fast tier, hot-swapping each variant
into one engine against building a fresh engine (weights loaded again) per variant.

    .venv/bin/python -m bench tuning.tune_throughput [--variants 6] [--model smollm2]
    PYTHONPATH=$PWD python3 -m bench tuning.tune_throughput --model llama-3.1-8b --device cuda --dtype bfloat16 \
        --trace bench/data/azure_conv_400.csv --fast-layers 2        # a GPU host
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from engine.config.variant import VariantSpec  # noqa: E402
from ops.search.board import Board  # noqa: E402
from ops.measure.hardware import probe  # noqa: E402
from ops.search.config import FAST, SearchConfig  # noqa: E402
from ops.search.worker import Workbench, work  # noqa: E402
from bench.lib import cli  # noqa: E402


def variants(n: int) -> list[VariantSpec]:
    base = VariantSpec(name="baseline (default)")
    knobs = [{"max_num_seqs": 8}, {"max_num_batched_tokens": 512}, {"block_size": 32}, {"prefill_chunk_size": 64},
             {"enable_prefix_caching": False}, {"max_num_seqs": 16, "max_num_batched_tokens": 1024},
             {"max_num_seqs": 4}, {"block_size": 32, "max_num_seqs": 32}]
    return [base] + [dataclasses.replace(base, name=str(k), **k) for k in knobs[: n - 1]]


def run(cfg: SearchConfig, vs: list[VariantSpec], fresh: bool, board_path: str) -> tuple[float, int]:
    board = Board(board_path)
    search = f"throughput-{'fresh' if fresh else 'swap'}-{time.time_ns()}"
    board.create_search(search, cfg.to_json())
    for v in vs:
        board.enqueue(search, v, FAST, "bench", "experiment throughput")
    bench = Workbench(cfg, probe(cfg.device, size_mb=64), fresh=fresh)
    t = time.perf_counter()
    stats = work(board, search, bench, FAST)
    return time.perf_counter() - t, stats.evaluated


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--trace", default=str(ROOT / "traces/AzureLLMInferenceTrace_conv.csv"))
    ap.add_argument("--variants", type=int, default=6)
    ap.add_argument("--fast-layers", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-input", type=int, default=128)
    ap.add_argument("--max-output", type=int, default=16)
    ap.add_argument("--board", default="/tmp/polyinf-throughput.sqlite")


def main(args: argparse.Namespace) -> int:
    cfg = SearchConfig(model=args.model, trace=args.trace, device=args.device, dtype=args.dtype,
                       requests=args.requests, max_input=args.max_input, max_output=args.max_output,
                       fast_layers=args.fast_layers, fast_repeats=3)
    vs = variants(args.variants)
    swap_s, swap_n = run(cfg, vs, False, args.board)
    fresh_s, fresh_n = run(cfg, vs, True, args.board)
    swap_rate, fresh_rate = 60 * swap_n / swap_s, 60 * fresh_n / fresh_s
    print(f"\n{'':34}{'variants':>9}{'seconds':>9}{'per minute':>12}")
    print(f"{'hot swap into one engine':34}{swap_n:>9}{swap_s:>9.1f}{swap_rate:>12.1f}")
    print(f"{'fresh engine per variant':34}{fresh_n:>9}{fresh_s:>9.1f}{fresh_rate:>12.1f}")
    print(f"{'ratio':34}{'':>9}{'':>9}{swap_rate / fresh_rate:>11.2f}x")
    print(f"(fast tier, {args.fast_layers} layers of {args.model} on {args.device}; the swap side includes its one "
          f"engine build)")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(__doc__, add_cli_args, main))
