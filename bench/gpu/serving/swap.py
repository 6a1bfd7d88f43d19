"""6. Cold start in a fresh process (python, imports, CUDA init, safetensors load, Triton JIT with an empty
cache, graph capture, first token) against a forward hot swap prepared while serving, on the 8B model."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench.gpu.harness import ENTRY, ROOT, Llama8B, row, section


def cold_start_child(folder: str, variant_json: str, t0: float) -> None:
    """Runs in a fresh process: everything a restart does, until the first token is ready."""
    marks = {"python start + import torch": time.time() - t0}  # the entry point imported torch first
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    marks["CUDA init"] = time.time() - t0
    from engine import EngineConfig, LLMEngine, SamplingParams, resolve
    from engine.config.variant import VariantSpec

    spec = VariantSpec.from_json(json.loads(variant_json))
    cfg = EngineConfig(source=resolve(folder), device="cuda", dtype="bfloat16", num_kv_blocks=512,
                       load_tokenizer=False, variant=spec)
    eng = LLMEngine(cfg)
    torch.cuda.synchronize()
    marks["engine built (weights, JIT, graphs)"] = time.time() - t0
    marks["weights loaded (part of the above)"] = eng.load_seconds
    eng.generate([list(range(1, 129))], SamplingParams(max_tokens=1, ignore_eos=True))
    torch.cuda.synchronize()
    marks["first token"] = time.time() - t0
    print("COLD_START " + json.dumps(marks), flush=True)


def _engine_to_hf(model, cfg) -> dict:
    """The engine's fused weights under Hugging Face names (views, no copies)."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    inter = cfg.intermediate_size
    out = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm,
           "lm_head.weight": model.lm_head}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        w = layer.self_attn.qkv_proj.weight
        out[p + "self_attn.q_proj.weight"] = w[:q]
        out[p + "self_attn.k_proj.weight"] = w[q:q + kv]
        out[p + "self_attn.v_proj.weight"] = w[q + kv:]
        out[p + "self_attn.o_proj.weight"] = layer.self_attn.o_proj.weight
        gu = layer.mlp.gate_up_proj.weight
        out[p + "mlp.gate_proj.weight"] = gu[:inter]
        out[p + "mlp.up_proj.weight"] = gu[inter:]
        out[p + "mlp.down_proj.weight"] = layer.mlp.down_proj.weight
        out[p + "input_layernorm.weight"] = layer.input_layernorm
        out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm
    return out


@section
def cold_start_and_swap(m: Llama8B, spec, tmp: Path):
    from safetensors.torch import save_file

    from engine import SamplingParams

    folder = tmp / "llama8b"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(m.raw))
    t = time.perf_counter()
    save_file({k: v.contiguous() for k, v in _engine_to_hf(m.engine.model, m.mcfg).items()},
              str(folder / "model.safetensors"))
    row("8B safetensors written for the cold start", f"{time.perf_counter() - t:.1f} s (stays in the page cache)")
    colds = {}
    cache = tempfile.mkdtemp(prefix="triton_cold_")  # empty for the first start, filled by it for the second
    for label in ("empty Triton cache", "warm Triton cache"):
        env = {**os.environ, "TRITON_CACHE_DIR": cache, "PYTHONPATH": str(ROOT)}
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-m", ENTRY, "--cold-start", str(folder),
                               "--variant", json.dumps(spec.to_json()), "--t0", repr(t0)],
                              env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("COLD_START ")), None)
        if line is None:
            row(f"8B cold start ({label}) FAILED", (proc.stderr or proc.stdout)[-300:])
            continue
        marks = json.loads(line[len("COLD_START "):])
        colds[label] = marks["first token"]
        row(f"8B cold start in a fresh process, {label}: until the first token",
            f"{marks['first token']:.1f} s (" + ", ".join(f"{k} {v:.1f}" for k, v in marks.items()
                                                          if k != "first token") + ")")
    # forward hot swap: a new attention configuration (never compiled in this process) prepared in a
    # thread while a request keeps decoding, then switched between two steps
    eng = m.engine
    eng.apply_variant(spec)
    other = dataclasses.replace(spec, kernel_params={"attention": {"block_n": 64, "num_warps": 4, "num_stages": 3}})
    rid = eng.add_request(list(range(300, 428)), SamplingParams(max_tokens=1500, ignore_eos=True))
    for _ in range(20):
        eng.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(50):
        eng.step()
    torch.cuda.synchronize()
    step_before = (time.perf_counter() - t) / 50
    box: dict = {}

    def prepare():
        try:
            box["prepared"] = eng.prepare_variant(other)
        except Exception as e:  # reported below
            box["error"] = e

    th = threading.Thread(target=prepare)
    t = time.perf_counter()
    th.start()
    steps = 0
    while th.is_alive():
        eng.step()
        steps += 1
    prep = time.perf_counter() - t
    if "error" in box:
        row("8B hot swap preparation in a thread FAILED", f"{type(box['error']).__name__}: {str(box['error'])[:160]}")
        prepared = None
    else:
        prepared = box["prepared"]
        row("8B forward swap prepared while serving (new attention kernel JIT, warm-up, 4 graphs)",
            f"{prep:.2f} s; {steps} decode steps ran meanwhile ({steps / prep:.0f} tok/s vs "
            f"{1 / step_before:.0f} before)")
    torch.cuda.synchronize()
    t = time.perf_counter()
    eng.apply_variant(other, prepared)
    eng.step()
    torch.cuda.synchronize()
    pause = time.perf_counter() - t
    row("8B forward swap, serving pause (switch between steps + the next step)",
        f"{1e3 * pause:.1f} ms (a step is {1e3 * step_before:.1f} ms)")
    # the same swap done inline (prepare inside apply_variant), back to the first spec, kernels compiled already
    torch.cuda.synchronize()
    t = time.perf_counter()
    eng.apply_variant(spec)
    eng.step()
    torch.cuda.synchronize()
    inline = time.perf_counter() - t
    eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    row("8B forward swap done inline (warm-up + 4 graph captures + next step)", f"{1e3 * inline:.0f} ms")
    for label, cold in colds.items():
        row(f"8B swap / cold start ({label})",
            f"pause {100 * pause / cold:.2f}%, inline {100 * inline / cold:.2f}%"
            + (f", prepared in background {100 * prep / cold:.1f}%" if prepared is not None else ""))
