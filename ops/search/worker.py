"""Benchmark workers: drain a search's experiments from the board, one device each.

A worker keeps one engine per tier and hot-swaps each experiment's variant into it (weights
load once); ``fresh=True`` builds a new engine per experiment instead, for comparison. While an
experiment runs, a heartbeat thread renews its lease; if the worker dies the lease runs out and
another worker takes the experiment over.
"""
from __future__ import annotations

import dataclasses

import statistics
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from functools import cached_property

from engine import EngineConfig, resolve
from engine.core.llm_engine import LLMEngine, LoadedModel
from engine.loader.model_source import load_config
from engine.loader.tokenizer import Tokenizer
from engine.serving.trace_record import TraceRecord
from engine.config.variant import VariantSpec
from ops.search.config import FAST, SLOW, SearchConfig, static_best_of
from ops.measure.tiers import fast_shapes, fast_tier, own_rate, served_tier, slow_tier
from ops.search.board import Board, Experiment, worker_name
from ops.predict.cost_model import Calibration, calibrate, predicted_capacity, scaled, shapes_from_fast, simulate
from ops.measure.hardware import HardwareProfile
from ops.measure.model_spec import model_spec
from ops.traffic.corpus import corpus_for
from ops.traffic.replay import synthesize_prompts
from ops.traffic.traces import TrafficProfile, load_trace, profile

