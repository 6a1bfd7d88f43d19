"""Cold start (load weights, build the engine, warm up) against a `forward` hot swap, as a ratio.

    python -m bench hot_swap                                  # SmolLM2 on CPU
    python -m bench hot_swap --model llama-3.1-8b --device cuda --dtype bfloat16   # synthetic 8B on a GPU

Each target variant is swapped to twice, from the same base, while a request is decoding:
- inline: ``apply_variant(spec)`` builds, checks, warms up (and captures) and switches; its wall time;
- prepared: ``prepare_variant(spec)`` runs in a thread while the engine keeps stepping, then
  ``apply_variant(spec, prepared)`` only switches between two steps; its wall time is the serving pause.
On CPU the Triton kernels run in the interpreter, so an inline swap there is mostly one interpreted
warm-up step. Prints figures; asserts nothing about speed.
"""
from __future__ import annotations

import argparse
import sys
import dataclasses
import json
import threading
import time

import torch

from ops.search.kernel_templates import KernelChoice
from bench.lib import cli

GEN_SILU = KernelChoice("silu_and_mul", "silu_tile", (("BLOCK_D", 1024),))  # a generated Triton kernel


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    cli.add_model_args(ap)
    ap.add_argument("--json", default=None)


def main(args: argparse.Namespace) -> int | None:

    from engine import EngineConfig, LLMEngine, SamplingParams, resolve

    t0 = time.perf_counter()
    eng = LLMEngine(EngineConfig(source=resolve(args.model), device=args.device, dtype=args.dtype,
                                 num_kv_blocks=256, load_tokenizer=False))
    prompt = list(range(100, 164))
    eng.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    _sync(args.device)
    cold = time.perf_counter() - t0

    eng.add_request(prompt, SamplingParams(max_tokens=2000, ignore_eos=True))  # decodes throughout
    eng.step()
    base = eng.variant

    def step() -> float:
        _sync(args.device)
        t = time.perf_counter()
        eng.step()
        _sync(args.device)
        return time.perf_counter() - t

    base_step = min(step() for _ in range(3))
    targets = {
        "built-in Triton kernels": dataclasses.replace(
            base, kernels={"silu_and_mul": "triton", "rms_norm": "triton", "fused_add_rms_norm": "triton"}),
        "generated source (checked + child smoke run)": dataclasses.replace(
            base, kernels={"silu_and_mul": "generated:bench_act.silu_and_mul"},
            kernel_params={"silu_and_mul": dict(GEN_SILU.tiles)}, generated_source={"bench_act": GEN_SILU.source()}),
    }
    rows = []
    for label, spec in targets.items():
        _sync(args.device)
        t = time.perf_counter()
        eng.apply_variant(spec)
        inline = time.perf_counter() - t
        step()
        eng.apply_variant(base)
        done: dict = {}
        worker = threading.Thread(target=lambda: done.update(p=eng.prepare_variant(spec)))
        t = time.perf_counter()
        worker.start()
        served = 0
        while worker.is_alive():
            step()
            served += 1
        worker.join()
        prep = time.perf_counter() - t
        _sync(args.device)
        t = time.perf_counter()
        eng.apply_variant(spec, done["p"])
        pause = time.perf_counter() - t
        step()
        eng.apply_variant(base)
        rows.append((label, inline, pause, prep, served))
    print(f"model {args.model} on {args.device} ({args.dtype}); weights loaded in {eng.load_seconds:.2f} s; "
          f"cold start (load + build + warm-up) {cold:.3f} s; a decode step on the base variant {base_step:.3f} s")
    print(f"{'target':48}{'inline s':>10}{'% cold':>8}{'pause s':>10}{'% cold':>8}{'prepared in bg s':>18}"
          f"{'steps meanwhile':>16}")
    for label, inline, pause, prep, served in rows:
        print(f"{label:48}{inline:>10.3f}{100 * inline / cold:>7.2f}%{pause:>10.4f}{100 * pause / cold:>7.3f}%"
              f"{prep:>18.3f}{served:>16}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cold_s": cold, "base_step_s": base_step, "model": args.model, "device": args.device,
                       "swaps": [dict(zip(("target", "inline_s", "pause_s", "prepare_s", "steps_meanwhile"), r))
                                 for r in rows]}, f, indent=2)


if __name__ == "__main__":
    sys.exit(cli.run(__doc__, add_cli_args, main))
