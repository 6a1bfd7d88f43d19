"""Tuning a workload: static-best found without traffic, candidate variants measured on the traffic's sizes, gated,
compared with static-best in paired rounds, and the best gated one chosen only when the comparison says so.

``tune_workload`` in order:

1. **static-best** (``find_static_best``): engine/workloads/static_best.py's setup with the best fixed batch of a
   sweep on a fixed synthetic load (the workload's middle size only: no traffic). Where its ``torch.compile``
   fails at every batch, static-best falls back to eager and the sweep's ``note`` says why.
2. **candidates** (``candidates``): forms of the forward pass and of batching for the device, cheapest and most
   likely bit-exact first (``cfg.candidates`` keeps some by name).
3. **gate**: every candidate in its own mode (bit-exact unless it changes precision on purpose); one that fails
   bit-exact is gated again in tolerance mode, so it can count for the tolerance-mode line.
4. **fast tier**: every runnable candidate's throughput on the traffic's size mix; the fastest bit-exact one
   and the fastest that passes tolerance mode go on.
5. **slow tier, paired**: each of those and static-best replay the request-size trace in alternation, A B A B,
   its arrivals at ``cfg.load`` times the faster arm's fast-tier throughput (both saturated: each throughput is
   that arm's capacity, not the offered rate), with at least ``cfg.busy_s`` of static-best's work in it (a
   compiled or graphed runner first serves every group size and replays the trace once, untimed, so
   compiling and capturing stay out of the rounds); the throughput ratio's 95% interval (bootstrap over rounds)
   gives the verdict.
6. **choice**: the bit-exact candidate replaces static-best only when its verdict is "better" and its ratio's lower
   bound exceeds the judge's minimum gain (``ops.judge.rule.MIN_GAIN``, 1.05: the LLM loop's rule)
   (``allow_tolerance``: the tolerance-mode one may too); otherwise static-best stays.

**Time budget** (``cfg.budget_s``): static-best's sweep measures at least one batch and static-best itself is
always measured; no further sweep batch and no further candidate starts once ``MEASURE_SHARE`` of the budget is
spent (those arms say "time budget spent"), and no paired round after the third starts once all of it is.
**Failures**: any ``Exception`` while an arm is gated or measured (a compile error of dynamo, Inductor or Triton,
a failed graph capture, out of memory) is that arm's ``error``, with its type's name; and inside a tuning
dynamo's recompile limit raises instead of running eager in silence.
"""
from __future__ import annotations

import gc
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch

from checks.workload_gate import BIT_EXACT, TOLERANCE, GateResult, gate_workload
from engine.workloads.static_best import lookup as recorded_static_best
from engine.workloads.static_best import record as record_static_best
from engine.workloads.static_best import static_best
from engine.workloads.variants import WorkloadRunner, WorkloadVariant, build_runner, refusal, release_compiled
from engine.workloads.workload import Workload, get_workload
from ops.judge.rule import MIN_GAIN
from ops.workloads.tiers import (BETTER, CENSORED, Ratio, SlowResult, fast_tier, mix_requests, paired, slow_tier,
                                 warm_up)
from ops.traffic.traces import load_trace
from ops.workloads.traffic import DEFAULT_TRACE, SizeTrace, size_trace

# every candidate ``candidates`` may propose, in the order they are measured (a budget cuts the tail): bit-exact
# hopefuls first, compiled forms next, precision changes after them, max-autotune (the slowest compile) last
CANDIDATE_NAMES = ("eager", "eager-2x", "graphs-eager-b1", "graphs-eager", "triton-ops", "compile-buckets", "graphs",
                   "reduce-overhead", "channels-last", "bf16", "tf32", "autotune")
MEASURE_SHARE = 0.6  # of a time budget, what candidates may take; the paired comparisons get the rest
BUDGET_SPENT = "time budget spent"


