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


def choose(candidates: list[tuple[VariantSpec, BenchResult]], baseline: tuple[VariantSpec, BenchResult]) -> Choice:
    """The best by capacity at the SLO, then SLO attainment at the traffic's own rate, then output tokens/s.
    It replaces the baseline (static-best) only when it is better by more than the measured spreads:
    capacity higher by more than both capacities' spreads (the width of their final rate brackets), or
    capacity no worse (within them) and output tokens/s higher by more than both throughput spreads."""
    base_spec, base = baseline

    def key(r: BenchResult) -> tuple:
        return (round(r.capacity, 6), round(r.attainment, 6), r.output_tok_s)

    def wins(r: BenchResult) -> bool:
        margin = r.capacity_spread + base.capacity_spread
        if r.capacity - base.capacity > margin:
            return True
        return base.capacity - r.capacity <= margin and r.output_tok_s - base.output_tok_s > r.spread + base.spread \
            and r.attainment >= base.attainment

    better = [c for c in candidates if c[0].variant_id != base_spec.variant_id and wins(c[1])]
    if not better:
        best_spec, best = max(candidates + [baseline], key=lambda c: key(c[1]))
        if best_spec.variant_id == base_spec.variant_id:
            return Choice(base_spec, base, base, "static-best measured best; kept static-best")
        return Choice(base_spec, base, base,
                      f"best candidate {best_spec.variant_id} ({best_spec.name}: capacity {best.capacity:.2f} req/s, "
                      f"{best.output_tok_s:.1f} tok/s) does not beat static-best (capacity {base.capacity:.2f} req/s, "
                      f"{base.output_tok_s:.1f} tok/s) by more than the spreads; kept static-best")
    best_spec, best = max(better, key=lambda c: key(c[1]))
    return Choice(best_spec, best, base,
                  f"{best_spec.variant_id} ({best_spec.name}): capacity {best.capacity:.2f} vs {base.capacity:.2f} "
                  f"req/s (spreads {best.capacity_spread:.2f}, {base.capacity_spread:.2f}), {best.output_tok_s:.1f} vs "
                  f"{base.output_tok_s:.1f} output tok/s (spreads {best.spread:.2f}, {base.spread:.2f})")


def capacity_line(chosen: BenchResult, static_best: BenchResult) -> str:
    """The headline every report prints: capacity at SLO, chosen / static-best, with both spreads and the SLO."""
    ratio = chosen.capacity / static_best.capacity if static_best.capacity > 0 else float("nan")
    return (f"capacity at SLO, chosen / static-best: {ratio:.2f}x (spreads {chosen.capacity_spread:.2f} and "
            f"{static_best.capacity_spread:.2f} req/s; {chosen.capacity:.2f} vs {static_best.capacity:.2f} req/s at "
            f"TTFT <= {1e3 * static_best.slo_ttft_s:.0f} ms and TPOT <= {1e3 * static_best.slo_tpot_s:.0f} ms for 90% "
            f"of requests)")


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

    def to_json(self) -> dict:
        d = asdict(self)
        d["variant"] = self.variant.to_json()
        return d

    def attach_quality(self, report: QualityReport) -> None:
        self.quality = report.to_json()
