"""The static-best sweep: the configuration a careful operator would set once for a model on a device,
chosen without seeing any deployment's traffic.

The workload is fixed and synthetic: uniform prompts and outputs (``WORKLOADS``: 1,024 / 128 tokens on a
GPU; 256 / 32 on a CPU, where a 1,024-token prefill alone takes seconds), Poisson arrivals replayed at
scaled rates. Every candidate (knobs, and on a GPU the validated kernel forms of engine/config/presets.py with
CUDA graphs) is hot-swapped into one engine and ranked by its capacity at the SLO on that workload; the
SLO, unless given, follows ``derive_slo`` from the default configuration's unloaded latency. The winner
is recorded by engine/config/static_best.py with the sweep's rows, and becomes the engine's default.
"""
from __future__ import annotations

import dataclasses
import random
import statistics
import time
from dataclasses import dataclass

import torch

from engine import EngineConfig, LLMEngine
from engine.config.source import ModelSource
from engine.config.sampling_params import SamplingParams
from engine.serving.trace_record import TraceRecord
from engine.config.variant import VariantSpec
from ops.measure.tiers import SLO, attainment_at, hardware_label
from ops.measure.capacity import capacity_search
from ops.traffic.traces import percentile

# the SLO rule where none is given: multiples of a configuration's unloaded latency on the workload
TTFT_FACTOR, TPOT_FACTOR = 5.0, 3.0
RULE = (f"TTFT <= {TTFT_FACTOR:g}x the unloaded TTFT for the prompt's length and TPOT <= {TPOT_FACTOR:g}x the "
        "unloaded p90")


