"""Tuning a workload: static-best found without traffic, candidate variants measured on the traffic's sizes, gated,
compared with static-best in paired rounds, and the best gated one chosen only when the comparison says so.

``tune_workload`` in order:

1. **static-best** (``find_static_best``): engine/workloads/static_best.py's setup with the best fixed batch of a
   sweep on a fixed synthetic load (the workload's middle size only: no traffic).
2. **candidates** (``candidates``): forms of the forward pass and of batching for the device.
3. **gate**: every candidate in its own mode (bit-exact unless it changes precision on purpose); one that fails
   bit-exact is gated again in tolerance mode, so it can count for the tolerance-mode line.
4. **fast tier**: every runnable candidate's throughput on the traffic's size mix; the fastest bit-exact one
   and the fastest that passes tolerance mode go on.
5. **slow tier, paired**: each of those and static-best replay the request-size trace in alternation, A B A B;
   the throughput ratio's 95% interval (bootstrap over rounds) gives the verdict.
6. **choice**: the bit-exact candidate replaces static-best only when its verdict is "better" and its ratio's lower
   bound exceeds the judge's minimum gain (``ops.judge.rule.MIN_GAIN``, 1.05: the LLM loop's rule)
   (``allow_tolerance``: the tolerance-mode one may too); otherwise static-best stays.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from checks.workload_gate import BIT_EXACT, TOLERANCE, GateResult, gate_workload
from engine.workloads.static_best import static_best
from engine.workloads.variants import WorkloadRunner, WorkloadVariant, build_runner, refusal
from engine.workloads.workload import Workload, get_workload
from ops.judge.rule import MIN_GAIN
from ops.workloads.tiers import BETTER, CENSORED, Ratio, SlowResult, fast_tier, mix_requests, paired, slow_tier
from ops.workloads.traffic import SizeTrace, size_trace


@dataclass(frozen=True)
class TuneConfig:
    """How much a tuning replays. The defaults suit a 2-core CPU; a GPU affords more."""

    requests: int = 96  # trace requests the slow tier replays
    mix: int = 16  # requests of the fast tier's mix
    repeats: int = 3  # fast-tier timed runs
    rounds: int = 4  # paired slow-tier rounds per comparison
    load: float = 2.0  # the trace replays at this multiple of static-best's fast-tier throughput (saturated)
    gate_batches: tuple[int, ...] = (1, 3, 8)
    gate_rounds: int = 1
    sweep: tuple[int, ...] = (1, 2, 4, 8, 16)  # fixed batches static-best is chosen among
    allow_tolerance: bool = False  # whether a tolerance-mode variant may be chosen
    compile: bool | None = None  # static-best's torch.compile (None: engine/workloads/static_best.py's rule)
    compile_candidates: bool = True  # measure compiled candidates (each new shape compiles: slow on a small CPU)
    seed: int = 0


@dataclass
class Arm:
    variant: WorkloadVariant
    refused: str | None = None  # why it cannot run here
    gate: GateResult | None = None  # in its own mode
    tolerance_gate: GateResult | None = None  # when it failed bit-exact
    fast: float = 0.0  # requests/s on the traffic's mix
    error: str | None = None  # a run that raised

    @property
    def exact(self) -> bool:
        return self.gate is not None and self.gate.passed and self.gate.mode == BIT_EXACT

    @property
    def tolerable(self) -> bool:
        return self.exact or any(g is not None and g.passed and g.mode == TOLERANCE
                                 for g in (self.gate, self.tolerance_gate))

    def to_json(self) -> dict:
        return {"variant": self.variant.to_json(), "describe": self.variant.describe(), "refused": self.refused,
                "gate": self.gate.to_json() if self.gate else None,
                "tolerance_gate": self.tolerance_gate.to_json() if self.tolerance_gate else None,
                "fast": self.fast, "error": self.error}


@dataclass
class Comparison:
    arm: Arm
    ratio: Ratio
    base_slow: list[SlowResult] = field(default_factory=list)
    cand_slow: list[SlowResult] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"variant_id": self.arm.variant.variant_id, "describe": self.arm.variant.describe(),
                "ratio": self.ratio.to_json(), "base_slow": [s.to_json() for s in self.base_slow],
                "cand_slow": [s.to_json() for s in self.cand_slow]}


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

    def to_json(self) -> dict:
        return {"workload": self.workload, "device": self.device, "trace": self.trace, "static": self.static.to_json(),
                "static_slow": self.static_slow.to_json() if self.static_slow else None,
                "arms": [a.to_json() for a in self.arms], "exact": self.exact.to_json() if self.exact else None,
                "tolerance": self.tolerance.to_json() if self.tolerance else None,
                "chosen": self.chosen.to_json(), "verdict": self.verdict, "reason": self.reason,
                "seconds": self.seconds}


def find_static_best(workload: Workload, module: torch.nn.Module, device: str | torch.device,
                     cfg: TuneConfig = TuneConfig()) -> WorkloadVariant:
    """Static-best with the fixed batch that serves the most requests per second on a synthetic load of the
    workload's middle size (``cfg.mix`` requests), among ``cfg.sweep`` (up to twice the policy's batch)."""
    requests = workload.make_inputs([workload.default_size] * cfg.mix, cfg.seed + 1, device)
    best, best_rps = None, 0.0
    for b in [b for b in cfg.sweep if b <= 2 * workload.batch.max_batch]:
        variant = static_best(workload, device, max_batch=b, compile=cfg.compile)
        rps = fast_tier(build_runner(workload, variant, module, device), requests, cfg.repeats)
        if rps > best_rps:
            best, best_rps = variant, rps
    return best


def candidates(workload: Workload, device: str | torch.device, static: WorkloadVariant) -> list[WorkloadVariant]:
    """Variants worth measuring against ``static`` on ``device``: eager and compiled forms, larger batches, batch
    buckets (the sizes compiled code and graphs then see), channels-last inputs, and the precision variants.
    Those that cannot run here are left out (``refusal``)."""
    b = static.max_batch or workload.batch.max_batch
    buckets = tuple(x for x in (1, 2, 4, 8, 16, 32) if x < 2 * b) + (2 * b,)
    cuda = torch.device(device).type == "cuda"
    out = [WorkloadVariant(name="eager", max_batch=b),
           WorkloadVariant(name="eager-2x", max_batch=2 * b),
           WorkloadVariant(name="compile-buckets", compile_mode="default", max_batch=2 * b, bucket_sizes=buckets),
           WorkloadVariant(name="channels-last", compile_mode=static.compile_mode, max_batch=b, channels_last=True),
           WorkloadVariant(name="bf16", compile_mode=static.compile_mode, max_batch=b, matmul_precision="bf16")]
    if cuda:
        out += [WorkloadVariant(name="graphs", compile_mode="default", cuda_graphs=True, max_batch=2 * b,
                                bucket_sizes=buckets),
                WorkloadVariant(name="autotune", compile_mode="max-autotune-no-cudagraphs", max_batch=2 * b,
                                bucket_sizes=buckets),
                WorkloadVariant(name="reduce-overhead", compile_mode="reduce-overhead", max_batch=2 * b,
                                bucket_sizes=buckets),
                WorkloadVariant(name="tf32", compile_mode="default", max_batch=b, matmul_precision="tf32")]
    seen, kept = {static.variant_id}, []
    for v in out:
        if v.variant_id not in seen and refusal(workload, v, device) is None:
            seen.add(v.variant_id)
            kept.append(v)
    return kept


def _measure(workload: Workload, arm: Arm, module: torch.nn.Module, device: str, mix, cfg: TuneConfig) -> None:
    try:
        arm.gate = gate_workload(workload, arm.variant, module, device, batch_sizes=cfg.gate_batches,
                                 rounds=cfg.gate_rounds, seed=cfg.seed + 7)
        if not arm.gate.passed and arm.gate.mode == BIT_EXACT:
            arm.tolerance_gate = gate_workload(workload, arm.variant, module, device, mode=TOLERANCE,
                                               batch_sizes=cfg.gate_batches, rounds=cfg.gate_rounds,
                                               seed=cfg.seed + 7)
        arm.fast = fast_tier(build_runner(workload, arm.variant, module, device), mix, cfg.repeats)
    except (RuntimeError, ValueError) as e:  # a compile or kernel failure is this arm's result, not the run's end
        arm.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def _compare(workload: Workload, arm: Arm, base: WorkloadRunner, module: torch.nn.Module, device: str,
             trace: SizeTrace, requests, cfg: TuneConfig) -> Comparison:
    cand = build_runner(workload, arm.variant, module, device)
    comp = Comparison(arm, Ratio(0, 0, 0, 0, CENSORED))

    def measure(runner: WorkloadRunner, into: list[SlowResult]) -> float:
        result = slow_tier(runner, trace, requests)
        into.append(result)
        return result.throughput

    comp.ratio = paired(lambda: measure(base, comp.base_slow), lambda: measure(cand, comp.cand_slow), cfg.rounds)
    return comp


def tune_workload(name: str, device: str = "cpu", cfg: TuneConfig = TuneConfig(), trace: SizeTrace | None = None,
                  variants: list[WorkloadVariant] | None = None) -> WorkloadTuning:
    """Tunes workload ``name`` on ``device`` (module docstring); ``trace``: the request sizes (default: the Azure
    conversation trace's first ``cfg.requests`` requests, sizes by rank); ``variants``: the candidates (default:
    ``candidates``)."""
    t0 = time.perf_counter()
    workload = get_workload(name)
    module = workload.build(device)
    trace = trace or size_trace(workload, cfg.requests)
    static_variant = find_static_best(workload, module, device, cfg)
    base = build_runner(workload, static_variant, module, device)
    mix = mix_requests(workload, trace, cfg.mix, cfg.seed + 2, device)
    static = Arm(static_variant)
    _measure(workload, static, module, device, mix, cfg)
    # saturated: arrivals faster than static-best serves, so throughput is the policy's capacity on these sizes
    trace = trace.scaled(cfg.load * static.fast) if static.fast > 0 else trace
    requests = workload.make_inputs(trace.sizes, cfg.seed + 3, device)
    arms = []
    if variants is None:
        variants = [v for v in candidates(workload, device, static_variant)
                    if cfg.compile_candidates or not v.compile_mode]
    for v in variants:
        arm = Arm(v)
        _measure(workload, arm, module, device, mix, cfg)
        arms.append(arm)
    ran = [a for a in arms if a.error is None]
    exact = max((a for a in ran if a.exact), key=lambda a: a.fast, default=None)
    tolerable = max((a for a in ran if a.tolerable), key=lambda a: a.fast, default=None)
    exact_cmp = _compare(workload, exact, base, module, device, trace, requests, cfg) if exact else None
    if tolerable is exact:
        tol_cmp = exact_cmp
    else:
        tol_cmp = _compare(workload, tolerable, base, module, device, trace, requests, cfg) if tolerable else None
    static_slow = exact_cmp.base_slow[-1] if exact_cmp else tol_cmp.base_slow[-1] if tol_cmp else None
    chosen, verdict, reason = static_variant, exact_cmp.ratio.verdict if exact_cmp else CENSORED, ""
    pick = [c for c in ([exact_cmp] + ([tol_cmp] if cfg.allow_tolerance else [])) if c is not None]
    pick = max((c for c in pick if c.ratio.verdict == BETTER and c.ratio.low > MIN_GAIN), key=lambda c: c.ratio.low,
               default=None)
    if pick is not None:
        chosen, verdict = pick.arm.variant, BETTER
        reason = (f"{pick.arm.variant.name} ({pick.arm.variant.describe()}) {pick.ratio.line()} static-best's "
                  f"throughput on the replayed trace; its gate: {pick.arm.gate.line()}")
    elif exact_cmp is None:
        reason = "no candidate passed the bit-exact gate: static-best stays"
    else:
        reason = (f"the fastest bit-exact candidate, {exact.variant.name} ({exact.variant.describe()}), is "
                  f"{exact_cmp.ratio.line()} static-best's: its lower bound does not exceed {MIN_GAIN} (the judge's "
                  "minimum gain), static-best stays")
    return WorkloadTuning(workload.name, str(device), f"{trace.source}", static, static_slow, arms, exact_cmp,
                          tol_cmp, replace(chosen), verdict, reason, time.perf_counter() - t0)