@dataclass(frozen=True)
class TuneConfig:
    """How much a tuning replays. The defaults suit a 2-core CPU; a GPU affords more."""

    requests: int = 96  # trace requests the slow tier replays
    mix: int = 16  # requests of the fast tier's mix
    repeats: int = 3  # fast-tier timed runs
    rounds: int = 4  # paired slow-tier rounds per comparison
    load: float = 2.0  # the trace replays at this multiple of the faster arm's fast-tier throughput (saturated)
    busy_s: float = 0.5  # the slow tier's trace holds at least this many seconds of static-best's work
    gate_batches: tuple[int, ...] = (1, 3, 8)
    gate_rounds: int = 1
    sweep: tuple[int, ...] = (1, 2, 4, 8, 16)  # fixed batches static-best is chosen among
    allow_tolerance: bool = False  # whether a tolerance-mode variant may be chosen
    compile: bool | None = None  # static-best's torch.compile (None: engine/workloads/static_best.py's rule)
    compile_candidates: bool = True  # measure compiled candidates (each new shape compiles: slow on a small CPU)
    candidates: tuple[str, ...] = ()  # names (CANDIDATE_NAMES) of the candidates to measure; empty: all
    recorded: bool = True  # static-best from its recorded sweep when there is one (engine/workloads/static_best.py)
    record: bool = False  # record static-best's sweep (when it ran) for the next tuning on this kind of device
    budget_s: float | None = None  # seconds the tuning may take (module docstring); None: no limit
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = sorted(set(self.candidates) - set(CANDIDATE_NAMES))
        if unknown:
            raise ValueError(f"unknown candidates {unknown}; known: {', '.join(CANDIDATE_NAMES)}")
        if self.budget_s is not None and not self.budget_s > 0:
            raise ValueError(f"budget_s must be positive seconds or None, got {self.budget_s!r}")


@dataclass
class Arm:
    variant: WorkloadVariant
    refused: str | None = None  # why it cannot run here
    gate: GateResult | None = None  # in its own mode
    tolerance_gate: GateResult | None = None  # when it failed bit-exact
    fast: float = 0.0  # requests/s on the traffic's mix
    error: str | None = None  # a run that raised: "ExceptionType: first line"
    skipped: str | None = None  # why it was not measured (BUDGET_SPENT)
    seconds: float = 0.0  # spent gating and measuring it (compiling and capturing included)

    @property
    def exact(self) -> bool:
        return self.gate is not None and self.gate.passed and self.gate.mode == BIT_EXACT

    @property
    def tolerable(self) -> bool:
        return self.exact or any(g is not None and g.passed and g.mode == TOLERANCE
                                 for g in (self.gate, self.tolerance_gate))

    @property
    def max_abs(self) -> float | None:
        """The gate's largest absolute error against the reference (passed or not); None: not gated."""
        return self.gate.max_abs if self.gate else None

    def to_json(self) -> dict:
        return {"variant": self.variant.to_json(), "describe": self.variant.describe(), "refused": self.refused,
                "gate": self.gate.to_json() if self.gate else None,
                "tolerance_gate": self.tolerance_gate.to_json() if self.tolerance_gate else None,
                "max_abs": self.max_abs, "fast": self.fast, "error": self.error, "skipped": self.skipped,
                "seconds": self.seconds}


@dataclass
class Comparison:
    arm: Arm
    ratio: Ratio
    rate: float = 0.0  # the replay's offered arrival rate, req/s
    base_slow: list[SlowResult] = field(default_factory=list)
    cand_slow: list[SlowResult] = field(default_factory=list)
    error: str | None = None  # a replay that raised (the ratio is then censored)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {"variant_id": self.arm.variant.variant_id, "describe": self.arm.variant.describe(),
                "ratio": self.ratio.to_json(), "rate": self.rate, "base_slow": [s.to_json() for s in self.base_slow],
                "cand_slow": [s.to_json() for s in self.cand_slow], "error": self.error, "seconds": self.seconds}


@dataclass
class StaticSweep:
    """find_static_best's sweep: which fixed batch won, what each one measured, and what failed."""

    variant: WorkloadVariant
    throughput: dict[int, float]  # fixed batch -> fast-tier requests/s on the synthetic load (the form chosen)
    errors: dict[str, str]  # "compiled, batch 4" -> the error it raised
    note: str = ""  # why static-best is not the rule's form (its compile failed at every batch), or ""
    seconds: float = 0.0
    recorded: str = ""  # the device whose recorded sweep this is (not swept in this run), or ""

    def to_json(self) -> dict:
        return {"variant": self.variant.to_json(), "throughput": {str(b): r for b, r in self.throughput.items()},
                "errors": self.errors, "note": self.note, "seconds": self.seconds, "recorded": self.recorded}


