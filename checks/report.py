"""QualityReport: what the gates measured, their verdict and the reasons."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class QualityThresholds:
    """Limits a candidate must stay within against the reference variant."""

    # share of positions along the reference's tokens where the candidate's top-1 matches the reference's
    # (flips at a rounding tie of the reference excused)
    min_greedy_agreement: float
    max_abs_logit_delta: float  # along the reference's tokens (teacher forcing)
    max_mean_kl: float  # KL(reference || candidate) per position, averaged
    # contamination checks in low precision: the most KL(alone || batched) one position may show when
    # tokens flip at a near-tie through rounding alone (float32 demands identical tokens)
    max_rounding_kl: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_greedy_agreement <= 1.0:
            raise ValueError("min_greedy_agreement must be in [0, 1]")
        if self.max_abs_logit_delta < 0 or self.max_mean_kl < 0:
            raise ValueError("thresholds must be >= 0")


# Per dtype; configuration may replace any of them.
DEFAULT_THRESHOLDS = {
    "float32": QualityThresholds(min_greedy_agreement=0.95, max_abs_logit_delta=1e-3, max_mean_kl=1e-6),
    "bfloat16": QualityThresholds(min_greedy_agreement=0.75, max_abs_logit_delta=0.5, max_mean_kl=5e-3,
                                  max_rounding_kl=2e-2),
    "float16": QualityThresholds(min_greedy_agreement=0.85, max_abs_logit_delta=0.2, max_mean_kl=1e-3,
                                 max_rounding_kl=5e-3),
}

# A variant with quantized weights (engine/model/precision.py) is judged by its precision's limits, whatever the
# checkpoint's dtype: per-channel int8 moves each weight by up to half a step (0.4% of the row's largest
# |w|; about 1% relative error over a matrix, measured on SmolLM2), e4m3 by up to 1/16 of the value (about
# 2.6%), and errors of that size shift logits by tenths, so exact float32 limits would refuse any
# quantization. What must hold is the model's choices: top-1 agreement along the reference's tokens close
# to what bf16 kernels keep (0.75) and a mean KL an order of magnitude under the entropy of a confident
# next-token distribution. Contamination tolerates the rounding KL, because the decode kernel and the
# prefill GEMM round differently, so a row's logits depend slightly on the batch it ran in.
PRECISION_THRESHOLDS = {
    "int8": QualityThresholds(min_greedy_agreement=0.85, max_abs_logit_delta=2.0, max_mean_kl=0.02,
                              max_rounding_kl=0.05),
    "fp8": QualityThresholds(min_greedy_agreement=0.80, max_abs_logit_delta=3.0, max_mean_kl=0.05,
                             max_rounding_kl=0.1),
}


def thresholds_for(dtype: str, weight_dtype: str = "auto", kv_cache_dtype: str = "auto") -> QualityThresholds:
    """The default limits for a checkpoint dtype, or for the variant's own precision: FP8 anywhere (weights or
    KV cache) takes FP8's limits, int8 weights int8's."""
    if "fp8" in (weight_dtype, kv_cache_dtype):
        return PRECISION_THRESHOLDS["fp8"]
    return PRECISION_THRESHOLDS[weight_dtype] if weight_dtype in PRECISION_THRESHOLDS else DEFAULT_THRESHOLDS[dtype]


@dataclass(frozen=True)
class CheckResult:
    name: str  # e.g. "batched", "prefix caching", "poisoned reuse"
    passed: bool
    detail: str


@dataclass
class QualityReport:
    reference_variant: str
    candidate_variant: str
    dtype: str
    prompts: int
    max_tokens: int
    exact: bool
    weight_dtype: str = "auto"  # the candidate's weight precision (its own thresholds when not "auto")
    kv_cache_dtype: str = "auto"  # the candidate's KV cache precision (likewise)
    greedy_agreement: float | None = None  # teacher-forced top-1 agreement, rounding ties excused
    free_running_agreement: float | None = None  # mean share of each prompt's tokens matched before divergence
    tie_margin: float | None = None  # 2x the reference's batch noise: flips within it are ties (or within 2 ulp)
    excused_ties: int | None = None  # top-1 flips excused as rounding ties
    decided_positions: int | None = None  # positions judged strictly: all but the excused ties
    max_abs_logit_delta: float | None = None
    mean_kl: float | None = None
    quality: list[CheckResult] = field(default_factory=list)
    contamination: list[CheckResult] = field(default_factory=list)
    contamination_skipped: bool = False  # quality failed first, so the scenarios were not run
    seconds: float = 0.0

    @property
    def reasons(self) -> list[str]:
        return [f"{c.name}: {c.detail}" for c in self.quality + self.contamination if not c.passed]

    @property
    def verdict(self) -> str:
        return "pass" if not self.reasons else "fail"

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["verdict"], d["reasons"] = self.verdict, self.reasons
        return d

    def summary(self) -> str:
        lines = [f"verdict: {self.verdict.upper()}  (candidate {self.candidate_variant} vs reference "
                 f"{self.reference_variant}, {self.prompts} prompts x {self.max_tokens} tokens, {self.dtype}"
                 f"{'' if self.weight_dtype == 'auto' else ', ' + self.weight_dtype + ' weights'}"
                 f"{'' if self.kv_cache_dtype == 'auto' else ', ' + self.kv_cache_dtype + ' KV cache'}, "
                 f"{self.seconds:.1f} s)"]
        if self.greedy_agreement is not None:
            ties = (f" ({self.excused_ties} rounding ties excused, {self.decided_positions} positions decided)"
                    if self.excused_ties is not None else "")
            free = (f", free-running {self.free_running_agreement:.3f}"
                    if self.free_running_agreement is not None else "")
            lines.append(f"greedy agreement {self.greedy_agreement:.3f}{ties}{free}, max |dlogit| "
                         f"{self.max_abs_logit_delta:.3g}, mean KL {self.mean_kl:.3g}")
        for c in self.quality + self.contamination:
            lines.append(f"  [{'ok' if c.passed else 'FAIL'}] {c.name}: {c.detail}")
        if self.contamination_skipped:
            lines.append("  contamination scenarios not run: the candidate already failed quality")
        return "\n".join(lines)
