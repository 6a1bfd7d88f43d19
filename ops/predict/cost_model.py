"""The cost model: roofline step times, composed over a simulated batching of
the traffic into throughput, TTFT, TPOT and goodput; calibrated against measured forward passes.

Step time, uncalibrated: max(bytes moved / measured bandwidth, FLOPs / measured FLOP/s)
+ kernels per layer x layers x measured launch overhead. Calibrated, an additive form with
non-negative factors fitted to measured step times:
    a * bytes/bandwidth + b * FLOPs/FLOP/s + c * launches x overhead + d * sequences in the step.
Tensor parallelism divides weights, KV and FLOPs by ``tp`` and adds two all-reduces per layer
over the interconnect.

The simulation runs the engine's scheduling policy (engine/sched/scheduler.py) on the requests of a
trace slice, or on requests drawn from a TrafficProfile, with the variant's knobs.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections import deque
from dataclasses import asdict, dataclass, field
from itertools import combinations

import numpy as np

from engine.sched.block_manager import BlockManager
from engine.config.sampling_params import SamplingParams
from engine.sched.scheduler import Scheduler
from engine.sched.sequence import FinishReason, Sequence
from engine.serving.trace_record import TraceRecord
from engine.config.variant import VariantSpec
from ops.measure.tiers import SLO, own_rate
from ops.measure.capacity import capacity_search, search_crossing
from ops.measure.hardware import HardwareProfile
from ops.measure.model_spec import ModelSpec
from ops.traffic.traces import TrafficProfile, percentile

_SIM_VOCAB = 32000  # token ids of the simulated prompts: only their sharing (prefix hashes) matters

KERNELS_PER_LAYER = 12
ALLREDUCE_LATENCY_S = 10e-6


# ---- step time ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Calibration:
    """Correction factors fitted to measured step times; None of them fitted: the plain roofline."""

    mem: float = 1.0
    compute: float = 1.0
    launch: float = 1.0
    per_seq_s: float = 0.0
    eager: float = 0.0  # a GPU step not replayed as a graph: the host's launches (fitted beside graphed steps only)
    fitted: bool = False
    samples: int = 0
    fit_mape: float = 0.0  # error on the samples it was fitted to

    def to_json(self) -> dict:
        return asdict(self)


ROOFLINE = Calibration()


def scaled(cal: Calibration, factor: float) -> Calibration:
    """Every step ``factor`` times as long (a variant whose kernels are that much slower or faster)."""
    if not cal.fitted:
        return cal
    return dataclasses.replace(cal, mem=cal.mem * factor, compute=cal.compute * factor, launch=cal.launch * factor,
                               per_seq_s=cal.per_seq_s * factor, eager=cal.eager * factor)


@dataclass(frozen=True)
class StepShape:
    new_tokens: int
    kv_tokens: int  # tokens of KV read (context of every sequence in the step)
    seqs: int
    attn_pairs: int  # query x key pairs attended

    @staticmethod
    def prefill(n: int) -> "StepShape":
        return StepShape(n, n, 1, n * (n + 1) // 2)

    @staticmethod
    def decode(batch: int, ctx: int) -> "StepShape":
        return StepShape(batch, batch * ctx, batch, batch * ctx)


def _elem(model: ModelSpec) -> int:
    return 2 if model.dtype in ("bfloat16", "float16") else 4


def graphed(model: ModelSpec, v: VariantSpec, s: StepShape) -> bool:
    """Whether the engine replays a step of this shape as a CUDA graph under ``v``: decode rows only, as many as its
    largest ``cuda_graph_batch_sizes``; a step with prefill tokens (a dense model's) up to its largest
    ``prefill_graph_tokens`` (engine/worker/step_graphs.py)."""
    if s.new_tokens == s.seqs:
        return bool(v.cuda_graph_batch_sizes) and s.seqs <= max(v.cuda_graph_batch_sizes)
    return bool(v.prefill_graph_tokens) and not model.experts and s.new_tokens <= max(v.prefill_graph_tokens)


def padded_rows(model: ModelSpec, hw: HardwareProfile, s: StepShape, v: VariantSpec | None) -> int:
    """The rows a step's projections compute: a GPU step with prefill tokens replayed as a graph is padded to the
    next captured token count (engine/worker/step_graphs.py; attention leaves the padding out)."""
    graph = v is not None and hw.device.startswith("cuda") and s.new_tokens != s.seqs and graphed(model, v, s)
    return min(n for n in v.prefill_graph_tokens if n >= s.new_tokens) if graph else s.new_tokens


def features(model: ModelSpec, hw: HardwareProfile, s: StepShape, tp: int = 1,
             v: VariantSpec | None = None) -> tuple[float, float, float, float, float]:
    """(memory seconds, compute seconds, launch seconds, sequences, eager launch seconds) of one step, at the
    roofline. The last is the kernels' launch seconds again for a GPU step that ``v`` runs eagerly (``graphed``),
    else 0: a graph's replay costs the host one launch where an eager step pays every kernel's, so with both kinds
    in a replay (graphed decode, eager prefill chunks) one launch factor fits neither. Flops: ``padded_rows``."""
    params = model.param_bytes / _elem(model)
    moved = (model.param_bytes + s.kv_tokens * model.kv_bytes_per_token) / tp
    rows = padded_rows(model, hw, s, v)
    flops = (2 * params * rows + 4 * model.layers * model.heads * model.head_dim * s.attn_pairs) / tp
    rate = hw.matmul_flops.get(model.dtype) or next(iter(hw.matmul_flops.values()))
    launch = kernels = KERNELS_PER_LAYER * model.layers * hw.launch_overhead_s
    if tp > 1:
        bw = hw.interconnect_bandwidth or hw.memory_bandwidth / 10
        volume = 2 * model.layers * s.new_tokens * model.hidden_size * _elem(model) * 2 * (tp - 1) / tp
        launch += volume / bw + 2 * model.layers * ALLREDUCE_LATENCY_S
    eager = kernels if v is not None and hw.device.startswith("cuda") and not graphed(model, v, s) else 0.0
    return moved / hw.memory_bandwidth, flops / rate, launch, float(s.seqs), eager


def step_time(model: ModelSpec, hw: HardwareProfile, shape: StepShape, cal: Calibration = ROOFLINE,
              tp: int = 1, v: VariantSpec | None = None) -> float:
    """One step's modelled seconds; ``v``: the variant that runs it (which steps are graphs, ``features``)."""
    mem, comp, launch, seqs, eager = features(model, hw, shape, tp, v)
    if not cal.fitted:
        return max(mem, comp) + launch
    return cal.mem * mem + cal.compute * comp + cal.launch * launch + cal.per_seq_s * seqs + cal.eager * eager


def calibrate(model: ModelSpec, hw: HardwareProfile, samples: list[tuple[StepShape, float]],
              window: int = 1, v: VariantSpec | None = None) -> Calibration:
    """Non-negative factors minimizing the relative squared error over measured (shape, seconds). With ``v``, the
    variant that ran them, a GPU's eager steps get a launch factor of their own where graphed steps are beside
    them (``features``); else (``v`` None, a CPU, or every step of one kind) that factor stays 0.

    ``window`` > 1 fits sums over that many consecutive steps instead of single steps: an engine
    that runs a step ahead of the host spends one step's time in the call before, so single step
    times are misaligned with their shapes while sums over a few steps are not."""
    if not samples:
        return ROOFLINE
    if any(t < 0 for _, t in samples):
        raise ValueError("measured step times must not be negative")
    feats = np.array([features(model, hw, s, v.tp if v is not None else 1, v) for s, _ in samples], dtype=np.float64)
    eager = feats[:, 4] > 0
    cols_fit = 5 if eager.any() and not eager.all() else 4  # both kinds: else the column is 0 or the launch's
    feats = feats[:, :cols_fit]
    times = np.array([t for _, t in samples], dtype=np.float64)
    if window > 1:
        n = len(samples) // window * window or len(samples)
        groups = np.arange(n) // window
        feats = np.array([feats[:n][groups == g].sum(0) for g in range(groups.max() + 1)])
        times = np.array([times[:n][groups == g].sum() for g in range(groups.max() + 1)])
    if np.any(times <= 0):
        raise ValueError("measured step times must be positive")
    x, y = feats, times
    w = 1.0 / y  # relative error
    best = None
    # exact non-negative least squares for four or five unknowns: the best unconstrained fit on each support
    for k in range(1, cols_fit + 1):
        for cols in combinations(range(cols_fit), k):
            a = x[:, cols] * w[:, None]
            coef, *_ = np.linalg.lstsq(a, y * w, rcond=None)
            if np.any(coef < 0):
                continue
            err = float(np.sum((a @ coef - y * w) ** 2))
            if best is None or err < best[0] - 1e-15:
                best = (err, cols, coef)
    full = np.zeros(5)
    full[list(best[1])] = best[2]
    pred = x @ full[:cols_fit]
    fit_mape = float(np.mean(np.abs(pred - y) / y))
    return Calibration(mem=float(full[0]), compute=float(full[1]), launch=float(full[2]), per_seq_s=float(full[3]),
                       eager=float(full[4]), fitted=True, samples=len(samples), fit_mape=fit_mape)


def shapes_from_fast(step_times_ms: dict[str, float]) -> list[tuple[StepShape, float]]:
    """The fast tier's measurements ('prefill n=N', 'decode b=B ctx=C' -> ms) as (shape, seconds)."""
    out = []
    for key, ms in step_times_ms.items():
        kv = dict(part.split("=") for part in key.split()[1:])
        if key.startswith("prefill"):
            out.append((StepShape.prefill(int(kv["n"])), ms / 1e3))
        elif key.startswith("decode"):
            out.append((StepShape.decode(int(kv["b"]), int(kv["ctx"])), ms / 1e3))
    return out


# ---- trace-level prediction -----------------------------------------------------------------------
@dataclass(frozen=True)
class Prediction:
    output_tok_s: float
    ttft_s: float  # p50
    tpot_s: float  # p50
    total_tok_s: float = 0.0
    ttft_p99: float = 0.0
    tpot_p99: float = 0.0
    goodput: float = 0.0  # requests/s meeting the SLO
    wall_s: float = 0.0
    steps: int = 0
    attainment: float = 0.0  # share of requests meeting the SLO
    capacity: float = 0.0  # req/s at which >= 90% meet it (predicted_capacity; 0 when not computed)


def sim_prompts(records: list[TraceRecord], max_input: int | None) -> list[list[int]]:
    """Token ids that share exactly what the slow tier's prompts share (ops.replay.synthesize_prompts: the
    blocks of a prefix hash id alike, the rest of each request its own), cheaply: a block of a hash id is
    that id repeated, the rest of request i is a value of its own; only equality matters to the block manager."""
    out = []
    for i, r in enumerate(records):
        n = max(1, r.input_tokens if max_input is None else min(r.input_tokens, max_input))
        ids: list[int] = []
        for h in r.prefix_block_hashes:
            if len(ids) >= n:
                break
            ids.extend([(h % _SIM_VOCAB) + _SIM_VOCAB] * r.block_tokens)  # hash blocks: ids >= _SIM_VOCAB
        ids.extend([i % _SIM_VOCAB] * max(0, n - len(ids)))
        out.append(ids[:n])
    return out


def simulate(model: ModelSpec, hw: HardwareProfile, records: list[TraceRecord], v: VariantSpec,
             cal: Calibration = ROOFLINE, *, time_scale: float = 1.0, max_input: int | None = None,
             max_output: int | None = None, num_kv_blocks: int = 512, slo_ttft_s: float = 2.0,
             slo_tpot_s: float = 0.2, slo_ttft_per_token_s: float = 0.0, tpot_min_tokens: int = 8,
             steps_out: list | None = None, counted: tuple[int, int] | None = None,
             run_ahead: bool | None = None) -> Prediction:
    """Replays the records through the engine's own Scheduler and BlockManager (continuous batching, chunked
    prefill, prefix caching over prompts built as the slow tier builds them, preemption by recompute) on a
    simulated clock that advances by each step's modelled time. ``steps_out``, when given, receives every
    step's StepShape. A request larger than the whole KV pool is left out, as the engine refuses it.
    ``counted``: (first, end) record indices whose outcomes make the attainment (a rate probe's counted requests,
    after its warm-up); an unfinished one counts as missed. Default: every request. ``run_ahead`` (default: on a
    GPU, as the engine): a step of decode rows only, launched with nothing waiting, has the next one launched
    before its tokens are read, with the same rows, so a request that arrives during it joins the step after next,
    and a row that finished in it runs once more, dead (LLMEngine._can_run_ahead)."""
    if not records:
        raise ValueError("simulate needs at least one request")
    t0 = records[0].arrival_s
    bm = BlockManager(num_kv_blocks, v.block_size, v.enable_prefix_caching)
    sched = Scheduler(v, bm)
    pending: deque[tuple[float, Sequence]] = deque()
    capacity = num_kv_blocks * v.block_size
    for i, (r, prompt) in enumerate(zip(records, sim_prompts(records, max_input))):
        o = max(1, r.output_tokens if max_output is None else min(r.output_tokens, max_output))
        if len(prompt) + o <= capacity:
            seq = Sequence(str(i), prompt, SamplingParams(max_tokens=o, ignore_eos=True), i)
            pending.append(((r.arrival_s - t0) * time_scale, seq))
    arrival = {seq.request_id: a for a, seq in pending}
    in_tokens = sum(len(seq.prompt_token_ids) for _, seq in pending)
    first: dict[str, float] = {}
    done: list[tuple[Sequence, float]] = []
    t, steps = 0.0, 0
    ahead = None if not (hw.device.startswith("cuda") if run_ahead is None else run_ahead) else False
    launched_at, prev = 0.0, None  # the last step's start (with ``ahead`` the next step was fixed then) and shape

    def stop_at_length(seq: Sequence) -> None:
        if len(seq.output_token_ids) >= seq.params.max_tokens:
            seq.finish_reason = FinishReason.LENGTH

    while pending or sched.has_unfinished():
        cutoff = launched_at if ahead else t  # a step launched ahead admits no one who came after its launch
        while pending and pending[0][0] <= cutoff:
            sched.add(pending.popleft()[1])
        batch = sched.schedule() if sched.has_unfinished() else None
        if batch is None or batch.is_empty:
            if ahead:  # every row of the step launched ahead had finished: it runs dead, then one is scheduled
                t += step_time(model, hw, _one_further(prev), cal, v.tp, v)
                ahead = False
                continue
            if not pending:
                break  # nothing can run (cannot happen for requests that fit the pool)
            t = max(t, pending[0][0])
            continue
        shape = StepShape(batch.num_batched_tokens,
                          sum(item.seq.num_computed_tokens + item.num_new_tokens for item in batch.scheduled),
                          len(batch.scheduled),
                          sum(item.num_new_tokens * (item.seq.num_computed_tokens + (item.num_new_tokens + 1) // 2)
                              for item in batch.scheduled))
        run = _one_further(prev) if ahead else shape  # launched ahead: the last step's rows, finished ones too
        if ahead is not None:  # as LLMEngine._can_run_ahead, at this step's launch
            ahead = (run.seqs == shape.seqs and not (pending and pending[0][0] <= t)
                     and sched.continues(batch.scheduled))
            launched_at = t
        prev = run
        t += step_time(model, hw, run, cal, v.tp, v)
        steps += 1
        if steps_out is not None:
            steps_out.append(shape)
        # a draft's tokens are modelled as rejected: the simulation knows no model's outputs, so speculation
        # shows here as its cost only (its gain is measured, on the tiers)
        sched.update(batch, {item.seq.request_id: [1] for item in batch.scheduled}, stop_at_length)
        for item in batch.scheduled:
            seq = item.seq
            if item.samples and seq.request_id not in first:
                first[seq.request_id] = t
            if seq.finish_reason is not None:
                done.append((seq, t))
    wall = max(t, 1e-9)
    ttft = [first[s.request_id] - arrival[s.request_id] for s, _ in done]
    tpot = [(end - first[s.request_id]) / (len(s.output_token_ids) - 1) for s, end in done
            if len(s.output_token_ids) > 1]
    out_tokens = sum(len(s.output_token_ids) for s, _ in done)
    slo = SLO(slo_ttft_s, slo_tpot_s, slo_ttft_per_token_s, tpot_min_tokens)
    lo, hi = counted if counted is not None else (0, len(records))
    good = sum(1 for s, end in done if lo <= int(s.request_id) < hi and slo.met(
        first[s.request_id] - arrival[s.request_id],
        (end - first[s.request_id]) / (len(s.output_token_ids) - 1) if len(s.output_token_ids) > 1 else None,
        len(s.prompt_token_ids), len(s.output_token_ids)))
    return Prediction(output_tok_s=out_tokens / wall, ttft_s=percentile(ttft, .5), tpot_s=percentile(tpot, .5),
                      total_tok_s=(out_tokens + in_tokens) / wall, ttft_p99=percentile(ttft, .99),
                      tpot_p99=percentile(tpot, .99), goodput=good / wall, wall_s=wall, steps=steps,
                      attainment=good / max(1, len(arrival) if counted is None else hi - lo))


def _one_further(s: StepShape) -> StepShape:
    """A decode step's rows one token further on (the step the engine launches ahead of reading ``s``'s tokens)."""
    return StepShape(s.new_tokens, s.kv_tokens + s.seqs, s.seqs, s.attn_pairs + s.seqs)


def predicted_capacity(model: ModelSpec, hw: HardwareProfile, records: list[TraceRecord], v: VariantSpec,
                       cal: Calibration = ROOFLINE, target: float = 0.9, **sim) -> float:
    """The capacity at the SLO the simulation predicts: the slice's arrival pattern replayed at scaled rates
    (as the slow tier measures it, to a finer bracket: simulating costs milliseconds)."""
    rate0 = own_rate(records)
    sim = {k: v_ for k, v_ in sim.items() if k != "time_scale"}

    def attain(rate: float) -> float:
        return simulate(model, hw, records, v, cal, time_scale=rate0 / rate, **sim).attainment

    return search_crossing(capacity_search(attain, rate0, target, resolution=1.05, max_probes=16)[2], target)


def synthetic_requests(traffic: TrafficProfile, n: int = 64, seed: int = 0) -> list[TraceRecord]:
    """Requests drawn to match a profile: Poisson-like arrivals (gamma gaps with the profile's CV),
    log-normal lengths through its p50 and p90."""
    rng = random.Random(seed)
    rate = traffic.arrival_rate or 1.0
    cv = max(0.1, traffic.interarrival_cv or 1.0)
    shape = 1.0 / (cv * cv)

    def length(p50: float, p90: float, cap: int) -> int:
        sigma = math.log(max(p90, p50 + 1e-9) / max(p50, 1.0)) / 1.2816 if p50 > 0 else 0.0
        return int(min(cap or 1 << 30, max(1, round(max(p50, 1.0) * math.exp(rng.gauss(0, sigma))))))

    t, out = 0.0, []
    for _ in range(n):
        out.append(TraceRecord(arrival_s=t, input_tokens=length(traffic.input_p50, traffic.input_p90,
                                                                traffic.input_max),
                               output_tokens=length(traffic.output_p50, traffic.output_p90, traffic.output_max),
                               source="synthetic"))
        t += rng.gammavariate(shape, 1.0 / (rate * shape))
    return out


def predict(model: ModelSpec, hw: HardwareProfile, traffic: TrafficProfile, v: VariantSpec,
            cal: Calibration = ROOFLINE, records: list[TraceRecord] | None = None, **sim) -> Prediction:
    """Trace-level prediction, capacity at the SLO included: over ``records`` when given, else over requests
    drawn from the profile. Data parallelism splits the requests round-robin over ``v.dp`` replicas (their
    capacities add up)."""
    records = records or synthetic_requests(traffic)
    if v.dp == 1:
        return dataclasses.replace(simulate(model, hw, records, v, cal, **sim),
                                   capacity=predicted_capacity(model, hw, records, v, cal, **sim))
    shares = [records[i::v.dp] for i in range(v.dp) if records[i::v.dp]]
    parts = [simulate(model, hw, r, v, cal, **sim) for r in shares]
    wall = max(p.wall_s for p in parts)
    out = sum(p.output_tok_s * p.wall_s for p in parts)
    return Prediction(output_tok_s=out / wall, ttft_s=max(p.ttft_s for p in parts), tpot_s=max(p.tpot_s for p in parts),
                      total_tok_s=sum(p.total_tok_s * p.wall_s for p in parts) / wall,
                      ttft_p99=max(p.ttft_p99 for p in parts), tpot_p99=max(p.tpot_p99 for p in parts),
                      goodput=sum(p.goodput * p.wall_s for p in parts) / wall, wall_s=wall,
                      steps=sum(p.steps for p in parts),
                      attainment=sum(p.attainment * len(r) for p, r in zip(parts, shares)) / len(records),
                      capacity=sum(predicted_capacity(model, hw, r, v, cal, **sim) for r in shares))


# ---- error measures ---------------------------------------------------------------------------------
def mape(predicted: list[float], measured: list[float]) -> float:
    """Mean absolute percentage error of predictions against measurements (as a fraction)."""
    if len(predicted) != len(measured) or not measured:
        raise ValueError("mape needs two equally long, non-empty lists")
    return float(np.mean([abs(p - m) / abs(m) for p, m in zip(predicted, measured) if m]))


def _ranks(x: list[float]) -> np.ndarray:
    """Ranks from 1, ties sharing their mean rank."""
    a = np.asarray(x, dtype=np.float64)
    order = np.argsort(a, kind="mergesort")
    ranks = np.empty(len(a))
    i = 0
    while i < len(a):
        j = i
        while j + 1 < len(a) and a[order[j + 1]] == a[order[i]]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (Pearson correlation of the ranks); nan when a side is constant."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError("spearman needs two equally long lists of at least two values")
    ra, rb = _ranks(a), _ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


# ---- the plan: ranked knob variants and parallel layouts ---------------------------------------
@dataclass
class PlanEntry:
    variant: VariantSpec
    prediction: Prediction
    rationale: str

    def to_json(self) -> dict:
        return {"variant_id": self.variant.variant_id, "variant": self.variant.to_json(),
                "prediction": asdict(self.prediction), "rationale": self.rationale}


@dataclass
class CostModelPlan:
    baseline: VariantSpec
    entries: list[PlanEntry] = field(default_factory=list)  # best first
    layouts: list[dict] = field(default_factory=list)  # parallel layouts for the device count, best first
    ranges: dict[str, list] = field(default_factory=dict)  # knob values among the best entries
    calibration: Calibration = ROOFLINE
    baseline_prediction: Prediction | None = None

    def to_json(self) -> dict:
        return {"baseline": self.baseline.to_json(), "entries": [e.to_json() for e in self.entries],
                "layouts": self.layouts, "ranges": self.ranges, "calibration": self.calibration.to_json(),
                "baseline_prediction": asdict(self.baseline_prediction) if self.baseline_prediction else None}


KNOBS = ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size", "block_size", "enable_prefix_caching")


def knob_grid(traffic: TrafficProfile, base: VariantSpec) -> list[VariantSpec]:
    """Knob ranges worth trying for this traffic."""
    seqs = sorted({1, 4, 16, 64, base.max_num_seqs})
    budgets = sorted({128, 512, 2048, base.max_num_batched_tokens})
    blocks = [16, 32]
    caching = [True] if traffic.prefix_reuse > 0 else [True, False]
    return [dataclasses.replace(base, name=f"grid s{s} t{t} b{b}{'' if c else ' nocache'}", max_num_seqs=s,
                                max_num_batched_tokens=t, block_size=b, enable_prefix_caching=c)
            for s, t, b, c in itertools.product(seqs, budgets, blocks, caching)]


def _rank_key(p: Prediction) -> tuple:
    return (-round(p.capacity, 6), -round(p.attainment, 6), -round(p.output_tok_s, 6), p.ttft_s)


def rank_layouts(model: ModelSpec, hw: HardwareProfile, traffic: TrafficProfile, base: VariantSpec,
                 devices: int, cal: Calibration = ROOFLINE, **sim) -> list[dict]:
    """Every (tp, dp) with tp x dp = devices whose weights fit, ranked by predicted capacity and throughput."""
    out = []
    for tp in [d for d in range(1, devices + 1) if devices % d == 0]:
        dp = devices // tp
        fits = model.param_bytes / tp < 0.9 * hw.memory_bytes
        if tp > 1 and model.heads % tp:
            fits = False
        v = dataclasses.replace(base, tp=tp, dp=dp)
        p = predict(model, hw, traffic, v, cal, **sim) if fits else None
        out.append({"tp": tp, "dp": dp, "fits": fits, "prediction": asdict(p) if p else None,
                    "rationale": (f"weights {model.param_bytes / tp / 2**30:.2f} GiB per device; predicted "
                                  f"capacity {p.capacity:.2f} req/s at the SLO, {p.output_tok_s:.1f} tok/s") if p else
                                 "does not fit (weights per device or heads not divisible)"})
    out.sort(key=lambda d: (not d["fits"],) + (_rank_key(Prediction(**d["prediction"])) if d["prediction"] else ()))
    return out


def plan(model: ModelSpec, hw: HardwareProfile, traffic: TrafficProfile, base: VariantSpec,
         cal: Calibration = ROOFLINE, records: list[TraceRecord] | None = None, devices: int | None = None,
         top: float = 0.25, **sim) -> CostModelPlan:
    """Ranks the knob grid by predicted capacity at the SLO, then attainment at the traffic's own rate and output
    tokens/s; keeps the ranges of the best quarter."""
    records = records or synthetic_requests(traffic)
    entries = []
    for v in knob_grid(traffic, base):
        p = predict(model, hw, traffic, v, cal, records, **sim)
        entries.append(PlanEntry(v, p, f"predicted capacity {p.capacity:.2f} req/s at the SLO, "
                                       f"{p.output_tok_s:.1f} tok/s, "
                                       f"TTFT p50 {1e3 * p.ttft_s:.0f} ms, TPOT p50 {1e3 * p.tpot_s:.1f} ms "
                                       f"({'calibrated' if cal.fitted else 'roofline'})"))
    entries.sort(key=lambda e: _rank_key(e.prediction))
    best = entries[:max(1, math.ceil(top * len(entries)))]
    ranges = {k: sorted({getattr(e.variant, k) for e in best}, key=lambda x: (x is None, x)) for k in KNOBS}
    layouts = rank_layouts(model, hw, traffic, base, devices or hw.device_count, cal, records=records, **sim)
    return CostModelPlan(baseline=base, entries=entries, layouts=layouts, ranges=ranges, calibration=cal,
                         baseline_prediction=predict(model, hw, traffic, base, cal, records, **sim))
