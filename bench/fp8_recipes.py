"""FP8 quantization recipes on real weights: which recipe lets SmolLM2 pass the FP8 gate, and why the default fails.

The FP8 weight variant (engine/model/precision.py) quantizes every dense projection, the lm_head included, to e4m3
with one scale per output channel; on a GPU the activations are quantized to e4m3 per row as well (the FP8
GEMM's input), on a CPU they stay in float32. On SmolLM2-135M that fails the gate (max |dlogit| 5.14 against
3). This study measures the gate's figures (teacher-forced top-1 agreement, max |dlogit|, mean KL along the
reference's tokens, on the gate's shipped prompts) for each recipe:

- ``bf16 weights``: the weights only rounded to bfloat16 (no quantization): the figures' floor;
- ``w8``: the variant today on a CPU: e4m3 weights, one scale per output channel, activations unquantized;
- ``w8a8``: the same weights and the activations quantized per token (row) to e4m3: the GPU's numerics;
- ``w8a8 head``: the lm_head left in the checkpoint's precision;
- ``w8a8 g128 head``: one weight scale per 128 input columns of each output channel (finer than per channel);
- ``w8a8 mlp only``: only the MLP's projections (gate/up and down, most of the bytes) in FP8;
- ``w8a8 head +k``: the lm_head and the k decoder layers the sensitivity sweep ranks worst kept in the
  checkpoint's precision (the smallest k that passes, searched up to --max-keep);
- ``int8``: per-channel int8 weights (the variant that passes), for comparison.

The sensitivity sweep quantizes one target at a time (each decoder layer's four projections, or the lm_head)
with ``w8a8`` and ranks them by the mean KL it alone causes. Each recipe's weights are quantized and
dequantized here ("fake quantization": the values the kernels would compute with, in float32) and served by
the engine's reference kernels, so the figures are the recipe's numerics, not a kernel's. The weight error
column is the relative RMS error over all dense projections (kept ones count as exact).

    .venv/bin/python -m bench fp8_recipes                 # SmolLM2 on the CPU, about 3 minutes
    .venv/bin/python -m bench fp8_recipes --json /tmp/fp8_recipes.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402

from bench.lib import cli

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def fake_weight(w: torch.Tensor, kind: str, group: int | None = None) -> torch.Tensor:
    """w quantized (symmetric, per output channel, or per ``group`` input columns of it) and dequantized."""
    wf = w.detach().to(torch.float32)
    n, k = wf.shape
    g = group if group and k % group == 0 else k
    blocks = wf.reshape(n, k // g, g)
    qmax = 127.0 if kind == "int8" else FP8_MAX
    scale = (blocks.abs().amax(dim=2, keepdim=True) / qmax).clamp(min=1e-12)
    scaled = blocks / scale
    q = scaled.round().clamp(-127, 127) if kind == "int8" else scaled.to(FP8).to(torch.float32)
    return (q * scale).reshape(n, k).to(w.dtype)


def fake_rows(x: torch.Tensor) -> torch.Tensor:
    """x (T, K) quantized to e4m3 per row and dequantized: what an FP8 GEMM's input holds."""
    xf = x.to(torch.float32)
    s = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return ((xf / s).to(FP8).to(torch.float32) * s).to(x.dtype)


class Recipes:
    """Installs a recipe's fake-quantized weights (and activation rounding) under the engine's weight-precision
    hook: ``engine.model.precision.quantized_weights`` returns this table, ``kernels.linear.linear.qlinear`` this linear."""

    def __init__(self, model):
        import engine.model.precision as precision
        import kernels.linear.linear as linear
        from kernels.linear.quant import QuantizedWeight

        self.precision, self.linear, self.QW = precision, linear, QuantizedWeight
        self.model = model
        self.table: dict = {}
        self.act = False
        self._orig = (precision.quantized_weights, linear.qlinear)
        precision.quantized_weights = lambda model, kind: self.table
        linear.qlinear = self._qlinear

    def _qlinear(self, x, qw, bias=None, **kw):
        x = fake_rows(x) if self.act else x
        return torch.nn.functional.linear(x, qw.dequantized, bias)

    def close(self) -> None:
        self.precision.quantized_weights, self.linear.qlinear = self._orig

    def targets(self) -> dict[str, list[tuple[str, torch.Tensor]]]:
        """Name -> (part, weight): each decoder layer's dense projections ("attn": QKV and output, "mlp": gate/up
        and down), and the lm_head."""
        from engine.model.transformer import MLP

        out = {}
        for i, layer in enumerate(self.model.layers):
            ws = [("attn", layer.self_attn.qkv_proj.weight), ("attn", layer.self_attn.o_proj.weight)]
            if isinstance(layer.mlp, MLP):
                ws += [("mlp", layer.mlp.gate_up_proj.weight), ("mlp", layer.mlp.down_proj.weight)]
            out[f"layer {i}"] = ws
        out["lm_head"] = [("head", self.model.lm_head_weight())]
        return out

    def set(self, kind: str, act: bool, group: int | None, keep: set[str], only: set[str] | None = None
            ) -> tuple[float, float]:
        """Installs a recipe (``keep``: target names or parts left in the checkpoint's precision; ``kind``
        "bfloat16": the weights rounded to bfloat16, a floor for the figures). Returns the relative RMS error
        over all dense weights and the share of their elements quantized."""
        self.table, self.act = {}, act
        err = tot = 0.0
        quantized = elements = 0
        for name, ws in self.targets().items():
            for part, w in ws:
                tot += float(w.double().pow(2).sum())
                elements += w.numel()
                if name in keep or part in keep or (only is not None and name not in only):
                    continue
                f = w.to(torch.bfloat16).to(w.dtype) if kind == "bfloat16" else fake_weight(w, kind, group)
                qw = self.QW("fp8" if kind == "bfloat16" else kind, torch.empty(0), torch.empty(0), w.dtype,
                             dequantized=f)
                self.table[id(w)] = qw
                err += float((f.double() - w.double()).pow(2).sum())
                quantized += w.numel()
        return (math.sqrt(err / tot) if tot else 0.0), quantized / max(1, elements)


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=12, help="tokens per gate prompt (the gate's own)")
    ap.add_argument("--max-keep", type=int, default=6, help="most decoder layers kept in the checkpoint's precision")
    ap.add_argument("--json", type=Path, help="also write the figures here")


