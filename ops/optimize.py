"""Choosing a variant from measurements, and the EngineBuild that records why (design sections 3 and 8)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from checks.report import QualityReport
from engine.variant import VariantSpec
from ops.bench import BenchResult


@dataclass
class Choice:
    variant: VariantSpec
    result: BenchResult
    baseline: BenchResult
    reason: str


def capacity_ratio(new: BenchResult, old: BenchResult) -> tuple[float, float, float]:
    """(ratio, low, high) of two capacities at the SLO. Each capacity is the highest rate that passed, with
    the lowest that failed ``capacity_spread`` above it: the true ratio lies between ``low`` (new's passing
    rate over old's failing rate) and ``high`` (new's failing rate over old's passing rate), above ``low``
    strictly (a capacity is below the rate that failed). A ratio whose range holds 1 is no gain
    (``range_holds_one``); ``low`` of 1 is a gain: new passed the very rate old failed."""
    if old.capacity <= 0:
        return float("nan"), float("nan"), float("nan")
    ratio = new.capacity / old.capacity
    low = new.capacity / (old.capacity + old.capacity_spread)
    high = (new.capacity + new.capacity_spread) / old.capacity
    return ratio, low, high


_SAME_RATE = 1e-9  # the relative difference of one rate reached by two searches' arithmetic


def passed_where_failed(low: float) -> bool:
    """Whether a capacity ratio's ``low`` end says new passed a rate old failed (at least 1)."""
    return low >= 1 - _SAME_RATE


def range_holds_one(low: float, high: float) -> bool:
    """Whether a capacity ratio's range leaves gain and loss both possible (``low`` below 1, ``high`` above it)."""
    return not (passed_where_failed(low) or high <= 1 + _SAME_RATE)


def choose(candidates: list[tuple[VariantSpec, BenchResult]], baseline: tuple[VariantSpec, BenchResult]) -> Choice:
    """The best by capacity at the SLO, then SLO attainment at the traffic's own rate, then output tokens/s.
    It replaces the baseline (static-best) only when it is measurably better: it passed a rate at which
    static-best failed (their capacity brackets do not overlap: ``capacity_ratio``'s low end at least 1), or
    its capacity bracket overlaps static-best's and its output tokens/s is higher by more than both
    throughput spreads (measured over two or more replays each: one replay has no spread to compare)."""
    base_spec, base = baseline

    def key(r: BenchResult) -> tuple:
        return (round(r.capacity, 6), round(r.attainment, 6), r.output_tok_s)

    def wins(r: BenchResult) -> bool:
        if base.capacity > 0 and passed_where_failed(capacity_ratio(r, base)[1]):
            return True
        if base.capacity == 0 and r.capacity > 0 and base.capacity_spread <= r.capacity:
            return True  # static-best failed at a rate the candidate passed
        overlap = r.capacity + r.capacity_spread >= base.capacity and base.capacity + base.capacity_spread >= r.capacity
        return overlap and r.repeats > 1 and base.repeats > 1 and \
            r.output_tok_s - base.output_tok_s > r.spread + base.spread and r.attainment >= base.attainment

    better = [c for c in candidates if c[0].variant_id != base_spec.variant_id and wins(c[1])]
    if not better:
        best_spec, best = max(candidates + [baseline], key=lambda c: key(c[1]))
        if best_spec.variant_id == base_spec.variant_id:
            return Choice(base_spec, base, base, "static-best measured best; kept static-best")
        return Choice(base_spec, base, base,
                      f"best candidate {best_spec.variant_id} ({best_spec.name}: capacity {best.capacity:.2f} req/s, "
                      f"{best.output_tok_s:.1f} tok/s) is not measurably better than static-best (capacity "
                      f"{base.capacity:.2f} req/s, {base.output_tok_s:.1f} tok/s): its capacity bracket overlaps "
                      f"static-best's and its throughput is not higher by more than both spreads; kept static-best")
    best_spec, best = max(better, key=lambda c: key(c[1]))
    return Choice(best_spec, best, base,
                  f"{best_spec.variant_id} ({best_spec.name}): capacity {best.capacity:.2f} vs {base.capacity:.2f} "
                  f"req/s (brackets {best.capacity:.2f}-{best.capacity + best.capacity_spread:.2f} and "
                  f"{base.capacity:.2f}-{base.capacity + base.capacity_spread:.2f}), {best.output_tok_s:.1f} vs "
                  f"{base.output_tok_s:.1f} output tok/s (spreads {best.spread:.2f}, {base.spread:.2f})")


def capacity_line(chosen: BenchResult, static_best: BenchResult) -> str:
    """The headline every report prints: capacity at SLO, chosen / static-best, with the ratio's range from
    both capacity brackets, both spreads and the SLO."""
    ratio, low, high = capacity_ratio(chosen, static_best)
    return (f"capacity at SLO, chosen / static-best: {ratio:.2f}x (range {low:.2f}-{high:.2f}x from the spreads "
            f"{chosen.capacity_spread:.2f} and {static_best.capacity_spread:.2f} req/s; {chosen.capacity:.2f} vs "
            f"{static_best.capacity:.2f} req/s at TTFT <= {1e3 * static_best.slo_ttft_s:.0f} ms and TPOT <= "
            f"{1e3 * static_best.slo_tpot_s:.0f} ms for 90% of requests)")


def decision_table(static_best: VariantSpec, measured: list[tuple[VariantSpec, BenchResult]], chosen_id: str,
                   gate_verdict: str | None = None, judged=None) -> str:
    """Every measured variant as a person reads the decision: what differs from static-best, the tier, output
    tokens/s, capacity at the SLO (the judge's, with its 95% interval; "pred" the simulator's where the judge did
    not replay it), TTFT and TPOT p50/p99, and the gates' verdict (the chosen variant's; '-' where none ran).
    Fast-tier rows carry step-time figures only."""
    head = (f"{'variant':34} {'differs from static-best':44} {'tier':4} {'tok/s':>7} {'capacity req/s (95%)':>22} "
            f"{'TTFT p50/p99 ms':>16} {'TPOT p50/p99 ms':>16}  gates")
    lines = [head, "-" * len(head)]
    for v, r in measured:
        slow = r.tier == "slow"
        judged_cap = judged.capacity(v.variant_id) if judged is not None and slow else None
        if judged_cap is not None:
            c = judged_cap
            hi = "inf" if c.high == float("inf") else f"{c.high:.2f}"
            cap = (f"<{c.estimate:.3f}" if c.censored == "below" else f">{c.estimate:.3f}" if c.censored == "above"
                   else f"{c.estimate:.3f} ({c.low:.2f}-{hi})")
        elif slow and judged is not None:
            cap = f"pred {r.capacity_predicted:.3f}"
        else:
            cap = f"{r.capacity:.3f} (+{r.capacity_spread:.3f})" if slow else "-"
        ttft = f"{1e3 * r.ttft_p50:.0f}/{1e3 * r.ttft_p99:.0f}" if slow else "-"
        tpot = f"{1e3 * r.tpot_p50:.1f}/{1e3 * r.tpot_p99:.1f}" if slow else "-"
        gates = (gate_verdict or "-") if v.variant_id == chosen_id and v.variant_id != static_best.variant_id else "-"
        mark = "* " if slow and v.variant_id == chosen_id else "  "
        lines.append(f"{mark}{v.name[:32]:32} {v.changes_from(static_best)[:44]:44} {r.tier:4} {r.output_tok_s:7.1f} "
                     f"{cap:>22} {ttft:>16} {tpot:>16}  {gates}")
    base = next((r for v, r in measured if r.tier == "slow" and v.variant_id == static_best.variant_id), None)
    for v, r in measured:  # precision apart from kernels and knobs: static-best keeps the checkpoint's
        own = [f"{x} {getattr(v, x)}" for x in ("weight_dtype", "kv_cache_dtype") if getattr(v, x) != "auto"]
        if r.tier == "slow" and own and base is not None:
            lines.append(f"  precision: {v.name[:32]} ({', '.join(own)}): saturation {r.saturation:.3f} vs static-best "
                         f"{base.saturation:.3f} req/s, {r.output_tok_s:.1f} vs {base.output_tok_s:.1f} tok/s at the "
                         "traffic's rate")
    for v, r in measured:
        if r.tier == "slow" and r.spec_accepted_length:
            lines.append(f"  {v.name[:32]}: speculation accepted {r.spec_acceptance:.0%} of drafted tokens, "
                         f"{r.spec_accepted_length:.2f} tokens per verified draft")
    lines.append("(* the chosen variant; capacity: where the judge's monotone fit of its probes crosses 90% attainment, "
                 "with the 95% interval, < or > when censored, pred: the simulator's; fast tier: decode tokens/s of a "
                 "few layers)")
    return "\n".join(lines)


@dataclass
class EngineBuild:
    variant: VariantSpec
    source_hash: str  # the variant id (content hash of everything that defines the engine form)
    bench: dict
    baseline_bench: dict
    reason: str
    traffic_profile: dict
    model_weights_hash: str
    quality: dict | None = None  # the QualityReport, once the gates have run
    provenance: dict = field(default_factory=dict)
    judgement: dict | None = None  # the judge's (ops/judge.Judgement): capacities, intervals, verdict

    def to_json(self) -> dict:
        d = asdict(self)
        d["variant"] = self.variant.to_json()
        return d

    def attach_quality(self, report: QualityReport) -> None:
        self.quality = report.to_json()
