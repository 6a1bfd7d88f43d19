"""What every section of the GPU benchmark shares: the rows (printed, appended to OUT/LOG.jsonl as measured,
one table at the end), the timers, the section wrapper that reports a failure and goes on, and the
Llama-3.1-8B-shaped model the 8B sections measure."""
from __future__ import annotations

import dataclasses

import json
import time
import traceback
from pathlib import Path

import torch

from bench.lib.table import Table
from bench.lib.timing import decode_rate

TABLE: Table | None = None  # made at the first row, once OUT and LOG are set
OUT = Path("/tmp")  # set by the entry point (--out)
LOG = "gpu_bench"  # rows go to OUT/LOG.jsonl as measured, the table to OUT/LOG.json at the end
ROOT = Path(__file__).resolve().parents[2]
ENTRY = "bench.gpu.suite"  # the entry module; a fresh process of it (python -m) measures the cold start
DATASHEET_BF16 = 989e12  # H100/H200 SXM dense bf16, FLOP/s
GRAPH_SIZES = (1, 2, 4, 8)  # the decode batches the 8B forms capture


def row(name: str, value: str) -> None:
    global TABLE
    if TABLE is None:
        TABLE = Table(OUT / f"{LOG}.jsonl", width=70, as_object=False)
    TABLE.row(name, value)


def finish() -> None:
    """Prints every row as one table and writes them to OUT/LOG.json."""
    rows = TABLE.rows if TABLE is not None else []
    print("\n" + (TABLE.markdown() if TABLE is not None else "(no rows)"))
    (OUT / f"{LOG}.json").write_text(json.dumps(rows, indent=1))