def main(args: argparse.Namespace) -> int:

    from checks.engines import GateSettings, factory_for, generate_tokens
    from checks.prompts import shipped_prompts
    from checks.quality import _stack, forced_agreement
    from checks.report import PRECISION_THRESHOLDS
    from engine import EngineConfig, LLMEngine, VariantSpec, resolve
    from engine.config.variant import REFERENCE_VARIANT

    t0 = time.perf_counter()
    base = LLMEngine(EngineConfig(source=resolve(args.model), device="cpu", dtype=args.dtype, num_kv_blocks=8))
    settings = GateSettings(num_kv_blocks=512, enable_prefix_caching=False)
    ref = factory_for(base, REFERENCE_VARIANT)(settings)
    prompts = shipped_prompts(ref)
    ref_tokens, ref_logits = generate_tokens(ref, prompts, args.max_tokens, record_logits=True)
    lengths = [len(r) for r in ref_logits]
    vocab = ref_logits[0][0].shape[-1]
    ref_stack = _stack(ref_logits, lengths, vocab)
    limits = PRECISION_THRESHOLDS["fp8"]
    rec = Recipes(base.model)

    def figures(kind: str) -> dict:
        cand = factory_for(base, VariantSpec(weight_dtype=kind))(settings)
        _, logits = generate_tokens(cand, prompts, args.max_tokens, forced=ref_tokens, record_logits=True)
        stack = _stack(logits, lengths, vocab)
        pr, pc = torch.log_softmax(ref_stack.double(), -1), torch.log_softmax(stack.double(), -1)
        kl = float((pr.exp() * (pr - pc)).sum(-1).mean())
        fa = forced_agreement(ref_stack, stack, 0.0, getattr(torch, args.dtype))
        d = float((ref_stack - stack).abs().max())
        return {"agreement": fa.agreement, "max_dlogit": d, "mean_kl": kl,
                "passed": fa.agreement >= limits.min_greedy_agreement and d <= limits.max_abs_logit_delta
                and kl <= limits.max_mean_kl}

    rows = []

    def run(name: str, kind: str, act: bool, group: int | None, keep: set[str]) -> dict:
        err, share = rec.set(kind, act, group, keep)
        row = {"recipe": name, "weight_error": err, "quantized_share": share, "kept": sorted(keep),
               **figures("int8" if kind == "int8" else "fp8")}
        rows.append(row)
        print(f"{name:24} weight error {err:.4f}  quantized {share:.2f}  agreement {row['agreement']:.3f}  max |dlogit| "
              f"{row['max_dlogit']:.2f}  mean KL {row['mean_kl']:.4f}  {'pass' if row['passed'] else 'fail'}",
              flush=True)
        return row

    try:
        run("bf16 weights (a floor)", "bfloat16", False, None, set())
        run("w8", "fp8", False, None, set())
        run("w8a8", "fp8", True, None, set())
        run("w8a8 head", "fp8", True, None, {"lm_head"})
        run("w8a8 g128 head", "fp8", True, 128, {"lm_head"})
        run("w8a8 mlp only", "fp8", True, None, {"lm_head", "attn"})
        # sensitivity: each target alone in w8a8
        sens = {}
        for name in rec.targets():
            rec.set("fp8", True, None, set(), only={name})
            sens[name] = figures("fp8")
        ranked = sorted((n for n in sens if n != "lm_head"), key=lambda n: sens[n]["mean_kl"], reverse=True)
        print("sensitivity (w8a8, one target alone; mean KL, max |dlogit|): " + ", ".join(
            f"{n} {sens[n]['mean_kl']:.4f} {sens[n]['max_dlogit']:.2f}" for n in ["lm_head", *ranked[:8]]), flush=True)
        for k in range(1, args.max_keep + 1):
            row = run(f"w8a8 head +{k}", "fp8", True, None, {"lm_head", *ranked[:k]})
            if row["passed"]:
                break
        run("int8 (w8)", "int8", False, None, set())
    finally:
        rec.close()
    print()
    print(f"| recipe | weight error (rel. RMS) | share quantized | kept in {args.dtype} | agreement | max \\|dlogit\\| | mean KL | gate |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        kept = ", ".join(r["kept"]) or "-"
        print(f"| {r['recipe']} | {r['weight_error']:.4f} | {r['quantized_share']:.2f} | {kept} | {r['agreement']:.3f} | {r['max_dlogit']:.2f} | "
              f"{r['mean_kl']:.4f} | {'pass' if r['passed'] else 'fail'} |")
    print(f"model {args.model} ({args.dtype}, CPU), {len(prompts)} gate prompts x {args.max_tokens} tokens, "
          f"FP8 limits: agreement >= {limits.min_greedy_agreement}, max |dlogit| <= {limits.max_abs_logit_delta}, "
          f"mean KL <= {limits.max_mean_kl}; {time.perf_counter() - t0:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "sensitivity": sens}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(__doc__, add_cli_args, main))
