"""What a search measures and with which tiers: its config (stored on the board so any worker can evaluate its
experiments), the tier names, the baseline it is judged against, and results read back from the board."""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

from engine import resolve
from engine.config.variant import VariantSpec
from ops.measure.tiers import SLO, BenchResult

FAST, SLOW = "fast", "slow"


@dataclass(frozen=True)
class SearchConfig:
    """What a search measures; stored on the board so any worker can evaluate its experiments."""

    model: str = "smollm2"
    trace: str = ""
    device: str = "cpu"
    dtype: str = "float32"
    requests: int = 16
    max_input: int = 128
    max_output: int = 16
    time_scale: float = 0.02
    fast_layers: int = 4
    slow_layers: int | None = None  # None: the whole model
    fast_repeats: int = 3
    slow_repeats: int = 3
    # rates a quick capacity search of each slow-tier variant may replay the slice at (0: none; the decision's
    # capacities are the judge's own, ops/judge/paired.py)
    capacity_probes: int = 0
    num_kv_blocks: int = 512
    slo_ttft_s: float | None = None  # None: derived from static-best's unloaded latency (Search.start)
    slo_tpot_s: float | None = None
    slo_ttft_per_token_s: float = 0.0  # the TTFT target's growth per prompt token (derived SLOs)
    slo_source: str = "given"  # or how it was derived
    lenient: bool = False
    # devices a parallel layout may span (GPUs; on a CPU, process groups sharing its cores). Above 1 the search
    # also measures the layouts the cost model ranks ({tp, dp} with tp x dp = devices), and its slow tier
    # measures every variant as served in its layout (ops/measure/tiers.served_tier), static-best included
    layout_devices: int = 1

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "SearchConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})  # a board written by an older version still opens

    @property
    def sim(self) -> dict:
        """Keyword arguments that make the cost model's simulation replay what the slow tier replays."""
        return {"time_scale": self.time_scale, "max_input": self.max_input, "max_output": self.max_output,
                "num_kv_blocks": self.num_kv_blocks, "slo_ttft_s": self.slo_ttft_s, "slo_tpot_s": self.slo_tpot_s,
                "slo_ttft_per_token_s": self.slo_ttft_per_token_s}

    @property
    def slo(self) -> SLO:
        return SLO(self.slo_ttft_s, self.slo_tpot_s, self.slo_ttft_per_token_s)


def static_best_of(cfg: SearchConfig) -> VariantSpec:
    """The model's static-best form on this device (the baseline every tuned figure is a ratio against), or
    the engine's plain default when none is recorded."""
    from engine.config import static_best
    found = static_best.lookup(resolve(cfg.model), cfg.device, cfg.dtype)
    return found or VariantSpec(name="static-best (none recorded: the default)")


def bench_from(d: dict) -> BenchResult:
    """A BenchResult from a board result's JSON (extra keys such as the fast tier's prediction dropped)."""
    fields = BenchResult.__dataclass_fields__
    return BenchResult(**{k: v for k, v in d.items() if k in fields})
