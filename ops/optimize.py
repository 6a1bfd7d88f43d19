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
    """The best by goodput, then output tokens/s; it must beat the baseline by more than both spreads."""
    base_spec, base = baseline
    best_spec, best = max(candidates + [baseline], key=lambda c: (round(c[1].goodput, 6), c[1].output_tok_s))
    margin = best.spread + base.spread
    gain = best.output_tok_s - base.output_tok_s
    if best_spec.variant_id == base_spec.variant_id:
        return Choice(base_spec, base, base, "the baseline measured best; nothing to change")
    if best.goodput <= base.goodput and gain <= margin:
        return Choice(base_spec, base, base,
                      f"best candidate {best_spec.variant_id} gains {gain:.2f} tok/s, within the spread ({margin:.2f}); "
                      "keeping the baseline")
    return Choice(best_spec, best, base,
                  f"{best_spec.variant_id} ({best_spec.name}): goodput {best.goodput:.2f} vs {base.goodput:.2f} req/s, "
                  f"{best.output_tok_s:.1f} vs {base.output_tok_s:.1f} output tok/s (spreads {best.spread:.2f}, "
                  f"{base.spread:.2f})")


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