@dataclass
class Workbench:
    """The engines, trace slice and prompts a worker measures with, built once."""

    cfg: SearchConfig
    hardware: HardwareProfile
    fresh: bool = False
    records: list[TraceRecord] = field(default_factory=list)
    traffic: TrafficProfile | None = None
    _loaded: dict = field(default_factory=dict)
    _engines: dict = field(default_factory=dict)
    _prompts: list | None = None
    # the full model's calibration and the baseline's fast-tier step times (set once measured)
    reference: tuple | None = None

    def __post_init__(self) -> None:
        # the whole trace: the slow tier replays its first ``requests``; the judge's windows follow (ops/judge/paired.py)
        self.stream = load_trace(self.cfg.trace, lenient=self.cfg.lenient)
        self.records = self.stream[: self.cfg.requests]
        if not self.records:
            raise ValueError(f"trace {self.cfg.trace} has no requests")
        self.traffic = profile(self.records)

    def layers(self, tier: str) -> int | None:
        return self.cfg.fast_layers if tier == FAST else self.cfg.slow_layers

    def with_slo(self, baseline: VariantSpec | None = None) -> SearchConfig:
        """The config with an SLO: as given, or derived (``derive_slo``) from the unloaded latency on the slice of
        ``baseline`` (default: static-best), which then holds for every experiment this workbench measures."""
        c = self.cfg
        if c.slo_ttft_s is None or c.slo_tpot_s is None:
            from ops.measure.static_best_sweep import RULE, derive_slo, unloaded_points

            eng = self.engine(SLOW, baseline or static_best_of(c))
            slo = derive_slo(unloaded_points(eng, self.prompts(eng.model_config.vocab_size), c.max_output))
            given = c.slo_ttft_s is not None
            self.cfg = dataclasses.replace(c, slo_ttft_s=c.slo_ttft_s or slo.ttft_s, slo_tpot_s=c.slo_tpot_s or slo.tpot_s,
                                           slo_ttft_per_token_s=0.0 if given else slo.ttft_per_token_s,
                                           slo_source=f"derived: {RULE} of static-best on this slice")
        return self.cfg

    def engine_config(self, tier: str, variant: VariantSpec | None = None) -> EngineConfig:
        return EngineConfig(source=resolve(self.cfg.model), device=self.cfg.device, dtype=self.cfg.dtype,
                            layers=self.layers(tier), num_kv_blocks=self.cfg.num_kv_blocks, variant=variant,
                            load_tokenizer=False)

    def engine(self, tier: str, variant: VariantSpec) -> LLMEngine:
        """The tier's engine with ``variant`` active: hot-swapped into a persistent engine, or built fresh."""
        if self.fresh:
            return LLMEngine(self.engine_config(tier, variant))  # loads the weights again
        if tier not in self._engines:
            loaded = LoadedModel.load(self.engine_config(tier))
            self._engines[tier] = LLMEngine(self.engine_config(tier, variant), loaded)
        eng = self._engines[tier]
        if eng.variant.variant_id != variant.variant_id:
            eng.apply_variant(variant)
        return eng

    @cached_property
    def real_text(self) -> bool:
        """Whether the replay's prompts are real text (a model with a tokenizer, not synthetic weights)."""
        source = resolve(self.cfg.model)
        return bool(source.tokenizer_path) and source.kind != "synthetic"

    def prompts(self, vocab: int) -> list[list[int]]:
        """The slice's prompts at their recorded lengths: real text from the corpus that fits the trace (code or
        prose, ops/traffic/corpus.py) when the model has a tokenizer, random ids for synthetic weights."""
        if self._prompts is None:
            source = resolve(self.cfg.model)
            tok = Tokenizer(source.tokenizer_path) if self.real_text else None
            self._prompts = synthesize_prompts(self.records, vocab, max_input=self.cfg.max_input, tokenizer=tok,
                                               corpus=corpus_for(self.cfg.trace) if tok else None)
        return self._prompts

    def prompts_for(self, records: list[TraceRecord], seed: int) -> list[list[int]]:
        """Token ids for another window of the trace, as ``prompts`` makes them for the slice (real text where
        the model has a tokenizer); ``seed`` keeps windows apart."""
        source = resolve(self.cfg.model)
        vocab = load_config(source).vocab_size
        tok = self._loaded.get("tokenizer")
        if tok is None and self.real_text:
            tok = self._loaded["tokenizer"] = Tokenizer(source.tokenizer_path)
        return synthesize_prompts(records, vocab, max_input=self.cfg.max_input, tokenizer=tok, seed=seed,
                                  corpus=corpus_for(self.cfg.trace) if tok else None)

    def spec_for(self, tier: str):
        key = ("spec", tier)
        if key not in self._loaded:
            self._loaded[key] = model_spec(resolve(self.cfg.model), self.cfg.dtype, self.layers(tier))
        return self._loaded[key]

    def evaluate(self, variant: VariantSpec, tier: str) -> dict:
        """Measures the variant on the tier. The fast tier adds the trace-level figures its measured step
        times imply: the cost model calibrated on the full model, scaled by how this variant's step times
        compare with the baseline's on the same shapes (before the full-model calibration exists: the
        cost model calibrated on this variant's own few-layer shapes)."""
        c = self.with_slo()
        if tier == SLOW and c.layout_devices > 1:
            vocab = load_config(resolve(c.model)).vocab_size
            return served_tier(self.engine_config(SLOW, variant), self.records, self.prompts(vocab),
                               f"{c.trace}[:{len(self.records)}]", repeats=c.slow_repeats, time_scale=c.time_scale,
                               max_output=c.max_output, slo=c.slo,
                               capacity_guess=self.capacity_guess(variant) if c.capacity_probes > 0 else None,
                               capacity_probes=c.capacity_probes).to_json()
        eng = self.engine(tier, variant)
        if tier == FAST:
            prefill, decode = fast_shapes(self.traffic, variant, c.max_input)
            res = fast_tier(eng, prefill, decode, repeats=c.fast_repeats)
            out = res.to_json()
            if self.reference is not None:
                cal, base_steps = self.reference
                common = [k for k in res.step_times_ms if k in base_steps and base_steps[k] > 0]
                ratio = statistics.median(res.step_times_ms[k] / base_steps[k] for k in common) if common else 1.0
                cal = scaled(cal, ratio)
                out["step_time_ratio"] = ratio
            else:
                cal = calibrate(self.spec_for(FAST), self.hardware, shapes_from_fast(res.step_times_ms))
            pred = dataclasses.replace(
                simulate(self.spec_for(SLOW), self.hardware, self.records, variant, cal, **c.sim),
                capacity=predicted_capacity(self.spec_for(SLOW), self.hardware, self.records, variant, cal, **c.sim))
            out["calibration"] = cal.to_json()
            out["predicted"] = asdict(pred)
            return out
        res = slow_tier(eng, self.records, self.prompts(eng.model_config.vocab_size),
                        f"{c.trace}[:{len(self.records)}]", repeats=c.slow_repeats, time_scale=c.time_scale,
                        max_output=c.max_output, slo=c.slo,
                        capacity_guess=self.capacity_guess(variant) if c.capacity_probes > 0 else None,
                        capacity_probes=c.capacity_probes, saturation_of=True)
        # calibrated on its own steps, from a few sequences (the slice's own rate) to full batches (at once)
        res.capacity_predicted = self.simulated_capacity(variant, res.step_samples + res.saturation_samples)
        return res.to_json()

    def sim_records(self, n: int = 1000) -> list[TraceRecord]:
        """The requests the simulator replays: ``n`` of the trace's search part from the slice's start (the
        held-out part stays unseen: ops/traces.Windows)."""
        from ops.traffic.traces import Windows

        lo, hi = Windows(self.stream).bounds("search")
        return self.stream[lo:min(hi, lo + n)] or self.records

    def simulated_capacity(self, variant: VariantSpec, samples: list, n: int = 1000) -> float:
        """The simulator's capacity of ``variant`` over ``n`` requests of the search part, calibrated on its own
        measured steps (``samples``: [new tokens, KV tokens, sequences, attended pairs, seconds] per step)."""
        cal = calibration_from(self.spec_for(SLOW), self.hardware, samples, variant)
        if cal is None:
            return 0.0
        return predicted_capacity(self.spec_for(SLOW), self.hardware, self.sim_records(n), variant, cal, **self.cfg.sim)

    def capacity_guess(self, variant: VariantSpec) -> float:
        """Where the slow tier's capacity search starts: the calibrated cost model's prediction once the full
        model's calibration exists, else the slice's own rate."""
        if self.reference is None:
            return own_rate(self.records)
        return predicted_capacity(self.spec_for(SLOW), self.hardware, self.records, variant, self.reference[0],
                                  **self.cfg.sim) or own_rate(self.records)


