"""Agents that propose engine variants.

Each agent reads the search's state (the cost model's plan, the traffic profile and the results
on the board) and returns proposals, each with its rationale and the result ids it rests on.
Built-in agents need no network: cost-model seeding, local search around the best measured
variant, and traffic-aware rules. The LLM agent asks any OpenAI-compatible server for JSON and
treats every reply as untrusted: a reply that is not what was asked is recorded on the board as
``invalid_reply`` with the reason, and the search goes on.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engine.errors import ConfigError
from engine.config.presets import (
    LONG_CONTEXT, TRITON_ALL, TRITON_GEMV, TRITON_MOE_DECODE, context_splits, moe_decode_params, with_pdl,
)
from engine.config.variant import VariantSpec
from kernels.generated.launch import GENERATED_OPS
from ops.search import kernel_templates
from ops.search.board import Board, Result
from ops.predict.cost_model import Calibration, CostModelPlan, StepShape, step_time
from ops.measure.hardware import HardwareProfile
from ops.measure.model_spec import ModelSpec
from ops.traffic.traces import TrafficProfile


@dataclass(frozen=True)
class Proposal:
    variant: VariantSpec
    rationale: str
    refs: tuple[int, ...] = ()  # result ids the proposal rests on


def fast_score(bench: dict) -> tuple[float, float, float]:
    """How the fast tier ranks a variant: the capacity at the SLO (req/s), the SLO attainment at the traffic's
    own rate and the output tokens/s that its own measured step times imply (the calibrated cost model's
    simulation of the slice; see ops.worker.Workbench.evaluate)."""
    p = bench.get("predicted") or {}
    return (round(p.get("capacity", 0.0), 6), round(p.get("attainment", 0.0), 6),
            p.get("output_tok_s", bench.get("output_tok_s", 0.0)))


@dataclass
class SearchState:
    search_id: str
    model_spec: ModelSpec
    hardware: HardwareProfile
    traffic: TrafficProfile
    plan: CostModelPlan
    baseline: VariantSpec
    device: str = "cpu"
    max_input: int | None = None
    fast: list[tuple[Result, VariantSpec]] = field(default_factory=list)
    tried: set[str] = field(default_factory=set)  # variant ids already queued in this search
    calibration: Calibration | None = None  # the full model's, once measured
    slo_tpot_s: float | None = None
    max_output: int | None = None

    @classmethod
    def read(cls, board: Board, search_id: str, **kw) -> "SearchState":
        state = cls(search_id=search_id, **kw)
        state.fast = board.results(search_id, "fast")
        state.tried = {e["variant_id"] for e in board.experiments(search_id)}
        return state

    def best(self) -> tuple[Result, VariantSpec] | None:
        return max(self.fast, key=lambda rv: fast_score(rv[0].bench), default=None)

    def fresh(self, v: VariantSpec) -> bool:
        return v.variant_id not in self.tried


class Agent:
    name = "agent"

    def propose(self, state: SearchState, n: int) -> list[Proposal]:
        raise NotImplementedError


class CostModelSeeder(Agent):
    """The cost model's best-ranked knob variants not measured yet."""

    name = "cost-model"

    def propose(self, state: SearchState, n: int) -> list[Proposal]:
        out = []
        for e in state.plan.entries:
            if len(out) >= n:
                break
            if state.fresh(e.variant):
                out.append(Proposal(e.variant, f"cost model rank {state.plan.entries.index(e) + 1}: {e.rationale}"))
        return out


