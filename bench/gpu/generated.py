"""Generated kernels on a GPU: the boundary holds compiled, as it does interpreted on a CPU.

Every templated kernel (ops/search/kernel_templates.py) is checked, smoke-run in an isolated child and compiled in
this process, then compared with the plain-torch reference at the model's served shapes (bfloat16 and
float32); a kernel reading far past or before its input reads only zeros (its loads are masked to the
tensor's bounds); a kernel that never finishes fails its smoke run at the time limit; and a model
forward pass with a generated kernel equals the reference forward. Prints one table.

    PYTHONPATH=$PWD python3 -m bench gpu.generated            # a GPU host
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

import torch  # noqa: E402

from bench.lib import cli  # noqa: E402
from bench.lib.table import Table  # noqa: E402

from engine.errors import VariantError  # noqa: E402
from engine.generated.source import load_kernel, materialize, prepare_generated, smoke_in_child  # noqa: E402
from engine.generated.grammar import check_kernel  # noqa: E402
from kernels.generated.launch import REFERENCES, make_launcher, smoke_cases  # noqa: E402
from ops.search.kernel_templates import DEFAULT_TILES, FORMS, KernelChoice  # noqa: E402

TABLE = Table(width=70)
row = TABLE.row
DIMS = {"hidden": 4096, "intermediate": 14336,  # the 8B shape
        "projections": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]}


def templates() -> None:
    for form, (ops, _) in FORMS.items():
        for op in ops:
            c = KernelChoice(op, form, tuple(sorted(DEFAULT_TILES[form].items())))
            t0 = time.perf_counter()
            try:
                fn = prepare_generated(op, c.module, op, c.source(), dict(c.tiles), DIMS, "cuda")
            except VariantError as e:
                row(f"{op} {form}: prepared", f"REFUSED: {str(e)[:120]}")
                continue
            prep = time.perf_counter() - t0
            errs = []
            for dtype in (torch.bfloat16, torch.float32):
                for args in smoke_cases(op, DIMS, torch.Generator(device="cuda").manual_seed(1), "cuda", dtype):
                    got, want = fn(*args), REFERENCES[op](*args)
                    gots, wants = (got, want) if isinstance(want, tuple) else ((got,), (want,))
                    errs.append(max((g.float() - w.float()).abs().max().item() / max(1.0, w.float().abs().max().item())
                                    for g, w in zip(gots, wants)))
            row(f"{op} {form}: prepared (check + child smoke + compile), worst relative error",
                f"{prep:.1f} s, {max(errs):.2e} over {len(errs)} cases (bf16, fp32)")


def bounds() -> None:
    head = "import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
    sig = "def silu_and_mul(x_ptr, out_ptr, D: tl.constexpr, BLOCK_D: tl.constexpr):\n"
    body = ("    row = tl.program_id(0)\n    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)\n"
            "    g = tl.load(x_ptr + {off}, mask=cols < D, other=0.0)\n"
            "    u = tl.load(x_ptr + row * 2 * D + D + cols, mask=cols < D, other=0.0)\n"
            "    tl.store(out_ptr + row * D + cols, g * tl.sigmoid(g) * u, mask=cols < D)\n")
    for name, off in (("1e9 elements past the input", "1000000000 + cols"), ("before the input", "(cols - 4096)")):
        text = head + sig + body.format(off=off)
        bounded = check_kernel("silu_and_mul", "oob", "silu_and_mul", text)
        launch = make_launcher("silu_and_mul", load_kernel(materialize("oob", bounded), bounded, "silu_and_mul"),
                               {"BLOCK_D": 64})
        x = torch.randn(8, 256, device="cuda") + 5
        out = launch(x)
        torch.cuda.synchronize()
        row(f"out-of-bounds read, {name}: what it read", "only zeros (masked)" if torch.count_nonzero(out) == 0
            else f"NONZERO: {torch.count_nonzero(out).item()} elements")
    hang = head + sig + ("    acc = tl.zeros([BLOCK_D], tl.float32)\n"
                         "    for i in range(0, 2147483647):\n        for j in range(0, 2147483647):\n"
                         "            acc = acc * 1.0000001 + 1.0\n"
                         "    tl.store(out_ptr + tl.arange(0, BLOCK_D), acc)\n") + body.format(off="row * 2 * D + cols")
    t0 = time.perf_counter()
    try:
        smoke_in_child("silu_and_mul", materialize("hang", check_kernel("silu_and_mul", "hang", "silu_and_mul", hang)),
                       "silu_and_mul", {"BLOCK_D": 64}, None, "cuda", timeout_s=30)
        row("a kernel that never finishes", "FINISHED (unexpected)")
    except VariantError as e:
        row("a kernel that never finishes", f"refused after {time.perf_counter() - t0:.0f} s: {str(e)[:80]}")


def forward() -> None:
    from engine import EngineConfig, LLMEngine, SamplingParams, VariantSpec, resolve

    c = KernelChoice("act_linear", "matmul_dot", (("BLOCK_K", 64), ("BLOCK_M", 16), ("BLOCK_N", 64)))
    base = LLMEngine(EngineConfig(source=resolve("llama-3.1-8b"), device="cuda", dtype="bfloat16", layers=2,
                                  num_kv_blocks=256, load_tokenizer=False, variant=VariantSpec()))
    prompts = [[1 + (i * 37 + j) % 1000 for j in range(40 + 7 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    ref = [o.token_ids for o in base.generate(prompts, params)]
    base.apply_variant(c.apply(base.variant))
    got = [o.token_ids for o in base.generate(prompts, params)]
    same = sum(a == b for a, b in zip(ref, got))
    row("8B shape (2 layers, bf16): greedy tokens with a generated act_linear vs reference",
        f"{same}/{len(ref)} requests identical")


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    """No options: the three sections run in order."""


def main(args: argparse.Namespace) -> int:
    for section in (templates, bounds, forward):
        try:
            section()
        except Exception as e:  # a failed section must not hide the others
            row(f"{section.__name__}: FAILED", f"{type(e).__name__}: {str(e)[:200]}")
    print("\n" + TABLE.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(__doc__, add_cli_args, main))