@dataclass
class WorkloadTuning:
    workload: str
    device: str
    trace: str  # the size trace's source and rate
    static: Arm
    static_slow: SlowResult | None
    arms: list[Arm]
    exact: Comparison | None  # the fastest bit-exact candidate against static-best
    tolerance: Comparison | None  # the fastest candidate passing tolerance mode against static-best
    chosen: WorkloadVariant
    verdict: str  # the chosen comparison's (better), or the best bit-exact one's when static-best stays
    reason: str
    seconds: float
    sweep: StaticSweep | None = None
    budget_s: float | None = None

    @property
    def unmeasured(self) -> list[str]:
        """Candidates left unmeasured because the time budget was spent."""
        return [a.variant.name for a in self.arms if a.skipped]

    def to_json(self) -> dict:
        return {"workload": self.workload, "device": self.device, "trace": self.trace, "static": self.static.to_json(),
                "static_slow": self.static_slow.to_json() if self.static_slow else None,
                "arms": [a.to_json() for a in self.arms], "exact": self.exact.to_json() if self.exact else None,
                "tolerance": self.tolerance.to_json() if self.tolerance else None,
                "chosen": self.chosen.to_json(), "verdict": self.verdict, "reason": self.reason,
                "seconds": self.seconds, "sweep": self.sweep.to_json() if self.sweep else None,
                "budget_s": self.budget_s, "unmeasured": self.unmeasured}


def error_line(e: BaseException) -> str:
    """``ExceptionType: its first non-empty line`` (200 characters at most)."""
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {first[:200]}"


def _free(device: str | torch.device) -> None:
    """After an arm: frees what its runners held (a graphed runner and its graphs form a reference cycle, which
    only the collector frees; an out-of-memory arm must not starve the next)."""
    gc.collect()
    if torch.device(device).type == "cuda":
        try:
            torch.cuda.empty_cache()
        except Exception:  # a sticky CUDA error: the next arm reports it as its own
            pass