def timed(fn, iters=10, warmup=3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def graph_timed(fn, calls=20) -> float:
    """Seconds per call of ``fn`` replayed from a CUDA graph of ``calls`` calls (no host launch cost)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return timed(graph.replay, iters=5, warmup=2) / calls


def rotating_timed(calls: list) -> float:
    """Seconds per call of ``calls`` (each on its own copy of the weights, so none is served from L2),
    replayed from one CUDA graph."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    return timed(graph.replay, iters=5, warmup=2) / len(calls)


def section(fn):
    def run(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        except Exception as e:  # keep going: every section reports on its own
            traceback.print_exc()
            row(f"{fn.__name__} FAILED", f"{type(e).__name__}: {str(e)[:160]}")
        finally:
            print(f"[{fn.__name__}: {time.perf_counter() - t:.1f} s]", flush=True)
    run.__name__ = fn.__name__
    return run


def decode_tps(eng, prompt, new) -> float:
    """Batch-1 decode tokens/s after the first token (bench/lib/timing.py), the GPU's queue drained around it."""
    tokens, seconds = decode_rate(eng, prompt, new, torch.cuda.synchronize)
    return tokens / seconds


def _profiled(fn, steps: int) -> tuple[list, float]:
    """(the CUDA events of ``steps`` calls of ``fn`` with GPU time, the wall time per call), after one call that
    warms up."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / steps
    return [e for e in prof.events() if e.device_type == DeviceType.CUDA and e.time_range.elapsed_us() > 0], wall


def kernel_profile(label: str, fn, steps: int = 5, top: int = 14) -> None:
    """GPU time of each kernel ``fn`` launches (one call = one step), from the CUDA profiler: the kernels a
    step spends its time in, their count per step, and the step's time not covered by any kernel."""
    events, wall = _profiled(fn, steps)
    per: dict[str, list[float]] = {}
    for e in events:
        per.setdefault(e.name[:60], []).append(e.time_range.elapsed_us())
    total = sum(sum(v) for v in per.values()) / steps
    row(f"{label}: kernel time per step", f"{total:.0f} us in {sum(len(v) for v in per.values()) // steps} "
        f"kernels; wall {1e6 * wall:.0f} us (not covered by kernels {1e6 * wall - total:.0f} us)")
    for name, v in sorted(per.items(), key=lambda kv: -sum(kv[1]))[:top]:
        row(f"  {label}: {name}", f"{sum(v) / steps:.0f} us/step, {len(v) / steps:.0f} per step, "
            f"{sum(v) / len(v):.1f} us each, {100 * sum(v) / steps / total:.0f}%")


def step_timeline(label: str, fn, steps: int = 5, first: int = 0, count: int = 16) -> None:
    """The kernels of one call of ``fn`` (a step's graph replay) in launch order, from the CUDA profiler: each
    launch's GPU time summed by kernel name over the step, the step's wall time, and launches ``first`` to
    ``first + count`` of the last step with their start after the previous one's end (negative: they overlap, as
    a dependent launch's do; its time then includes the wait)."""
    events, wall = _profiled(fn, steps)
    ev = sorted(((e.time_range.start, e.time_range.end, e.name) for e in events), key=lambda e: e[0])
    per_step = len(ev) // steps
    last = ev[-per_step:]
    by_name: dict[str, list[float]] = {}
    for start, end, name in last:
        by_name.setdefault(name[:48], []).append(end - start)
    span = last[-1][1] - last[0][0]
    row(f"{label}: one step", f"{per_step} launches over {span:.0f} us (first start to last end); wall per step "
        f"{1e6 * wall:.0f} us; " + "; ".join(f"{n} {sum(v):.0f} us / {len(v)} ({sum(v) / len(v):.2f} each)"
                                             for n, v in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:8]))
    seq, prev_end = [], None
    for start, end, name in last[first:first + count]:
        gap = "" if prev_end is None else f" @{start - prev_end:+.1f}"
        seq.append(f"{name[:28]} {end - start:.1f}{gap}")
        prev_end = end
    row(f"{label}: launches {first}-{first + count}", "; ".join(seq))


class Llama8B:
    """The transformers model with random bf16 weights, and our engine assembled from the same tensors."""

    def __init__(self) -> None:
        import transformers as tf
        from engine import EngineConfig, LLMEngine
        from engine.config.model_config import ModelConfig
        from engine.core.llm_engine import LoadedModel
        from engine.loader.model_source import PRESETS_DIR, resolve
        from engine.loader.weights import assemble

        self.raw = json.loads((PRESETS_DIR / "llama-3.1-8b.json").read_text())
        hf_cfg = tf.LlamaConfig(**{k: v for k, v in self.raw.items() if k != "architectures"})
        torch.manual_seed(0)
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):
            self.hf = tf.LlamaForCausalLM(hf_cfg).eval()
        torch.set_default_dtype(torch.float32)
        with torch.no_grad():
            for p_ in self.hf.parameters():  # transformers initialises norms to 1; spread them as trained ones are
                if p_.dim() == 1:
                    p_.add_(torch.randn_like(p_) * 0.05)
        self.mcfg = ModelConfig.from_hf_dict(self.raw)
        t0 = time.perf_counter()
        model = assemble(self.mcfg, self.hf.state_dict().items(), torch.device("cuda"), torch.bfloat16)
        self.loaded = LoadedModel(self.mcfg, model, None, time.perf_counter() - t0)
        self.config = EngineConfig(source=resolve("llama-3.1-8b"), device="cuda", dtype="bfloat16", num_kv_blocks=512,
                                   load_tokenizer=False)
        self.engine = LLMEngine(self.config, self.loaded)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.embed_bytes = model.embed_tokens.weight.numel() * 2


def with_mma(spec, mma: int = 1, min_numel: int = 0):
    """``spec`` with its quantized projections on the tensor-core kernel from ``mma`` rows (autotuned tiles);
    ``min_numel``: at one row, only weights of that many elements (the smaller ones: the GEMV)."""
    from engine.config.presets import TRITON_GEMV

    params = {op: dict(p) for op, p in spec.kernel_params}
    for op in TRITON_GEMV:
        if dict(spec.kernels).get(op) == "triton":
            params[op] = {**params.get(op, {}), "mma": mma, "mma_min_numel": min_numel}
    return dataclasses.replace(spec, kernel_params=params)
