"""The decision table a person reads, and the EngineBuild that records a decision (the judge decides: ops/judge/rule.py)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from checks.report import QualityReport
from engine.config.variant import VariantSpec
from ops.measure.tiers import BenchResult


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
    strictly (a capacity is below the rate that failed). A bracket's range, not a decision: decisions are the
    judge's (ops/judge/rule.py)."""
    if old.capacity <= 0:
        return float("nan"), float("nan"), float("nan")
    ratio = new.capacity / old.capacity
    low = new.capacity / (old.capacity + old.capacity_spread)
    high = (new.capacity + new.capacity_spread) / old.capacity
    return ratio, low, high


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
