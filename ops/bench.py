"""Measuring variants: the slow tier (a trace slice replayed through the engine) and the fast tier
(step times of the shape mix a traffic profile implies, on a few layers).

Both return BenchResult (design section 3). A measurement is a median over repeats with its
spread (max - min); a difference smaller than the spread is no difference.
"""
from __future__ import annotations

import platform
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.trace_record import TraceRecord
from ops.traces import percentile


@dataclass
class BenchResult:
    variant_id: str
    tier: str  # "fast" | "slow"
    layers: int
    trace_id: str  # the trace slice or shape mix measured
    output_tok_s: float
    total_tok_s: float
    ttft_p50: float = 0.0
    ttft_p90: float = 0.0
    ttft_p99: float = 0.0
    tpot_p50: float = 0.0
    tpot_p90: float = 0.0
    tpot_p99: float = 0.0
    e2e_p50: float = 0.0
    e2e_p90: float = 0.0
    e2e_p99: float = 0.0
    goodput: float = 0.0  # requests/s meeting the SLO
    repeats: int = 1
    spread: float = 0.0  # max - min of output_tok_s over repeats
    hardware: str = ""
    wall_s: float = 0.0
    step_times_ms: dict[str, float] = field(default_factory=dict)  # fast tier: shape -> median step time
    goodput_spread: float = 0.0  # max - min of goodput over repeats
    # slow tier: every engine step of the median run as [new tokens, KV tokens, sequences, attended pairs, seconds]
    step_samples: list[list[float]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def hardware_label(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()} cpu x{torch.get_num_threads()}"


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 2.0
    tpot_s: float = 0.2


def _replay_once(engine: LLMEngine, records: list[TraceRecord], prompts: list[list[int]], max_output: int | None,
                 time_scale: float, slo: SLO) -> dict:
    """Adds each request when its (scaled) arrival time has passed, steps the engine, times every request."""
    t0 = records[0].arrival_s
    pending = list(range(len(records)))
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, tuple[float, int]] = {}
    run: dict[str, int] = {}  # tokens run per request so far (cached prefix included)
    samples: list[list[float]] = []
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and (records[pending[0]].arrival_s - t0) * time_scale <= now:
            i = pending.pop(0)
            out = records[i].output_tokens if max_output is None else min(records[i].output_tokens, max_output)
            rid = engine.add_request(prompts[i], SamplingParams(max_tokens=max(1, out), ignore_eos=True))
            arrival[rid] = time.perf_counter()
        if not engine.has_unfinished():
            time.sleep(max(0.0, (records[pending[0]].arrival_s - t0) * time_scale - now))
            continue
        ts = time.perf_counter()
        outs = engine.step()
        te = time.perf_counter()
        shape = [0, 0, len(outs), 0, te - ts]
        for o in outs:
            before = run.get(o.request_id, o.num_cached_tokens)
            now_run = o.num_cached_tokens + o.num_tokens_run
            n = max(0, now_run - before)
            run[o.request_id] = now_run
            shape[0] += n
            shape[1] += now_run
            shape[3] += n * (before + (n + 1) // 2)
        if shape[0]:
            samples.append(shape)
        for o in outs:
            t = te
            if o.token_ids and o.request_id not in first:
                first[o.request_id] = t
            if o.finished:
                done[o.request_id] = (t, len(o.token_ids))
    wall = time.perf_counter() - start
    ttft = {r: first[r] - arrival[r] for r in done}
    e2e = {r: done[r][0] - arrival[r] for r in done}
    tpot = {r: (done[r][0] - first[r]) / (done[r][1] - 1) for r in done if done[r][1] > 1}
    out_tokens = sum(n for _, n in done.values())
    in_tokens = sum(len(p) for p in prompts)
    good = sum(1 for r in done if ttft[r] <= slo.ttft_s and tpot.get(r, 0.0) <= slo.tpot_s)
    return {"wall": wall, "out": out_tokens, "in": in_tokens, "ttft": list(ttft.values()),
            "tpot": list(tpot.values()), "e2e": list(e2e.values()), "good": good, "samples": samples}


def slow_tier(engine: LLMEngine, records: list[TraceRecord], prompts: list[list[int]], trace_id: str,
              repeats: int = 3, time_scale: float = 1.0, max_output: int | None = None, slo: SLO = SLO()) -> BenchResult:
    """Replays the slice ``repeats`` times (prefix cache dropped between runs) and reports medians."""
    if not records or len(records) != len(prompts):
        raise ValueError("slow_tier needs one prompt per trace record")
    runs = []
    t0 = time.perf_counter()
    for _ in range(repeats):
        engine.block_manager.reset_prefix_cache()
        runs.append(_replay_once(engine, records, prompts, max_output, time_scale, slo))
    rates = [r["out"] / r["wall"] for r in runs]
    mid = sorted(range(repeats), key=lambda i: rates[i])[repeats // 2]
    m = runs[mid]
    return BenchResult(
        variant_id=engine.variant.variant_id, tier="slow", layers=engine.model_config.num_hidden_layers,
        trace_id=trace_id, output_tok_s=statistics.median(rates),
        total_tok_s=(m["out"] + m["in"]) / m["wall"],
        ttft_p50=percentile(m["ttft"], .5), ttft_p90=percentile(m["ttft"], .9), ttft_p99=percentile(m["ttft"], .99),
        tpot_p50=percentile(m["tpot"], .5), tpot_p90=percentile(m["tpot"], .9), tpot_p99=percentile(m["tpot"], .99),
        e2e_p50=percentile(m["e2e"], .5), e2e_p90=percentile(m["e2e"], .9), e2e_p99=percentile(m["e2e"], .99),
        goodput=m["good"] / m["wall"], repeats=repeats, spread=max(rates) - min(rates),
        goodput_spread=max(r["good"] / r["wall"] for r in runs) - min(r["good"] / r["wall"] for r in runs),
        step_samples=m["samples"],
        hardware=hardware_label(engine.device), wall_s=time.perf_counter() - t0,
    )


def fast_tier(engine: LLMEngine, prefill_lengths: list[int], decode_batches: list[tuple[int, int]],
              repeats: int = 5, decode_steps: int = 4) -> BenchResult:
    """Median step time of each shape: a prefill of n tokens; a decode step of b sequences at context c.

    ``output_tok_s`` is decode tokens per second over the decode shapes (sum b / sum step time).
    """
    t0 = time.perf_counter()
    times: dict[str, float] = {}
    vocab = engine.model_config.vocab_size

    def ids(n: int, salt: int) -> list[int]:
        return [(salt * 7919 + i * 104729) % (vocab - 1) + 1 for i in range(n)]

    def sync():
        if engine.device.type == "cuda":
            torch.cuda.synchronize()

    for n in prefill_lengths:
        samples = []
        for r in range(repeats):
            engine.block_manager.reset_prefix_cache()
            engine.add_request(ids(n, r), SamplingParams(max_tokens=1, ignore_eos=True))
            sync()
            t = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
            sync()
            samples.append(time.perf_counter() - t)
        times[f"prefill n={n}"] = 1e3 * statistics.median(samples)
    decode_tokens = decode_time = 0.0
    spreads = []
    bm = engine.block_manager
    for b, c in decode_batches:
        # as many sequences as the KV pool holds to their last token and the scheduler runs at once: a batch
        # the pool cannot hold would be preempted into a smaller one, and timed under the wrong shape
        need = -(-(c + decode_steps * repeats + 2) // bm.block_size)
        b = min(b, bm.num_blocks // need, engine.scheduler.config.max_num_seqs)
        if b < 1:
            continue
        bm.reset_prefix_cache()
        for i in range(b):
            engine.add_request(ids(c, 1000 + i), SamplingParams(max_tokens=decode_steps * repeats + 2, ignore_eos=True))
        while engine.scheduler.waiting or any(not s.output_token_ids for s in engine.scheduler.running):
            engine.step()  # prefill until every sequence decodes
        samples = []
        for _ in range(repeats):
            sync()
            t = time.perf_counter()
            for _ in range(decode_steps):
                engine.step()
            sync()
            samples.append((time.perf_counter() - t) / decode_steps)
        while engine.has_unfinished():
            engine.step()
        med = statistics.median(samples)
        times[f"decode b={b} ctx={c}"] = 1e3 * med
        spreads.append((max(samples) - min(samples)) / med if med else 0.0)
        decode_tokens += b
        decode_time += med
    rate = decode_tokens / decode_time if decode_time else 0.0
    return BenchResult(
        variant_id=engine.variant.variant_id, tier="fast", layers=engine.model_config.num_hidden_layers,
        trace_id=f"shapes:{len(prefill_lengths)}p/{len(decode_batches)}d", output_tok_s=rate, total_tok_s=rate,
        repeats=repeats, spread=rate * max(spreads, default=0.0), hardware=hardware_label(engine.device),
        wall_s=time.perf_counter() - t0, step_times_ms=times,
    )


def fast_shapes(traffic, variant, max_input: int = 256) -> tuple[list[int], list[tuple[int, int]]]:
    """The shape mix a traffic profile implies for a variant: prefill of a short, the median and the p90
    prompt (clipped to ``max_input``); decode at batch 1, the profile's concurrency and twice it (capped
    by the variant's max_num_seqs) at the median context."""
    prefill = sorted({16, min(max_input, max(8, int(traffic.input_p50))), min(max_input, max(8, int(traffic.input_p90)))})
    conc = max(1, round(traffic.estimated_concurrency))
    ctx = min(max_input, int(traffic.input_p50)) + 8
    batches = sorted({1, min(conc, variant.max_num_seqs), min(2 * conc, variant.max_num_seqs)})
    return prefill, [(b, ctx) for b in batches]
