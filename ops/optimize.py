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
    """The best by goodput, then output tokens/s. It replaces the baseline only when it is better by
    more than the measured spreads: goodput higher by more than both goodput spreads, or goodput no
    worse (within the spreads) and output tokens/s higher by more than both throughput spreads."""
    base_spec, base = baseline

    def wins(r: BenchResult) -> bool:
        g_margin = r.goodput_spread + base.goodput_spread
        if r.goodput - base.goodput > g_margin:
            return True
        return base.goodput - r.goodput <= g_margin and r.output_tok_s - base.output_tok_s > r.spread + base.spread

    better = [c for c in candidates if c[0].variant_id != base_spec.variant_id and wins(c[1])]
    if not better:
        best_spec, best = max(candidates + [baseline], key=lambda c: (round(c[1].goodput, 6), c[1].output_tok_s))
        if best_spec.variant_id == base_spec.variant_id:
            return Choice(base_spec, base, base, "the baseline measured best; nothing to change")
        return Choice(base_spec, base, base,
                      f"best candidate {best_spec.variant_id} ({best.output_tok_s:.2f} tok/s, goodput "
                      f"{best.goodput:.2f}) does not beat the baseline ({base.output_tok_s:.2f} tok/s, goodput "
                      f"{base.goodput:.2f}) by more than the spreads; keeping the baseline")
    best_spec, best = max(better, key=lambda c: (round(c[1].goodput, 6), c[1].output_tok_s))
    return Choice(best_spec, best, base,
                  f"{best_spec.variant_id} ({best_spec.name}): goodput {best.goodput:.2f} vs {base.goodput:.2f} req/s "
                  f"(spreads {best.goodput_spread:.2f}, {base.goodput_spread:.2f}), {best.output_tok_s:.1f} vs "
                  f"{base.output_tok_s:.1f} output tok/s (spreads {best.spread:.2f}, {base.spread:.2f})")


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