def _neighbours(v: VariantSpec) -> list[tuple[VariantSpec, str]]:
    out = []

    def add(change: str, **kw):
        try:
            out.append((dataclasses.replace(v, **kw), change))
        except ConfigError:
            pass

    for f in (2, 0.5):
        s = max(1, int(v.max_num_seqs * f))
        add(f"max_num_seqs {v.max_num_seqs} -> {s}", max_num_seqs=s)
        t = max(16, int(v.max_num_batched_tokens * f))
        add(f"max_num_batched_tokens {v.max_num_batched_tokens} -> {t}", max_num_batched_tokens=t)
    chunk = v.prefill_chunk_size
    for c in ([None] if chunk else []) + ([max(16, chunk // 2), chunk * 2] if chunk else
                                         [max(16, v.max_num_batched_tokens // 4)]):
        add(f"prefill_chunk_size {chunk} -> {c}", prefill_chunk_size=c)
    add(f"block_size {v.block_size} -> {32 if v.block_size == 16 else 16}", block_size=32 if v.block_size == 16 else 16)
    add(f"prefix caching {'off' if v.enable_prefix_caching else 'on'}", enable_prefix_caching=not v.enable_prefix_caching)
    return out


class LocalSearch(Agent):
    """One-knob steps around the best variant the fast tier has measured."""

    name = "local-search"

    def propose(self, state: SearchState, n: int) -> list[Proposal]:
        best = state.best()
        if best is None:
            return []
        result, v = best
        good, _, tps = fast_score(result.bench)
        out = []
        for nv, change in _neighbours(v):
            if len(out) >= n:
                break
            if state.fresh(nv):
                nv = dataclasses.replace(nv, name=f"local: {change}")
                out.append(Proposal(nv, f"neighbour of the best so far ({v.variant_id}, result {result.id}: "
                                        f"implied capacity {good:.2f} req/s, {tps:.1f} tok/s): {change}",
                                    (result.id,)))
        return out


class TrafficRules(Agent):
    """Rules of thumb keyed to the traffic: long prompts, prefix reuse, concurrency."""

    name = "traffic-rules"

    def propose(self, state: SearchState, n: int) -> list[Proposal]:
        t, base = state.traffic, state.baseline
        prompt_p90 = min(t.input_p90, state.max_input or t.input_p90)
        conc = max(1.0, t.estimated_concurrency)
        rules: list[tuple[VariantSpec, str]] = []
        if prompt_p90 >= base.max_num_batched_tokens / 8:
            for chunk in (64, 128, 256):
                if chunk < prompt_p90:
                    rules.append((dataclasses.replace(base, name=f"rule: chunked prefill {chunk}",
                                                      prefill_chunk_size=chunk,
                                                      max_num_batched_tokens=chunk + base.max_num_seqs),
                                  f"long prompts (p90 {prompt_p90:.0f} tokens as replayed): chunked prefill of "
                                  f"{chunk} tokens with room for every decode keeps decodes flowing (TPOT)"))
        if t.prefix_reuse > 0.2:
            rules.append((dataclasses.replace(base, name="rule: prefix caching, block 16", enable_prefix_caching=True,
                                              block_size=16),
                          f"prefix reuse {t.prefix_reuse:.0%}: caching on with small blocks shares the most"))
        seqs = 1
        while seqs < 2 * conc:
            seqs *= 2
        graphs = tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= seqs)
        on_gpu = state.device.startswith("cuda")
        rules.append((dataclasses.replace(base, name=f"rule: max_num_seqs {seqs}", max_num_seqs=seqs,
                                          cuda_graph_batch_sizes=graphs if on_gpu else ()),
                      f"estimated concurrency {conc:.1f}: max_num_seqs {seqs} (twice it, a power of two)"
                      + (f", CUDA graphs for batches {list(graphs)}" if on_gpu else "")))
        rules = self._tpot_rules(state) + rules
        return [Proposal(v, why) for v, why in rules if state.fresh(v)][:n]

    @staticmethod
    def _tpot_rules(state: SearchState) -> list[tuple[VariantSpec, str]]:
        """A TPOT target: the most sequences whose decode step takes at most half the TPOT SLO (room for
        the prefill chunks that share steps with them), and the token budget that keeps a step of those
        decodes plus prefill within the SLO, with prefill chunked to fit it. Step times from the cost
        model calibrated on the full model."""
        if state.calibration is None or not state.slo_tpot_s:
            return []
        t, base, slo, cal = state.traffic, state.baseline, state.slo_tpot_s, state.calibration
        prompt = min(t.input_p50, state.max_input or t.input_p50)
        ctx = int(prompt + min(t.output_p50, state.max_output or t.output_p50) / 2) + 1

        def step_s(seqs: int, prefill: int) -> float:
            shape = StepShape(seqs + prefill, seqs * ctx + prefill, seqs + (prefill > 0),
                              seqs * ctx + prefill * (prefill + 1) // 2)
            return step_time(state.model_spec, state.hardware, shape, cal)

        sizes = [b for b in (256, 128, 64, 32, 16, 8, 4, 2, 1) if b <= base.max_num_seqs]
        seqs = next((b for b in sizes if step_s(b, 0) <= slo / 2), None)
        if seqs is None:
            return []
        budget = next((b for b in (2048, 1024, 512, 256, 128, 64) if b > seqs and step_s(seqs, b - seqs) <= slo), None)
        why = (f"TPOT SLO {1e3 * slo:.0f} ms: a decode step of {seqs} sequences at {ctx} tokens of context is "
               f"modelled at {1e3 * step_s(seqs, 0):.0f} ms (of {max(sizes)}: {1e3 * step_s(max(sizes), 0):.0f} ms)")
        out = []
        if seqs < base.max_num_seqs:
            out.append((dataclasses.replace(base, name=f"rule: TPOT, max_num_seqs {seqs}", max_num_seqs=seqs), why))
        if budget is not None and (seqs < base.max_num_seqs or budget < base.max_num_batched_tokens):
            # the baseline's decodes fit, but a step of its whole token budget would not: chunk the prefill
            out.insert(0, (dataclasses.replace(base, name=f"rule: TPOT, {seqs} seqs, {budget} tokens chunked",
                                               max_num_seqs=seqs, max_num_batched_tokens=budget,
                                               prefill_chunk_size=budget - seqs),
                           why + f"; with prefill chunked so a step of {budget} tokens stays within the SLO "
                           f"({1e3 * step_s(seqs, budget - seqs):.0f} ms)"))
        return out


class KernelChoices(Agent):
    """Forward-pass variants on a GPU: the Triton kernels, CUDA graphs for the decode batch sizes the
    traffic reaches, attention tile sizes, and split-KV attention for long contexts. On a CPU the
    Triton kernels run in an interpreter, so it proposes nothing there."""

    name = "kernels"

    def propose(self, state: SearchState, n: int) -> list[Proposal]:
        if not state.device.startswith("cuda"):
            return []
        best = state.best()
        v = best[1] if best else state.baseline
        refs = (best[0].id,) if best else ()
        conc = max(1.0, state.traffic.estimated_concurrency)
        graphs = tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b <= max(v.max_num_seqs, 1) and b <= 4 * conc)
        ctx = min(state.traffic.input_p90, state.max_input or state.traffic.input_p90)
        # split-KV attention's splits: automatic (sized for short contexts) unless the contexts are long
        splits = context_splits(ctx) if ctx >= LONG_CONTEXT else 0
        cands = [
            (dataclasses.replace(v, name="kernels: triton", kernels=TRITON_ALL),
             "Triton kernels for every operation (fused rotary + KV store, paged attention)"),
            (dataclasses.replace(v, name="kernels: triton + graphs", kernels=TRITON_ALL,
                                 kernel_params={"attention": {"block_n": 128, "num_warps": 8}},
                                 cuda_graph_batch_sizes=graphs),
             f"Triton kernels and CUDA graphs for decode batches {list(graphs)} (concurrency {conc:.1f})"),
            (dataclasses.replace(v, name="kernels: triton + graphs, block_n 64", kernels=TRITON_ALL,
                                 kernel_params={"attention": {"block_n": 64, "num_warps": 4}},
                                 cuda_graph_batch_sizes=graphs),
             "smaller attention tiles for short contexts"),
            (dataclasses.replace(v, name="kernels: triton + graphs + fused GEMV", kernels={**TRITON_ALL, **TRITON_GEMV},
                                 kernel_params={"attention": {"block_n": 128, "num_warps": 8}},
                                 cuda_graph_batch_sizes=graphs),
             "decode projections as Triton matrix-vector kernels with the norm and activation fused in"),
        ]
        if conc <= 4:
            cands.append((dataclasses.replace(v, name="kernels: triton + graphs + fused GEMV + split-KV",
                                              kernels={**TRITON_ALL, **TRITON_GEMV},
                                              kernel_params={"attention": {"num_splits": splits, "block_n": 32}},
                                              cuda_graph_batch_sizes=graphs),
                          f"few sequences at once (concurrency {conc:.1f}): decode attention split so a batch "
                          "of one still spreads over the GPU"))
        cap = state.hardware.compute_capability
        if cap is not None and int(cap.split(".")[0]) >= 9:
            attn = {"num_splits": splits, "block_n": 32} if conc <= 4 else {"block_n": 128, "num_warps": 8}
            cands.append((dataclasses.replace(v, name="kernels: triton + graphs + fused GEMV + dependent launch",
                                              kernels={**TRITON_ALL, **TRITON_GEMV},
                                              kernel_params=with_pdl({"attention": attn}),
                                              cuda_graph_batch_sizes=graphs),
                          f"compute capability {cap}: each decode kernel scheduled while the one before it "
                          "finishes (programmatic dependent launch), the projections' first weights requested "
                          "before the wait"))
            if state.model_spec.experts and conc <= 4:
                # measured best for batch-1 MoE decode on an H200 (bench/RESULTS.md): the next kernel scheduled
                # before the wait, the experts' sum in the down kernel, a program's projection rows whole, and
                # the output projection and the next layer's QKV read into L2 while the attention runs
                cands.append((dataclasses.replace(
                    v, name="kernels: MoE decode, dependent launch + experts' sum in down + L2 prefetch",
                    kernels=TRITON_MOE_DECODE, kernel_params=moe_decode_params(attn, state.model_spec.hidden_size),
                    cuda_graph_batch_sizes=graphs),
                    f"mixture of experts at concurrency {conc:.1f}: fewer, overlapped launches per layer"))
            elif conc <= 4:
                # measured best for batch-1 dense decode on an H200 (bench/RESULTS.md): the attention block
                # (rotary, KV store, split-KV attention) in one launch, its first cache tile requested before the wait
                cands.append((dataclasses.replace(
                    v, name="kernels: triton + graphs + fused GEMV + dependent launch + rotary_attention",
                    kernels={**TRITON_ALL, **TRITON_GEMV, "rotary_attention": "triton"},
                    kernel_params=with_pdl({"attention": attn, "rotary_attention": attn}),
                    cuda_graph_batch_sizes=graphs),
                    f"few sequences at once (concurrency {conc:.1f}): one launch fewer per layer in the attention"))
        if ctx >= LONG_CONTEXT:
            cands.append((dataclasses.replace(v, name="kernels: split-KV attention + graphs",
                                              kernels={**TRITON_ALL, "attention": "triton_split_kv"},
                                              kernel_params={"attention": {"num_splits": splits}},
                                              cuda_graph_batch_sizes=graphs),
                          f"long contexts (p90 {ctx:.0f} tokens): split-KV decode attention, {splits} splits "
                          "per context"))
        return [Proposal(c, why, refs) for c, why in cands if state.fresh(c)][:n]


@dataclass
class KernelTemplates(Agent):
    """Generated kernels written from templates (ops/search/kernel_templates.py), with no LLM: one per operation
    over the best variant so far, then mutations of the best measured variant holding templated kernels
    (a tile doubled or halved, another loop order, the activation fused or not). They go through the same
    grammar, smoke run and gates as an LLM's kernels. On a CPU they run in Triton's interpreter, far
    slower than torch, so it proposes there only when ``on_cpu`` is set."""

    on_cpu: bool = False
    ops: tuple[str, ...] = GENERATED_OPS
    name: str = "kernel-templates"

    def propose(self, state: SearchState, n: int) -> list[Proposal]:
        if not state.device.startswith("cuda") and not self.on_cpu:
            return []
        cands: list[tuple[VariantSpec, str, tuple[int, ...]]] = []
        templated = [(r, v) for r, v in state.fast if kernel_templates.choices_in(v)]
        if templated:
            r, v = max(templated, key=lambda rv: fast_score(rv[0].bench))
            why = f"mutation of the best templated variant ({v.variant_id}, result {r.id})"
            for choice in kernel_templates.choices_in(v):
                for mutated, change in kernel_templates.mutations(choice):
                    cands.append((mutated.apply(v), f"{why}: {change}", (r.id,)))
            for toggled, change in kernel_templates.fusion_toggles(v):
                cands.append((toggled, f"{why}: {change}", (r.id,)))
        best = state.best()
        base, refs = (best[1], (best[0].id,)) if best else (state.baseline, ())
        for choice in kernel_templates.initial_choices():
            if choice.op in self.ops:
                cands.append((choice.apply(base), f"templated kernel {choice.describe()} over "
                                                  f"{'the best so far' if best else 'the baseline'}", refs))
        out, seen = [], set()
        for v, why, r in cands:
            if len(out) >= n:
                break
            if state.fresh(v) and v.variant_id not in seen:
                seen.add(v.variant_id)
                out.append(Proposal(dataclasses.replace(v, name=f"tpl: {why.rsplit(': ', 1)[-1][:60]}"), why, r))
        return out