@contextmanager
def loud_recompile_limit() -> Iterator[None]:
    """Within the block, dynamo's recompile limit raises (the arm's error) instead of running the code eagerly
    without a word: a tuning must not measure eager code under a compiled variant's name."""
    import torch._dynamo.config as config

    name = next((n for n in ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit") if hasattr(config, n)), None)
    if name is None or config.suppress_errors:  # the two cannot both be on
        yield
        return
    with config.patch(**{name: True}):
        yield


def find_static_best(workload: Workload, module: torch.nn.Module, device: str | torch.device,
                     cfg: TuneConfig = TuneConfig(), until: float | None = None) -> StaticSweep:
    """Static-best with the fixed batch that serves the most requests per second on a synthetic load of the
    workload's middle size (``cfg.mix`` requests), among ``cfg.sweep`` (up to twice the policy's batch). A batch
    that raises is left out; where the rule's compiled form raises at every batch, eager is swept instead.
    ``until`` (a ``time.perf_counter()`` value): once a batch has been measured, no further one starts after it
    (the note says where the sweep stopped). With ``cfg.recorded``, a sweep recorded for this kind of device (or
    another GPU) is taken instead, unswept; with ``cfg.record``, a sweep that ran is recorded."""
    t0 = time.perf_counter()
    batches = [b for b in cfg.sweep if b <= 2 * workload.batch.max_batch]
    entry = recorded_static_best(workload.name, device) if cfg.recorded else None
    if entry is not None and cfg.compile in (None, entry["compile"]) \
            and set(batches) <= {int(b) for b in entry.get("batches", entry["throughput"])}:
        return StaticSweep(static_best(workload, device, max_batch=entry["max_batch"], compile=entry["compile"]),
                           {int(b): r for b, r in entry["throughput"].items()}, {},
                           f"the sweep recorded on {entry['device']} on {entry['date']} (torch {entry['torch']}), "
                           "not run again", time.perf_counter() - t0, recorded=entry["device"])
    requests = workload.make_inputs([workload.default_size] * cfg.mix, cfg.seed + 1, device)
    if not batches:
        raise ValueError(f"{workload.name}: no batch of the sweep {cfg.sweep} is within twice the policy's "
                         f"({workload.batch.max_batch})")
    throughput: dict[int, float] = {}
    errors: dict[str, str] = {}
    note, use_compile = "", cfg.compile
    while True:
        for b in batches:
            if throughput and until is not None and time.perf_counter() >= until:
                note = "; ".join(filter(None, [note, f"the sweep stopped before batch {b} ({BUDGET_SPENT})"]))
                break
            variant = static_best(workload, device, max_batch=b, compile=use_compile)
            try:
                throughput[b] = fast_tier(build_runner(workload, variant, module, device), requests, cfg.repeats)
            except Exception as e:  # noqa: BLE001 -- any failure of one form is a finding, KeyboardInterrupt is not
                errors[f"{'compiled' if variant.compile_mode else 'eager'}, batch {b}"] = error_line(e)
                _free(device)
        if throughput or not variant.compile_mode:
            break
        note = f"torch.compile failed at every batch ({next(iter(errors.values()))}): static-best runs eager"
        use_compile = False
    if not throughput:
        raise RuntimeError(f"{workload.name}: static-best failed at every batch on {device}: {errors}")
    best = max(throughput, key=throughput.__getitem__)
    chosen = static_best(workload, device, max_batch=best, compile=use_compile)
    if cfg.record and set(throughput) | {int(k.rsplit(" ", 1)[-1]) for k in errors} >= set(batches):
        # only a whole sweep (none cut short by the budget) is recorded, with the batches it covered
        record_static_best(workload.name, device, best, chosen.compile_mode is not None, throughput, batches)
    return StaticSweep(chosen, throughput, errors, note, time.perf_counter() - t0)


def candidates(workload: Workload, device: str | torch.device, static: WorkloadVariant) -> list[WorkloadVariant]:
    """Variants worth measuring against ``static`` on ``device``, in CANDIDATE_NAMES' order: eager and compiled
    forms, larger batches, batch buckets (the sizes compiled code and graphs then see), CUDA graphs of the eager
    module (replaying the eager kernels: the GPU forms most likely to stay bit-exact), the same with the hot ops
    as Triton kernels, channels-last inputs, and the precision variants. Those that cannot run here are left out
    (``refusal``); listing them needs no GPU."""
    b = static.max_batch or workload.batch.max_batch
    buckets = tuple(x for x in (1, 2, 4, 8, 16, 32) if x < 2 * b) + (2 * b,)
    # the eager forms on a GPU with the reference's deterministic algorithms (a scatter-add by atomics could not
    # stay bit-exact); a CPU's eager kernels already are
    det = torch.device(device).type == "cuda"
    out = {"eager": WorkloadVariant(name="eager", max_batch=b, deterministic=det),
           "eager-2x": WorkloadVariant(name="eager-2x", max_batch=2 * b, deterministic=det),
           # one request per replayed graph: the reference's own kernels, captured
           "graphs-eager-b1": WorkloadVariant(name="graphs-eager-b1", cuda_graphs=True, max_batch=1,
                                              deterministic=det),
           "graphs-eager": WorkloadVariant(name="graphs-eager", cuda_graphs=True, max_batch=2 * b,
                                           bucket_sizes=buckets, deterministic=det),
           # graphs-eager with the hot ops (spectral multiply, message sums) as fused Triton kernels; only for
           # workloads that have one (``refusal``)
           "triton-ops": WorkloadVariant(name="triton-ops", cuda_graphs=True, max_batch=2 * b, bucket_sizes=buckets,
                                         deterministic=det, hot_ops="triton"),
           "compile-buckets": WorkloadVariant(name="compile-buckets", compile_mode="default", max_batch=2 * b,
                                              bucket_sizes=buckets),
           "graphs": WorkloadVariant(name="graphs", compile_mode="default", cuda_graphs=True, max_batch=2 * b,
                                     bucket_sizes=buckets),
           "reduce-overhead": WorkloadVariant(name="reduce-overhead", compile_mode="reduce-overhead", max_batch=2 * b,
                                              bucket_sizes=buckets),
           "channels-last": WorkloadVariant(name="channels-last", compile_mode=static.compile_mode, max_batch=b,
                                            channels_last=True),
           "bf16": WorkloadVariant(name="bf16", compile_mode=static.compile_mode, max_batch=b,
                                   matmul_precision="bf16"),
           "tf32": WorkloadVariant(name="tf32", compile_mode="default", max_batch=b, matmul_precision="tf32"),
           "autotune": WorkloadVariant(name="autotune", compile_mode="max-autotune-no-cudagraphs", max_batch=2 * b,
                                       bucket_sizes=buckets)}
    seen, kept = {static.variant_id}, []
    for name in CANDIDATE_NAMES:
        v = out[name]
        if v.variant_id not in seen and refusal(workload, v, device) is None:
            seen.add(v.variant_id)
            kept.append(v)
    return kept


def _measure(workload: Workload, arm: Arm, module: torch.nn.Module, device: str, mix, cfg: TuneConfig) -> None:
    t0 = time.perf_counter()
    try:
        arm.gate = gate_workload(workload, arm.variant, module, device, batch_sizes=cfg.gate_batches,
                                 rounds=cfg.gate_rounds, seed=cfg.seed + 7)
        if not arm.gate.passed and arm.gate.mode == BIT_EXACT:
            arm.tolerance_gate = gate_workload(workload, arm.variant, module, device, mode=TOLERANCE,
                                               batch_sizes=cfg.gate_batches, rounds=cfg.gate_rounds,
                                               seed=cfg.seed + 7)
        arm.fast = fast_tier(build_runner(workload, arm.variant, module, device), mix, cfg.repeats)
    except Exception as e:  # noqa: BLE001 -- a compile, capture or kernel failure is this arm's result
        arm.error = error_line(e)
    finally:
        _free(device)
        arm.seconds = time.perf_counter() - t0


def _long_enough(workload: Workload, trace: SizeTrace, given: bool, static_fast: float,
                 cfg: TuneConfig) -> SizeTrace:
    """The slow tier's trace: at least ``cfg.busy_s`` of static-best's work at its fast-tier throughput (a
    model served in microseconds needs thousands of requests, or a replay is a handful of batches and its
    first one's noise), the default trace's next requests added; a trace the caller gave is kept as it is."""
    want = math.ceil(static_fast * cfg.busy_s)
    if given or want <= len(trace.requests):
        return trace
    try:
        return size_trace(workload, want)
    except ValueError:  # the trace is shorter: all of it
        return size_trace(workload, len(load_trace(DEFAULT_TRACE)))


def saturating(trace: SizeTrace, cfg: TuneConfig, *fast: float) -> SizeTrace:
    """``trace`` at ``cfg.load`` times the fastest of the arms' fast-tier throughputs: arrivals faster than
    either arm serves, so each one's throughput is its capacity on these sizes, not the offered rate."""
    top = max((f for f in fast if f > 0), default=0.0)
    return trace.scaled(cfg.load * top) if top > 0 else trace


def _compare(workload: Workload, arm: Arm, base: WorkloadRunner, module: torch.nn.Module, device: str,
             trace: SizeTrace, requests, cfg: TuneConfig, deadline: float | None, base_fast: float) -> Comparison:
    t0 = time.perf_counter()
    comp = Comparison(arm, Ratio(math.nan, math.nan, math.nan, 0, CENSORED))
    trace = saturating(trace, cfg, base_fast, arm.fast)
    comp.rate = trace.rate if math.isfinite(trace.rate) else 0.0  # 0: every request arrives at once

    def measure(runner: WorkloadRunner, into: list[SlowResult]) -> float:
        result = slow_tier(runner, trace, requests)
        into.append(result)
        return result.throughput

    try:
        cand = build_runner(workload, arm.variant, module, device)
        for runner in (base, cand):
            if runner.variant.compile_mode or runner.variant.cuda_graphs:  # compiling and capturing, untimed
                warm_up(runner, requests)
                slow_tier(runner, trace, requests)
        comp.ratio = paired(lambda: measure(base, comp.base_slow), lambda: measure(cand, comp.cand_slow),
                            cfg.rounds, deadline)
    except Exception as e:  # noqa: BLE001 -- as in _measure: the comparison's result, censored
        comp.error = error_line(e)
        _free(device)
    comp.seconds = time.perf_counter() - t0
    return comp


def _reason(arms: list[Arm], exact: Arm | None, exact_cmp: Comparison | None, pick: Comparison | None) -> str:
    if pick is not None:
        v = pick.arm.variant
        return (f"{v.name} ({v.describe()}) {pick.ratio.line()} static-best's throughput on the replayed trace; "
                f"its gate: {pick.arm.gate.line()}")
    if exact_cmp is None and arms and all(a.skipped for a in arms):
        return f"no candidate was measured ({BUDGET_SPENT}): static-best stays"
    if exact_cmp is None:
        return "no candidate passed the bit-exact gate: static-best stays"
    what = f"the fastest bit-exact candidate, {exact.variant.name} ({exact.variant.describe()}),"
    if exact_cmp.error:
        return f"comparing {what} with static-best failed ({exact_cmp.error}): static-best stays"
    return (f"{what} is {exact_cmp.ratio.line()} static-best's: its lower bound does not exceed {MIN_GAIN} (the "
            "judge's minimum gain), static-best stays")


def tune_workload(name: str, device: str = "cpu", cfg: TuneConfig = TuneConfig(), trace: SizeTrace | None = None,
                  variants: list[WorkloadVariant] | None = None) -> WorkloadTuning:
    """Tunes workload ``name`` on ``device`` (module docstring); ``trace``: the request sizes (default: the Azure
    conversation trace's first ``cfg.requests`` requests, sizes by rank); ``variants``: the candidates (default:
    ``candidates``, less compiled ones without ``cfg.compile_candidates``, only ``cfg.candidates`` if named)."""
    t0 = time.perf_counter()
    workload = get_workload(name)
    module = workload.build(device)
    try:
        with loud_recompile_limit():
            return _tune(workload, module, device, cfg, trace, variants, t0)
    finally:
        release_compiled(module)


def _tune(workload: Workload, module: torch.nn.Module, device: str, cfg: TuneConfig, trace: SizeTrace | None,
          variants: list[WorkloadVariant] | None, t0: float) -> WorkloadTuning:
    deadline = t0 + cfg.budget_s if cfg.budget_s else None
    measure_until = t0 + MEASURE_SHARE * cfg.budget_s if cfg.budget_s else None
    given = trace is not None
    trace = trace or size_trace(workload, cfg.requests)
    sweep = find_static_best(workload, module, device, cfg, measure_until)
    mix = mix_requests(workload, trace, cfg.mix, cfg.seed + 2, device)
    static = Arm(sweep.variant)
    _measure(workload, static, module, device, mix, cfg)
    if static.error and sweep.recorded:  # the recorded form fails here (another GPU's compile): sweep after all
        was, error = sweep.recorded, static.error
        sweep = find_static_best(workload, module, device, replace(cfg, recorded=False), measure_until)
        sweep.note = "; ".join(filter(None, [f"the form recorded on {was} failed here ({error}): swept", sweep.note]))
        static = Arm(sweep.variant)
        _measure(workload, static, module, device, mix, cfg)
    static_variant = sweep.variant
    base = build_runner(workload, static_variant, module, device)
    trace = _long_enough(workload, trace, given, static.fast, cfg)
    requests = workload.make_inputs(trace.sizes, cfg.seed + 3, device)
    if variants is None:
        variants = [v for v in candidates(workload, device, static_variant)
                    if (cfg.compile_candidates or not v.compile_mode)
                    and (not cfg.candidates or v.name in cfg.candidates)]
    arms = []
    for v in variants:
        arm = Arm(v)
        if measure_until is not None and time.perf_counter() >= measure_until:
            arm.skipped = BUDGET_SPENT
        else:
            _measure(workload, arm, module, device, mix, cfg)
        arms.append(arm)
    ran = [a for a in arms if a.error is None and a.skipped is None]
    exact = max((a for a in ran if a.exact), key=lambda a: a.fast, default=None)
    tolerable = max((a for a in ran if a.tolerable), key=lambda a: a.fast, default=None)
    exact_cmp = (_compare(workload, exact, base, module, device, trace, requests, cfg, deadline, static.fast)
                 if exact else None)
    if tolerable is exact:
        tol_cmp = exact_cmp
    else:
        tol_cmp = (_compare(workload, tolerable, base, module, device, trace, requests, cfg, deadline, static.fast)
                   if tolerable else None)
    static_slow = next((c.base_slow[-1] for c in (exact_cmp, tol_cmp) if c is not None and c.base_slow), None)
    pick = [c for c in ([exact_cmp] + ([tol_cmp] if cfg.allow_tolerance else [])) if c is not None]
    pick = max((c for c in pick if c.ratio.verdict == BETTER and c.ratio.low > MIN_GAIN), key=lambda c: c.ratio.low,
               default=None)
    chosen = pick.arm.variant if pick else static_variant
    verdict = BETTER if pick else exact_cmp.ratio.verdict if exact_cmp else CENSORED
    return WorkloadTuning(workload.name, str(device), f"{trace.source}", static, static_slow, arms, exact_cmp,
                          tol_cmp, replace(chosen), verdict, _reason(arms, exact, exact_cmp, pick),
                          time.perf_counter() - t0, sweep, cfg.budget_s)
