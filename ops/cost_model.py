"""A first cost model in the roofline style, and the grid of knob variants it ranks (design section 6).

Per step: time = max(bytes moved / measured bandwidth, FLOPs / measured FLOP/s) + kernel launches x
measured launch overhead. Composed over the traffic profile: decode batches of the concurrency
the profile implies (capped by max_num_seqs), prefill in chunks of the token budget.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import asdict, dataclass, field

from engine.variant import VariantSpec
from ops.hardware import HardwareProfile
from ops.model_spec import ModelSpec
from ops.traces import TrafficProfile

KERNELS_PER_LAYER = 12


def step_time(spec: ModelSpec, hw: HardwareProfile, new_tokens: int, kv_tokens: int) -> float:
    """Seconds for one forward pass computing ``new_tokens`` while reading ``kv_tokens`` of KV."""
    elem = 2 if spec.dtype in ("bfloat16", "float16") else 4
    params = spec.param_bytes / elem
    moved = spec.param_bytes + kv_tokens * spec.kv_bytes_per_token
    flops = 2 * params * new_tokens
    rate = hw.matmul_flops.get(spec.dtype) or next(iter(hw.matmul_flops.values()))
    return max(moved / hw.memory_bandwidth, flops / rate) + KERNELS_PER_LAYER * spec.layers * hw.launch_overhead_s


@dataclass(frozen=True)
class Prediction:
    output_tok_s: float
    ttft_s: float
    tpot_s: float


def predict(spec: ModelSpec, hw: HardwareProfile, traffic: TrafficProfile, v: VariantSpec) -> Prediction:
    batch = max(1, min(v.max_num_seqs, round(traffic.estimated_concurrency) or 1))
    ctx = traffic.input_p50 + traffic.output_p50 / 2
    reuse = traffic.prefix_reuse if v.enable_prefix_caching else 0.0
    prompt = max(1.0, traffic.input_p50 * (1 - reuse))
    chunk = min(v.max_num_batched_tokens, v.prefill_chunk_size or v.max_num_batched_tokens)
    # decode step with a share of prefill work riding along: requests arrive at the traffic's rate
    prefill_tokens_per_step = min(chunk, traffic.arrival_rate * prompt * 0.05)
    decode = step_time(spec, hw, batch + int(prefill_tokens_per_step), int(batch * ctx))
    # wasted KV in partially filled blocks lowers how much fits; larger blocks waste more
    waste = v.block_size / 2 / max(1.0, ctx)
    tpot = decode * (1 + waste)
    chunks = -(-int(prompt) // max(1, chunk))
    ttft = chunks * step_time(spec, hw, min(chunk, int(prompt)), int(ctx)) + tpot
    demand = traffic.arrival_rate * traffic.output_p50 if traffic.arrival_rate else float("inf")
    return Prediction(output_tok_s=min(batch / tpot, demand), ttft_s=ttft, tpot_s=tpot)


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

    def to_json(self) -> dict:
        return {"baseline": self.baseline.to_json(), "entries": [e.to_json() for e in self.entries]}


def knob_grid(traffic: TrafficProfile, base: VariantSpec) -> list[VariantSpec]:
    """Knob ranges worth trying for this traffic (the first variant source; agents replace it later)."""
    seqs = sorted({4, 8, 16, 32, base.max_num_seqs})
    budgets = sorted({128, 512, 2048, base.max_num_batched_tokens})
    blocks = [16, 32]
    caching = [True] if traffic.prefix_reuse > 0 else [True, False]
    return [dataclasses.replace(base, name=f"grid s{s} t{t} b{b}{'' if c else ' nocache'}", max_num_seqs=s,
                                max_num_batched_tokens=t, block_size=b, enable_prefix_caching=c)
            for s, t, b, c in itertools.product(seqs, budgets, blocks, caching)]


def plan(spec: ModelSpec, hw: HardwareProfile, traffic: TrafficProfile, base: VariantSpec) -> CostModelPlan:
    entries = []
    for v in knob_grid(traffic, base):
        p = predict(spec, hw, traffic, v)
        entries.append(PlanEntry(v, p, f"predicted {p.output_tok_s:.1f} tok/s, TTFT {1e3 * p.ttft_s:.0f} ms, "
                                       f"TPOT {1e3 * p.tpot_s:.1f} ms at concurrency "
                                       f"{traffic.estimated_concurrency:.1f}"))
    entries.sort(key=lambda e: (-round(e.prediction.output_tok_s, 6), e.prediction.ttft_s))
    return CostModelPlan(baseline=base, entries=entries)