class _Heartbeat(threading.Thread):
    def __init__(self, board_path: str, exp: Experiment, lease_s: float):
        super().__init__(daemon=True)
        self.board_path, self.exp, self.interval = board_path, exp, max(0.2, lease_s / 3)
        self.stop = threading.Event()
        self.lost = False

    def run(self) -> None:
        board = Board(self.board_path)
        try:
            while not self.stop.wait(self.interval):
                if not board.renew(self.exp):
                    self.lost = True
                    return
        finally:
            board.close()


@dataclass
class WorkerStats:
    evaluated: int = 0
    failed: int = 0
    lost: int = 0
    seconds: float = 0.0
    result_ids: list[int] = field(default_factory=list)


def work(board: Board, search: str, bench: Workbench, tier: str | None = None, max_experiments: int | None = None,
         name: str | None = None, deadline: float | None = None, log=None) -> WorkerStats:
    """Claims and evaluates experiments until the queue (for ``tier``) is empty, the count or the deadline;
    ``log`` (a callable taking a line) hears about each experiment as it ends."""
    name = name or worker_name()
    stats = WorkerStats()
    t0 = time.perf_counter()
    while max_experiments is None or stats.evaluated + stats.failed < max_experiments:
        if deadline is not None and time.time() >= deadline:
            break
        exp = board.claim(name, search, tier)
        if exp is None:
            break
        if bench.reference is None:
            bench.reference = reference_from(board, search)
        beat = _Heartbeat(board.path, exp, board.lease_s)
        beat.start()
        te = time.perf_counter()
        try:
            result = bench.evaluate(exp.variant, exp.tier)
        except Exception as e:  # a variant that fails is a result too: recorded, never fatal
            beat.stop.set()
            beat.join()
            board.fail(exp, name, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}")
            stats.failed += 1
            if log:
                log(f"{exp.tier} tier: {exp.variant.name} failed after {time.perf_counter() - te:.0f} s "
                    f"({type(e).__name__}: {str(e)[:120]}); {board.pending(search, tier)} queued")
            continue
        beat.stop.set()
        beat.join()
        rid = board.complete(exp, name, result)
        if rid is None:
            stats.lost += 1  # the lease ran out and another worker took it over: not counted twice
        else:
            stats.evaluated += 1
            stats.result_ids.append(rid)
        if log:
            log(f"{exp.tier} tier: {exp.variant.name} measured in {time.perf_counter() - te:.0f} s: "
                f"{_summary(result)}; {board.pending(search, tier)} queued")
    stats.seconds = time.perf_counter() - t0
    return stats


def _summary(r: dict) -> str:
    """One experiment's figures in a progress line."""
    if r.get("tier") == SLOW:
        if r.get("rate_probes"):  # a capacity searched on the slice itself (capacity_probes > 0)
            head = f"capacity {r.get('capacity', 0.0):.3f} req/s (bracket {r.get('capacity_spread', 0.0):.3f})"
        else:  # the judge measures capacity; the slow tier gives the simulator its calibration
            head = f"simulated capacity {r.get('capacity_predicted', 0.0):.3f} req/s"
        return (f"{head}, {r.get('output_tok_s', 0.0):.1f} tok/s, attainment {r.get('attainment', 0.0):.2f} "
                "at the slice's rate")
    return f"{r.get('output_tok_s', 0.0):.1f} decode tok/s"


def step_shapes(samples: list) -> list:
    """A replay's step samples ([new tokens, KV tokens, sequences, attended pairs, seconds]) as (StepShape, seconds),
    those of no measured time left out."""
    from ops.predict.cost_model import StepShape

    return [(StepShape(int(a), int(b), int(c), int(d)), t) for a, b, c, d, t in samples if t > 0]


def calibration_from(model, hw, samples: list, variant=None) -> Calibration | None:
    """The cost model fitted to a replay's own steps (sums over four steps: an engine that runs a step ahead
    spends one step's time in the call before), or None with too few of them. ``variant``: the one that ran them
    (its graphed and eager steps apart, ``cost_model.features``)."""
    shapes = step_shapes(samples)
    if len(shapes) < 8:
        return None
    return calibrate(model, hw, shapes, window=4, v=variant)


def reference_from(board: Board, search: str) -> tuple | None:
    """The search's full-model calibration and baseline fast-tier step times, once posted on the board."""
    for m in reversed(board.messages("note")):
        b = m["body"]
        if b.get("search") == search and "calibration" in b and "baseline_fast_steps" in b:
            return Calibration(**b["calibration"]), b["baseline_fast_steps"]
    return None
