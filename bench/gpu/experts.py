"""The MoE experts alone at batch 1 (routing, gate/up, down with the sum), over their tiles: the sweeps the MoE
section runs on its model's experts (``--moe-sweep``), and the experts on synthetic weights of 24 layers
(``--only experts``)."""
from __future__ import annotations

import dataclasses

import torch

from bench.gpu.harness import rotating_timed, row, section


def experts_timer(eng, cfg):
    """(us(params), bytes): microseconds per call of the experts alone at batch 1 (``make_moe(**params)``: the
    routing, gate/up and down with the sum), each call on another layer's experts, so none is served from L2;
    and the bytes of weights one call reads."""
    from kernels.moe.moe_triton import make_moe

    k_, xs = cfg.num_experts_per_tok, torch.randn(1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    lgs = [torch.randn(1, cfg.num_experts, device="cuda", dtype=torch.bfloat16) for _ in range(24)]
    mlps = [eng.model.layers[i].mlp for i in range(min(24, cfg.num_hidden_layers))]

    def us(params):
        op = make_moe(**params)
        return 1e6 * rotating_timed([lambda m=m, lg=lg: op(xs, lg, m.w13, m.w2, k_, True) for m, lg in zip(mlps, lgs)])

    return us, (k_ * 3 * cfg.moe_intermediate_size) * cfg.hidden_size * 2


def timed_tiles(sweep: list, us, params: dict, label: str) -> None:
    """Appends (us(params), params) to sweep; a tile that does not compile (registers) is reported instead."""
    try:
        sweep.append((us(params), params))
    except Exception as e:
        row(f"{label} {params}", f"FAILED {type(e).__name__}: {str(e)[:100]}")


def experts_sweep(eng, cfg, form, kernel_params):
    """The experts alone at batch 1 (routing, gate/up, down with the sum), dependent launch, over their tiles
    (``experts_timer``). Returns ``form`` (its kernel parameters ``kernel_params``) with the experts' best
    tiles."""
    timer, moe_bytes = experts_timer(eng, cfg)
    experts_us = lambda params: timer({"decode_split_down": 2, "pdl": 2, **params})  # noqa: E731
    sweep = []
    for bn in (4, 8, 16):
        for bk in (256, 512, 1024, 2048):
            for warps in (4, 8):
                params = dict(decode_block_n=bn, decode_block_k=bk, decode_warps=warps, decode_down_block_n=8,
                              decode_down_block_k=256)
                timed_tiles(sweep, experts_us, params, "MoE experts b=1")
    t0, gu = min(sweep, key=lambda r: r[0])
    current = next((t for t, p_ in sweep if p_["decode_block_n"] == 8 and p_["decode_block_k"] == 256
                    and p_["decode_warps"] == 4), float("nan"))
    row("MoE experts b=1 (routing, gate/up, down + sum; 75.5 MB), gate/up tiles: the current (8, 256, 4 warps) "
        "and the best", f"{current:.1f} us = {moe_bytes / current / 1e3:,.0f} GB/s; best {gu}: {t0:.1f} us = "
        f"{moe_bytes / t0 / 1e3:,.0f} GB/s")
    sweep2 = []
    for dbn in (4, 8, 16):
        for dbk in (256, 1024):
            timed_tiles(sweep2, experts_us, {**gu, "decode_down_block_n": dbn, "decode_down_block_k": dbk},
                        "MoE experts b=1")
    t1, tiles = min(sweep2, key=lambda r: r[0])
    row("MoE experts b=1, then the down tiles: best", f"{tiles}: {t1:.1f} us = {moe_bytes / t1 / 1e3:,.0f} GB/s")
    return [(f"TRITON_MOE_DECODE with the experts' best tiles {tiles}",
             dataclasses.replace(form, kernel_params={**kernel_params, "moe": {**kernel_params["moe"], **tiles}}))]


def one_launch_sweep(eng, cfg, best):
    """The experts in one launch (routing, gate/up, down, sum) alone at batch 1 over their tiles, against the
    current split form (``experts_timer``). Returns the best tiles."""
    experts_us, moe_bytes = experts_timer(eng, cfg)
    current = experts_us(best["moe"])
    sweep = []
    for chunk in (16, 32, 48, 64):
        for bk in (256, 512):
            for warps in (4, 8):
                params = dict(decode_split_down=3, decode_chunk=chunk, decode_block_k=bk, decode_down_block_n=128,
                              decode_warps=warps, pdl=2)
                timed_tiles(sweep, experts_us, params, "MoE experts in one launch b=1")
    if not sweep:
        return None
    t0, tiles = min(sweep, key=lambda r: r[0])
    for dbn in (64, 256, 512):
        timed_tiles(sweep, experts_us, {**tiles, "decode_down_block_n": dbn}, "MoE experts in one launch b=1")
    t1, tiles = min(sweep, key=lambda r: r[0])
    row("MoE experts b=1 (75.5 MB): the current form (routing, gate/up, down + sum: three launches) and in one "
        "launch, the best tiles", f"{current:.1f} us = {moe_bytes / current / 1e3:,.0f} GB/s; one launch "
        f"{ {k: v for k, v in tiles.items() if k != 'pdl'} }: {t1:.1f} us = {moe_bytes / t1 / 1e3:,.0f} GB/s")
    for t_, p_ in sorted(sweep, key=lambda r: r[0])[:6]:
        row(f"  one launch {p_['decode_chunk']} rows, k {p_['decode_block_k']}, down n {p_['decode_down_block_n']}, "
            f"{p_['decode_warps']} warps", f"{t_:.1f} us")
    return {k: v for k, v in tiles.items() if k != "pdl"}


@section
def experts_alone() -> None:
    """The experts alone at batch 1 (routing, gate/up with the activation, down with the sum), on synthetic
    Qwen3-30B-A3B-shaped expert weights of 24 layers (each call on another layer's, so none is served from L2),
    over the tiles; each tile's output first checked against the reference MoE."""
    from kernels.moe.moe import moe_ref
    from kernels.moe.moe_triton import make_moe

    bf = torch.bfloat16
    layers = [(torch.randn(128, 1536, 2048, device="cuda", dtype=bf) * 0.02,
               torch.randn(128, 2048, 768, device="cuda", dtype=bf) * 0.02) for _ in range(24)]
    x = torch.randn(1, 2048, device="cuda", dtype=bf)
    lgs = [torch.randn(1, 128, device="cuda", dtype=bf) for _ in layers]
    nbytes = 8 * 3 * 768 * 2048 * 2
    ref = moe_ref(x, lgs[0], *layers[0], 8, True).float()
    base = {"decode_split_down": 2, "decode_block_k": 2048, "decode_evict": 1, "decode_act": 1, "decode_warps": 4,
            "pdl": 2}
    sweep = []
    for bn in (1, 2, 4):
        for dbn in (8, 16, 32):
            for dbk in (256, 1024):
                params = {**base, "decode_block_n": bn, "decode_down_block_n": dbn, "decode_down_block_k": dbk}
                try:
                    op = make_moe(**params)
                    e = (op(x, lgs[0], *layers[0], 8, True).float() - ref).abs().max().item()
                    if e > 0.02 * ref.abs().max().item():
                        row(f"experts alone b=1 {params}", f"MISMATCH max abs err {e:.4f}")
                        continue
                    t = rotating_timed([lambda w=w, lg=lg: op(x, lg, *w, 8, True) for w, lg in zip(layers, lgs)])
                    sweep.append((t, bn, dbn, dbk))
                except Exception as ex:
                    row(f"experts alone b=1 {params}", f"FAILED {type(ex).__name__}: {str(ex)[:100]}")
    sweep.sort()
    current = next((r for r in sweep if r[1:] == (2, 16, 256)), None)
    row("experts alone b=1 (75.5 MB; checked against the reference), TRITON_MOE_DECODE's tiles (2 + 2 gate/up "
        "rows, down 16 x 256, 4 warps)", f"{1e6 * current[0]:.1f} us = {nbytes / current[0] / 1e9:,.0f} GB/s"
        if current else "n/a")
    for t, bn, dbn, dbk in sweep[:8]:
        row(f"  experts alone b=1: {bn} + {bn} gate/up rows, down {dbn} x {dbk}, 4 warps",
            f"{1e6 * t:.1f} us = {nbytes / t / 1e9:,.0f} GB/s")
