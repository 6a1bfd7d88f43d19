"""Cold start (load weights, build the engine, warm up) against a `forward` hot swap, as a ratio.

    python bench/hot_swap.py                                  # SmolLM2 on CPU
    python bench/hot_swap.py --model llama-3.1-8b --device cuda --dtype bfloat16   # synthetic 8B on a GPU

The swap is timed from apply_variant to the end of the next decode step (new kernels warmed).
Prints figures; asserts nothing about speed.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

GEN_SILU = "import torch\nimport torch.nn.functional as F\n\ndef silu_and_mul(x):\n" \
           "    half = x.shape[-1] // 2\n    return F.silu(x[..., :half]) * x[..., half:]\n"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from engine import EngineConfig, LLMEngine, SamplingParams, resolve
    from engine.variant import VariantSpec

    t0 = time.perf_counter()
    eng = LLMEngine(EngineConfig(source=resolve(args.model), device=args.device, dtype=args.dtype,
                                 num_kv_blocks=256, load_tokenizer=False))
    prompt = list(range(100, 164))
    eng.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    _sync(args.device)
    cold = time.perf_counter() - t0

    eng.add_request(prompt, SamplingParams(max_tokens=64, ignore_eos=True))
    eng.step()
    base = eng.variant
    targets = {
        "forward swap (built-in kernel choice)": dataclasses.replace(
            base, kernels={"silu_and_mul": "triton", "rms_norm": "triton", "fused_add_rms_norm": "triton"}),
        "forward swap (generated source, checked + child smoke run)": dataclasses.replace(
            base, kernels={"silu_and_mul": "generated:bench_act.silu_and_mul"},
            generated_source={"bench_act": GEN_SILU}),
        "forward swap back to reference": base,
    }
    rows = []
    for label, spec in targets.items():
        _sync(args.device)
        t = time.perf_counter()
        eng.apply_variant(spec)
        eng.step()
        _sync(args.device)
        rows.append((label, time.perf_counter() - t))
    print(f"model {args.model} on {args.device} ({args.dtype}); weights loaded in {eng.load_seconds:.2f} s")
    print(f"{'':60}{'seconds':>10}{'% of cold':>11}")
    print(f"{'cold start (load + build + warm-up)':60}{cold:>10.3f}{100.0:>10.1f}%")
    for label, secs in rows:
        print(f"{label:60}{secs:>10.3f}{100 * secs / cold:>10.2f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cold_s": cold, "swaps": dict(rows), "model": args.model, "device": args.device}, f, indent=2)


if __name__ == "__main__":
    main()