@dataclass(frozen=True)
class Workload:
    prompt: int  # tokens per prompt
    output: int  # tokens per output
    requests: int
    rate: float = 1.0  # the arrival pattern's own rate (req/s); the capacity search scales it

    def records(self, seed: int = 0) -> list[TraceRecord]:
        rng, t, out = random.Random(seed), 0.0, []
        for _ in range(self.requests):
            out.append(TraceRecord(arrival_s=t, input_tokens=self.prompt, output_tokens=self.output,
                                   source="static-best workload"))
            t += rng.expovariate(self.rate)
        return out

    def prompts(self, vocab: int, seed: int = 0) -> list[list[int]]:
        rng = random.Random(seed + 1)
        low = min(100, vocab // 4)  # past the (often special) first ids, inside small vocabularies
        return [[rng.randrange(low, vocab - 1) for _ in range(self.prompt)] for _ in range(self.requests)]


WORKLOADS = {"cpu": Workload(prompt=256, output=32, requests=16), "gpu": Workload(prompt=1024, output=128, requests=32)}


def spread_by_length(prompts: list[list[int]], n: int) -> list[list[int]]:
    """``n`` of the prompts at evenly spaced ranks of their length, the longest last (all of them if fewer)."""
    ranked = sorted(prompts, key=len)
    if len(ranked) <= n:
        return ranked
    return [ranked[round((len(ranked) - 1) * (i + 1) / n)] for i in range(n)]


def unloaded_latency(engine: LLMEngine, prompts: list[list[int]], output: int, n: int = 4,
                     tries: int = 2) -> tuple[float, float]:
    """(TTFT p90, TPOT p90) of ``n`` requests each run alone: the latency a configuration has with no queue.
    The requests are spread over the slice's prompt lengths, its longest among them (``spread_by_length``), so
    that an SLO derived from them is one each of the slice's requests can meet when it runs alone. Each
    request runs ``tries`` times and keeps its fastest run, so that a moment of contention on a shared
    machine (another process on the cores) does not loosen an SLO derived from it."""
    ttft, tpot = [], []
    engine.generate([prompts[0][:16]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up, untimed
    for p in spread_by_length(prompts, n):
        best = (float("inf"), float("inf"))
        for _ in range(max(1, tries)):
            engine.block_manager.reset_prefix_cache()
            t0 = time.perf_counter()
            engine.add_request(p, SamplingParams(max_tokens=output, ignore_eos=True))
            first = None
            while engine.has_unfinished():
                for o in engine.step():
                    if first is None and o.token_ids:
                        first = time.perf_counter()
            end = time.perf_counter()
            best = (min(best[0], first - t0), min(best[1], (end - first) / max(1, output - 1)))
        ttft.append(best[0])
        tpot.append(best[1])
    return percentile(ttft, .9), percentile(tpot, .9)


def unloaded_points(engine: LLMEngine, prompts: list[list[int]], output: int, n: int = 6,
                    tries: int = 3) -> list[tuple[int, float, float]]:
    """(prompt tokens, TTFT, TPOT) of ``n`` requests each run alone, spread over the slice's prompt lengths, its
    longest among them; each the fastest of ``tries`` runs, taken in ``tries`` passes over all of them (so that
    a request's runs lie seconds apart, and a moment of contention on a shared machine, which slows whatever
    runs during it, does not loosen an SLO derived from them)."""
    engine.generate([prompts[0][:16]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up, untimed
    chosen = spread_by_length(prompts, n)
    best = [(float("inf"), float("inf")) for _ in chosen]
    for _ in range(max(1, tries)):
        for k, p in enumerate(chosen):
            engine.block_manager.reset_prefix_cache()
            t0 = time.perf_counter()
            engine.add_request(p, SamplingParams(max_tokens=output, ignore_eos=True))
            first = None
            while engine.has_unfinished():
                for o in engine.step():
                    if first is None and o.token_ids:
                        first = time.perf_counter()
            end = time.perf_counter()
            best[k] = (min(best[k][0], first - t0), min(best[k][1], (end - first) / max(1, output - 1)))
    return [(len(p), t, d) for p, (t, d) in zip(chosen, best)]


def derive_slo(unloaded) -> SLO:
    """The stated rule, from (TTFT p90, TPOT p90) or from ``unloaded_points``: TPOT within TPOT_FACTOR times the
    unloaded p90 (judged for outputs of 8 tokens or more); TTFT within TTFT_FACTOR times the unloaded TTFT of a
    prompt of its length: a line a + b x tokens through the points (least squares, b >= 0) at the median of
    their residuals, so that one request slowed by a moment of contention does not move the SLO (every
    measured request still meets its target alone: the line is raised where one would not). Prompts of one
    length (within 1.5x) give a flat target. The intercept is never negative (a convex curve gets the line through
    0 that clears every point)."""
    if isinstance(unloaded, tuple):
        return SLO(ttft_s=TTFT_FACTOR * unloaded[0], tpot_s=TPOT_FACTOR * unloaded[1])
    lengths = [float(x[0]) for x in unloaded]
    ttfts = [x[1] for x in unloaded]
    tpot = percentile([x[2] for x in unloaded], .9)
    slope = 0.0
    if len(set(lengths)) > 1 and max(lengths) >= 1.5 * min(lengths):
        ml, mt = sum(lengths) / len(lengths), sum(ttfts) / len(ttfts)
        var = sum((x - ml) ** 2 for x in lengths)
        slope = max(0.0, sum((x - ml) * (y - mt) for x, y in zip(lengths, ttfts)) / var) if var else 0.0
    resid = [y - slope * x for x, y in zip(lengths, ttfts)]
    base = max(statistics.median(resid), max(resid) / TTFT_FACTOR)
    if base < 0:  # a convex curve (a GPU's prefill: flat for short prompts, then linear): no negative intercept,
        # which would set a short prompt a target below its own TTFT; the line through 0 that clears every point
        base, slope = 0.0, max(y / x for x, y in zip(lengths, ttfts) if x > 0)
    return SLO(ttft_s=TTFT_FACTOR * base, tpot_s=TPOT_FACTOR * tpot, ttft_per_token_s=TTFT_FACTOR * slope)


def candidates(device: str, hidden_size: int, moe: bool = False) -> list[VariantSpec]:
    """The sweep's forms: the default and a knob grid; on a GPU also the validated kernel forms with CUDA
    graphs for every decode batch up to max_num_seqs, and each of them at 32 sequences with its steps that carry
    prefill tokens replayed as graphs too (``presets.prefill_graphed``, the form the tuner's precision candidate
    takes: static-best has it where it pays in bf16, so a precision's gain is not the graphs'); not for a
    mixture-of-experts model (``moe``), whose steps with prefill tokens the engine does not capture. The
    triton-paged forms at 32 sequences also with dependent launch at level 1 (``presets.launched``: the one-byte
    forms launch so, and on an H100 it made bf16's decode step 1.02x faster), their graphed form included."""
    from engine.config.presets import launched, preset_variant, prefill_graphed

    if device.startswith("cuda"):
        knobs = [dict(max_num_seqs=s, max_num_batched_tokens=2048, prefill_chunk_size=c)
                 for s in (32, 128) for c in (None, 512)]
    else:  # a CPU's steps: few sequences at a time
        knobs = [dict(max_num_seqs=s, max_num_batched_tokens=b, prefill_chunk_size=c)
                 for s in (8, 32) for b, c in ((512, None), (2048, None), (2048, 256))]
    out = [VariantSpec(name="default")]
    if not device.startswith("cuda"):
        return out + [VariantSpec(name=f"seqs {k['max_num_seqs']}, budget {k['max_num_batched_tokens']}, chunk "
                                       f"{k['prefill_chunk_size']}", **k) for k in knobs]
    for name in ("triton-paged", "dense-decode"):
        for k in knobs:
            graphs = tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b <= k["max_num_seqs"])
            try:
                v = preset_variant(name, hidden_size, cuda_graph_batch_sizes=graphs, **k)
            except Exception:  # a preset this device cannot run (e.g. dependent launch before Hopper)
                continue
            out.append(v)
            paged = name == "triton-paged" and k["max_num_seqs"] == 32
            if paged:
                out.append(launched(v, 1))
            if k["max_num_seqs"] == 32 and k["prefill_chunk_size"] is None and not moe:
                graphed = dataclasses.replace(prefill_graphed(v), name=f"{v.name}, prefill graphs")
                out += [graphed, launched(graphed, 1)] if paged else [graphed]
    return out


@dataclass
class SweepRow:
    variant: VariantSpec
    capacity: float
    capacity_spread: float
    probes: list
    error: str = ""


def sweep(source: ModelSource, device: str = "cpu", dtype: str = "float32", slo: SLO | None = None,
          workload: Workload | None = None, variants: list[VariantSpec] | None = None, num_kv_blocks: int = 1024,
          log=print) -> tuple[VariantSpec, dict]:
    """Runs the sweep; returns the winner and the sweep's record (workload, SLO, every row)."""
    kind = "gpu" if device.startswith("cuda") else "cpu"
    workload = workload or WORKLOADS[kind]
    engine = LLMEngine(EngineConfig(source=source, device=device, dtype=dtype, num_kv_blocks=num_kv_blocks,
                                    load_tokenizer=False, variant=VariantSpec(name="default")))
    records = workload.records()
    prompts = workload.prompts(engine.model_config.vocab_size)
    derived = slo is None
    unloaded = unloaded_latency(engine, prompts, workload.output)
    if derived:
        slo = derive_slo(unloaded)
        log(f"SLO from the default's unloaded latency: TTFT {1e3 * slo.ttft_s:.0f} ms, TPOT {1e3 * slo.tpot_s:.1f} ms")
    variants = variants or candidates(device, engine.model_config.hidden_size, engine.model_config.num_experts > 0)
    # the first rate tried: a few requests in flight at the unloaded latency (later: the last capacity found)
    guess = 4.0 / (unloaded[0] + workload.output * unloaded[1])
    # past this rate the whole workload arrives within a twentieth of one unloaded request: at once
    at_once = max(1, workload.requests - 1) / (0.05 * (unloaded[0] + workload.output * unloaded[1]))
    rows, t0 = [], time.perf_counter()
    for v in variants:
        try:
            engine.apply_variant(v)
            engine.generate([prompts[0][:16]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up, untimed
            cap, width, probes = capacity_search(
                lambda rate: attainment_at(engine, records, prompts, rate, workload.output, slo), guess,
                max_rate=at_once)
            rows.append(SweepRow(v, cap, width, probes))
            guess = max(guess, cap)  # the best so far: a weak form's low rates would take the longest to probe
            log(f"  {v.name:60} capacity {cap:.3f} req/s (bracket {width:.3f}; {len(probes)} probes)")
        except Exception as e:  # a form this device cannot run is a row too
            rows.append(SweepRow(v, 0.0, 0.0, [], f"{type(e).__name__}: {str(e)[:200]}"))
            log(f"  {v.name:60} failed: {rows[-1].error}")
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    best = max(rows, key=lambda r: (r.capacity, -len(r.variant.kernels)))
    record = {"workload": dataclasses.asdict(workload), "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
              "rule": f"{RULE} of the default, for 90% of requests" if derived else "given",
              "date": time.strftime("%Y-%m-%d"), "machine": hardware_label(engine.device),
              "seconds": round(time.perf_counter() - t0, 1), "chosen": best.variant.name,
              "rows": [{"name": r.variant.name, "variant_id": r.variant.variant_id, "capacity": round(r.capacity, 4),
                        "capacity_spread": round(r.capacity_spread, 4), "probes": r.probes, "error": r.error}
                       for r in rows]}
    return dataclasses.replace(best.variant, name="static-best"), record
