"""A search: agents propose, workers measure on the fast tier, the best go to the slow tier, and the decision records
why. ``polyinf tune`` and the pipeline's ``variant_candidates`` / bench assets run this code.

Budget: at most ``experiments`` measurements (fast and slow together) and ``seconds`` of wall time;
the slow tier's share (the baseline and the ``slow_top`` best of the fast tier) is kept back.
"""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from engine.config.presets import graphs_alone, prefill_graphed, quantized_variant
from engine.config.variant import VariantSpec
from ops.search.agents import (Agent, CostModelSeeder, KernelChoices, KernelTemplates, LocalSearch, SearchState, TrafficRules,
                        fast_score)
from ops.search.board import Board, Result
from ops.measure.tiers import BenchResult, fast_tier
from ops.predict.cost_model import (ROOFLINE, Calibration, CostModelPlan, calibrate, mape, plan, predict, predicted_capacity,
                             shapes_from_fast, simulate, spearman)
from ops.measure.hardware import HardwareProfile, probe
from ops.search.optimize import Choice
from ops.search.tune_report import TuneReport
from ops.search.config import FAST, SLOW, SearchConfig, bench_from, static_best_of
from ops.search.worker import Workbench, reference_from, work

if TYPE_CHECKING:
    from ops.judge.rule import Judgement
    from ops.judge.paired import JudgeConfig


@dataclass(frozen=True)
class Budget:
    experiments: int = 12
    seconds: float = 900.0


def default_agents(llm: Agent | None = None) -> list[Agent]:
    """The agents every search runs (the CLI's and the pipeline's alike), with ``llm`` among them when given."""
    agents = [KernelChoices(), TrafficRules(), CostModelSeeder(), LocalSearch(), KernelTemplates()]
    if llm is not None:
        agents.insert(2, llm)
    return agents


def _quiet(msg: str) -> None:
    """The default progress log: nothing."""


def new_search_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]


@dataclass
class Search:
    """One search's state on the board, in stages the CLI and the pipeline's assets share."""

    cfg: SearchConfig
    board: Board
    id: str  # the search's id on the board
    hardware: HardwareProfile
    bench: Workbench
    baseline: VariantSpec
    _plan: CostModelPlan | None = None  # computed when first needed (agents seed from it)
    cal: Calibration | None = None  # the full model's calibration, once measured
    log: Callable[[str], None] = _quiet  # progress lines: each experiment as it ends

    @classmethod
    def start(cls, cfg: SearchConfig, board_path: str | Path, search: str | None = None,
              hardware: HardwareProfile | None = None, baseline: VariantSpec | None = None,
              cost_plan: CostModelPlan | None = None, log: Callable[[str], None] = _quiet) -> "Search":
        """Opens the board, records the search (idempotent for the same id) and the cost model's plan. The
        baseline is static-best (engine/config/static_best.py) unless given; an SLO not given is derived from its
        unloaded latency on the slice (``derive_slo``) and recorded with the search."""
        board = Board(board_path)
        search = search or new_search_id()
        try:
            cfg = SearchConfig.from_json(board.search_config(search))  # another step started it: same SLO
        except KeyError:
            pass
        hw = hardware or probe(cfg.device, size_mb=64 if cfg.device == "cpu" else 256)
        base = baseline or static_best_of(cfg)
        bench = Workbench(cfg, hw)
        cfg = bench.with_slo(base)
        board.create_search(search, cfg.to_json())
        self = cls(cfg, board, search, hw, bench, base, cost_plan, log=log)
        # the first start of a search records the plan; later starts (other asset steps) need not compute it
        if not any(m["body"].get("search") == search for m in board.messages("note") if "plan_top" in m["body"]):
            p = self.plan
            board.post("cost-model", "note", {"search": search, "plan_top": [
                e.to_json() | {"variant": e.variant.name} for e in p.entries[:5]],
                "ranges": p.ranges, "layouts": p.layouts})
        board.enqueue(search, base, FAST, "baseline", "the engine's default configuration")
        return self

    @property
    def model_spec(self):
        return self.bench.spec_for(SLOW)

    @property
    def plan(self) -> CostModelPlan:
        if self._plan is None:
            self._plan = self._ranked(self.cal or ROOFLINE)
        return self._plan

    def _ranked(self, cal: Calibration) -> CostModelPlan:
        devices = self.cfg.layout_devices if self.cfg.layout_devices > 1 else None  # None: the hardware's
        return plan(self.model_spec, self.hardware, self.bench.traffic, self.baseline, cal, records=self.bench.records,
                    devices=devices, **self.cfg.sim)

    def benches(self, tier: str, variants: list[VariantSpec]) -> list[tuple[VariantSpec, BenchResult]]:
        """The tier's measurements of ``variants``, in their order (those not measured left out)."""
        by_id = {v.variant_id: r for r, v in self.results(tier)}
        return [(v, bench_from(by_id[v.variant_id].bench)) for v in variants if v.variant_id in by_id]

    def state(self) -> SearchState:
        st = SearchState.read(self.board, self.id, model_spec=self.model_spec, hardware=self.hardware,
                              traffic=self.bench.traffic, plan=self.plan, baseline=self.baseline,
                              device=self.cfg.device, max_input=self.cfg.max_input, calibration=self.cal,
                              slo_tpot_s=self.cfg.slo_tpot_s, max_output=self.cfg.max_output)
        st.fast = self.fast_results(st.fast)
        return st

    def fast_results(self, fast: list[tuple[Result, VariantSpec]] | None = None) -> list[tuple[Result, VariantSpec]]:
        """The fast tier's results; those measured before the full-model calibration existed (the
        baseline) get their trace-level figures from it too (their step-time ratio to the baseline is 1)."""
        fast = self.results(FAST) if fast is None else fast
        if self.cal is not None:
            for r, v in fast:
                if "step_time_ratio" not in r.bench:
                    r.bench["predicted"] = asdict(predict(self.model_spec, self.hardware, self.bench.traffic, v,
                                                          self.cal, self.bench.records, **self.cfg.sim))
                    r.bench["step_time_ratio"] = 1.0
        return fast

    def n_experiments(self, tier: str | None = None) -> int:
        return sum(1 for e in self.board.experiments(self.id) if tier is None or e["tier"] == tier)

    def propose(self, agent: Agent, n: int) -> int:
        """Queues the agent's proposals on the fast tier; returns how many were new."""
        queued = 0
        try:
            proposals = agent.propose(self.state(), n)
        except Exception as e:  # an agent that breaks loses its turn, not the search
            self.board.post(agent.name, "note", {"search": self.id,
                                                 "error": f"proposing failed: {type(e).__name__}: {str(e)[:500]}"})
            return 0
        for prop in proposals:
            _, fresh = self.board.enqueue(self.id, prop.variant, FAST, agent.name, prop.rationale,
                                          list(prop.refs))
            queued += fresh
        return queued

    def measure(self, tier: str, deadline: float | None = None):
        return work(self.board, self.id, self.bench, tier, deadline=deadline, log=self.log)

    def results(self, tier: str) -> list[tuple[Result, VariantSpec]]:
        return self.board.results(self.id, tier)

    def queue_slow(self, top: int, speculation: bool = False, precision: bool = False) -> list[VariantSpec]:
        """The baseline and the ``top`` best of the fast tier, queued for the slow tier; with ``speculation``, also
        the baseline with prompt-lookup speculation where the slice's prompts are real text (only the slow tier can
        judge it: the fast tier's shapes carry no text); with ``precision``, the baseline with quantized weights
        (``precision_candidate``: its quality judged on the full model) and with its prefill graphs alone; on more
        than one device (``layout_devices``), the baseline in each layout the cost model finds fitting."""
        fast = self.fast_results()
        base_fast = next((r for r, v in fast if v.variant_id == self.baseline.variant_id), None)
        self.board.enqueue(self.id, self.baseline, SLOW, "tuner", "baseline for the slow tier",
                           [base_fast.id] if base_fast else [])
        ranked = sorted((rv for rv in fast if rv[1].variant_id != self.baseline.variant_id),
                        key=lambda rv: fast_score(rv[0].bench), reverse=True)
        out = [self.baseline]
        for r, v in ranked[:max(0, top)]:
            cap, tps = fast_score(r.bench)[::2]
            self.board.enqueue(self.id, v, SLOW, "tuner",
                               f"fast tier rank {len(out)}: implied capacity {cap:.2f} req/s at the SLO, "
                               f"{tps:.1f} tok/s", [r.id])
            out.append(v)
        extra = []  # static-best along the dimensions only the slow tier can judge
        draft = self.speculation_candidate() if speculation else None
        if draft is not None:
            extra.append((draft, f"prompt-lookup speculation ({draft.speculative_tokens} tokens) on static-best: its "
                                "acceptance depends on the text, which only the slow tier's replay carries"))
        quant = self.precision_candidate() if precision else None
        if quant is not None:
            extra.append((quant, f"{quant.weight_dtype} weights on static-best: a decode step reads a quarter to half "
                                 "the bytes; the quality gate decides whether it may be chosen"))
            if (graphs := graphs_alone(self.baseline, quant)) is not None:
                extra.append((graphs, "its prefill graphs alone on static-best: what its precision adds to them"))
        extra += self.layout_candidates()
        for v, why in extra:
            if all(o.variant_id != v.variant_id for o in out):
                self.board.enqueue(self.id, v, SLOW, "tuner", why)
                out.append(v)
        return out

    def layout_candidates(self) -> list[tuple[VariantSpec, str]]:
        """Static-best in every parallel layout other than one device that the cost model finds fitting on
        ``layout_devices`` devices, best predicted first, each with the cost model's rationale. Static-best itself
        runs on one device: the layout a traffic-agnostic choice keeps."""
        if self.cfg.layout_devices <= 1:
            return []
        return [(replace(self.baseline, name=f"static-best, tp {d['tp']} x dp {d['dp']}", tp=d["tp"], dp=d["dp"]),
                 f"parallel layout tp {d['tp']} x dp {d['dp']} on {self.cfg.layout_devices} devices: {d['rationale']}; "
                 "a layout change restarts the engine (timed)")
                for d in self.plan.layouts if d["fits"] and (d["tp"], d["dp"]) != (1, 1)]

    def precision_candidate(self) -> VariantSpec | None:
        """The baseline with quantized dense weights, FP8 where the device has FP8 tensor cores, else int8 (presets'
        ``quantized_variant``; on a GPU with ``prefill_graphed``, as its kernels are shorter than the host's launches);
        None where static-best already has a precision of its own."""
        if self.baseline.weight_dtype != "auto":
            return None
        import torch
        from kernels.linear.quant import fp8_gemm_supported

        kind = "fp8" if fp8_gemm_supported(torch.device(self.cfg.device)) else "int8"
        spec = quantized_variant(self.baseline, kind, self.cfg.device, name=f"static-best + {kind} weights")
        gpu = self.cfg.device.startswith("cuda")
        return replace(prefill_graphed(spec), name=f"{spec.name}, prefill graphs") if gpu else spec

    def gate(self, variant: VariantSpec) -> dict:
        """The quality and contamination gates (checks/gates.py) for ``variant`` against static-best on the slow
        tier's engine: the one place a search gates a choice. On synthetic weights (near-tied logits) the report's
        figures are the numerical error only, not judged. The verdict goes on the board."""
        from checks.gates import gate_variant

        report = gate_variant(self.bench.engine(SLOW, self.baseline), variant).to_json()
        if not self.bench.real_text:  # random weights' logits are near ties: their error is reported, not judged
            report["verdict"] = "not judged"
            report["reasons"] = ["synthetic weights: the gates' figures are the numerical error only"] + \
                report["reasons"]
        self.board.post("gates", "note", {"search": self.id, "variant_id": variant.variant_id,
                                          "verdict": report["verdict"], "reasons": report["reasons"]})
        self.log(f"gates for {variant.name}: {report['verdict']}")
        return report

    def speculation_candidate(self) -> VariantSpec | None:
        """The baseline with prompt-lookup speculation, where the replay's prompts are real text (a real model's
        tokenizer); None for synthetic weights, whose acceptance says nothing about the traffic."""
        if self.baseline.speculative_tokens or not self.bench.real_text:
            return None
        return replace(self.baseline, name="static-best + prompt lookup 4", speculative_tokens=4)

    def speculation_followup(self) -> VariantSpec | None:
        """One step of the speculation policy's search, from the slow tier's measurement of the speculation
        candidate: where it accepted at least half its drafts and did not lose capacity, twice the draft
        tokens; where it accepted fewer, drafts only from matches of two tokens or more (fewer, surer drafts).
        Queued on the slow tier; None when there is nothing measured to follow."""
        first = self.speculation_candidate()
        if first is None:
            return None
        got = {v.variant_id: r.bench for r, v in self.results(SLOW)}
        drafted, base = got.get(first.variant_id), got.get(self.baseline.variant_id)
        if drafted is None or base is None or not drafted.get("spec_accepted_length"):
            return None
        acc = drafted["spec_acceptance"]
        if acc >= 0.5 and drafted.get("capacity", 0.0) >= base.get("capacity", 0.0):
            nxt = replace(first, name="static-best + prompt lookup 8", speculative_tokens=8)
            why = f"the 4-token drafts were accepted at {acc:.0%} without losing capacity: longer drafts"
        else:
            nxt = replace(first, name="static-best + prompt lookup 4, 2-grams", prompt_lookup_min=2)
            why = f"the 4-token drafts were accepted at {acc:.0%}: drafts only from matches of two tokens or more"
        if nxt.variant_id in got:
            return None
        self.board.enqueue(self.id, nxt, SLOW, "tuner", why)
        return nxt

    def calibration(self) -> Calibration:
        """Correction factors fitted to forward passes of the full model (the slow tier's engine, baseline
        variant) over a spread of shapes: prefills of several lengths, decodes of several batch sizes."""
        c = self.cfg
        top = max(16, min(c.max_input, 512))
        prefill = sorted({16, max(16, top // 4), max(16, top // 2), top})
        batches = sorted({b for b in (1, 2, 4, 8, 16, 32, 64) if b <= max(2, min(c.requests, 64))})
        ctx = max(8, min(c.max_input, int(self.bench.traffic.input_p50))) + 8
        res = fast_tier(self.bench.engine(SLOW, self.baseline), prefill, [(b, ctx) for b in batches],
                        repeats=3)
        cal = calibrate(self.model_spec, self.hardware, shapes_from_fast(res.step_times_ms))
        base_fast = next((r for r, v in self.results(FAST) if v.variant_id == self.baseline.variant_id), None)
        body = {"search": self.id, "calibration": cal.to_json(), "step_times_ms": res.step_times_ms}
        if base_fast is not None:
            body["baseline_fast_steps"] = base_fast.bench["step_times_ms"]
            self.bench.reference = (cal, base_fast.bench["step_times_ms"])
        self.board.post("cost-model", "note", body)
        self.cal = cal
        # rank the knobs again with the calibrated model: the agents seed from this plan
        self._plan = self._ranked(cal)
        self.board.post("cost-model", "note", {"search": self.id, "calibrated_plan_top": [
            e.to_json() | {"variant": e.variant.name} for e in self.plan.entries[:5]], "ranges": self.plan.ranges})
        return cal

    def measure_fast(self, deadline: float | None = None):
        """Drains the fast tier's queue; the baseline first, then the full-model calibration the other
        variants' figures scale from (measured once per search, found on the board afterwards)."""
        if self.cal is None:
            ref = reference_from(self.board, self.id)
            if ref is not None:
                self.cal, self.bench.reference = ref[0], ref
        first = None
        if self.cal is None:
            first = work(self.board, self.id, self.bench, FAST, max_experiments=1, deadline=deadline, log=self.log)
            self.calibration()
        stats = self.measure(FAST, deadline)
        if first is not None:
            stats.evaluated += first.evaluated
            stats.failed += first.failed
            stats.result_ids = first.result_ids + stats.result_ids
            stats.seconds += first.seconds
        return stats

    def known_calibration(self) -> Calibration | None:
        """The full model's calibration if this search has measured it (in this process or another step)."""
        if self.cal is None:
            ref = reference_from(self.board, self.id)
            self.cal = ref[0] if ref else None
        return self.cal

    def cost_model_error(self, cal: Calibration) -> dict:
        """MAPE and Spearman of the cost model (with ``cal``, and the plain roofline) and of the fast tier's
        ranking, against the slow tier's measured output tokens/s. Computes; measures nothing."""
        slow, fast = self.results(SLOW), self.results(FAST)
        model, hw, recs, sim = self.model_spec, self.hardware, self.bench.records, self.cfg.sim
        fast = self.fast_results(fast)
        fast_by_id = {v.variant_id: r for r, v in fast}
        measured = [r.bench["output_tok_s"] for r, _ in slow]
        pred_cal = [simulate(model, hw, recs, v, cal, **sim).output_tok_s for _, v in slow]
        pred_roof = [simulate(model, hw, recs, v, ROOFLINE, **sim).output_tok_s for _, v in slow]
        fast_pred = [fast_score(fast_by_id[v.variant_id].bench)[2] if v.variant_id in fast_by_id else float("nan")
                     for _, v in slow]
        cap_measured = [r.bench.get("capacity", 0.0) for r, _ in slow]
        cap_pred = [predicted_capacity(model, hw, recs, v, cal, **sim) for _, v in slow]
        cap_fast = [fast_score(fast_by_id[v.variant_id].bench)[0] if v.variant_id in fast_by_id else float("nan")
                    for _, v in slow]
        nan = float("nan")
        ok_fast = len(slow) > 1 and not any(math.isnan(x) for x in fast_pred)
        cost = {"variants": len(slow), "calibration": cal.to_json(),
                "mape_calibrated": mape(pred_cal, measured) if slow else nan,
                "mape_roofline": mape(pred_roof, measured) if slow else nan,
                "spearman_cost_model": spearman(pred_cal, measured) if len(slow) > 1 else nan,
                "spearman_fast_tier": spearman(fast_pred, measured) if ok_fast else nan,
                "mape_capacity": mape(cap_pred, cap_measured) if slow and all(cap_measured) else nan,
                "spearman_capacity_cost_model": spearman(cap_pred, cap_measured) if len(slow) > 1 else nan,
                "spearman_capacity_fast_tier": spearman(cap_fast, cap_measured) if ok_fast else nan,
                "points": [{"variant_id": v.variant_id, "name": v.name, "measured": m, "calibrated": pc,
                            "roofline": pr, "fast": f, "capacity": cm, "capacity_predicted": cp}
                           for (_, v), m, pc, pr, f, cm, cp in zip(slow, measured, pred_cal, pred_roof, fast_pred,
                                                                   cap_measured, cap_pred)]}
        self.board.post("cost-model", "note", {"search": self.id, "error": {
            k: v for k, v in cost.items() if k != "points"}}, [r.id for r, _ in slow])
        return cost

    def judgement(self) -> "Judgement | None":
        """The search's judgement, once ``judge`` has posted it on the board (by this process or another step)."""
        from ops.judge.rule import Judgement  # noqa: F811 (at run time)

        for m in reversed(self.board.messages("note")):
            if m["body"].get("search") == self.id and "judgement" in m["body"]:
                return Judgement.from_json(m["body"]["judgement"])
        return None

    def judge(self, jcfg: "JudgeConfig | None" = None, excluded: dict[str, str] | None = None) -> "Judgement":
        """The judge, run on this search's slow tier (``ops.search.judge_search.judge_search``); posted on the board."""
        from ops.search.judge_search import judge_search

        return judge_search(self, jcfg, excluded)

    def decide(self, excluded: dict[str, str] | None = None, jcfg=None) -> tuple[Choice | None, dict]:
        """The decision, from the judgement (``judge``, run now unless a step before posted it); the decision, its
        reason and the result ids behind it go on the board. ``excluded``: variant id -> why it may not be
        chosen (a failed gate)."""
        excluded = excluded or {}
        slow = self.results(SLOW)
        base = next(((r, v) for r, v in slow if v.variant_id == self.baseline.variant_id), None)
        if base is None:
            return None, {"reason": "no slow-tier measurement of the baseline; nothing chosen", "refs": [],
                          "baseline": None, "chosen": None, "message_id": None, "judgement": None}
        j = self.judgement()
        if j is None:
            j = self.judge(jcfg, excluded)
        if j.chosen in excluded:  # chosen, then refused by a gate: nothing else was adopted in its place
            j.reason = f"kept static-best: {by_name(slow, j.chosen)} was chosen ({j.reason}) but {excluded[j.chosen]}"
            j.chosen = j.baseline
        by_id = {v.variant_id: (r, v) for r, v in slow}
        chosen_r, chosen_v = by_id.get(j.chosen, base)
        refs = sorted({base[0].id, chosen_r.id} | {by_id[c.variant_id][0].id for c in j.comparisons
                                                   if c.variant_id in by_id})
        choice = Choice(chosen_v, bench_from(chosen_r.bench), bench_from(base[0].bench), j.reason)
        decision = {"search": self.id, "reason": j.reason, "refs": refs, "variant_id": chosen_v.variant_id,
                    "verdict": j.verdict}
        decision["message_id"] = self.board.post("tuner", "decision", decision, refs)
        decision.update(baseline=base[0].bench, chosen=choice.result.to_json(), judgement=j.to_json())
        return choice, decision

    def rows(self) -> list[dict]:
        results = {r.experiment_id: r for tier in (FAST, SLOW) for r, _ in self.results(tier)}
        rows = []
        for e in self.board.experiments(self.id):
            row = {"experiment": e["id"], "tier": e["tier"], "proposer": e["proposer"], "rationale": e["rationale"],
                   "name": json.loads(e["variant"])["name"], "variant_id": e["variant_id"], "status": e["status"],
                   "attempts": e["attempts"], "error": (e["error"] or "").split("\n")[0]}
            r = results.get(e["id"])
            if r:
                row.update(result_id=r.id, output_tok_s=r.bench["output_tok_s"], spread=r.bench["spread"],
                           capacity=r.bench.get("capacity_predicted", 0.0) if e["tier"] == SLOW else fast_score(r.bench)[0],
                           capacity_spread=r.bench.get("capacity_spread", 0.0) if e["tier"] == SLOW else 0.0,
                           attainment=r.bench.get("attainment", 0.0) if e["tier"] == SLOW else fast_score(r.bench)[1])
                spec = json.loads(e["variant"])
                row.update(weight_dtype=spec.get("weight_dtype", "auto"), tp=spec.get("tp", 1), dp=spec.get("dp", 1))
                if r.bench.get("start_s"):
                    row["start_s"] = r.bench["start_s"]
                if r.bench.get("spec_accepted_length"):
                    row.update(spec_acceptance=r.bench["spec_acceptance"],
                               spec_accepted_length=r.bench["spec_accepted_length"])
            rows.append(row)
        return rows

    def invalid_replies(self) -> int:
        return sum(1 for m in self.board.messages("invalid_reply") if m["body"].get("search") == self.id)


def by_name(results: list, variant_id: str) -> str:
    return next((v.name for _, v in results if v.variant_id == variant_id), variant_id)


def tune(cfg: SearchConfig, board_path: str | Path, agents: list[Agent] | None = None, budget: Budget = Budget(),
         slow_top: int = 2, per_agent: int = 1, hardware: HardwareProfile | None = None,
         baseline: VariantSpec | None = None, gate: bool = False, search: str | None = None,
         log: Callable[[str], None] = _quiet, speculation: bool = True, precision: bool = True,
         jcfg=None) -> TuneReport:
    """Agents propose in rounds (``per_agent`` each, so that a small budget still hears every agent) and the
    fast tier measures until the budget's fast share is spent or nobody proposes anything new; then the slow tier measures the baseline and the best, and the
    decision is recorded. With ``speculation``, static-best with prompt-lookup speculation joins the slow tier
    where the replay is real text (``Search.speculation_candidate``), then a second setting of its policy chosen
    from the first one's measured acceptance (``Search.speculation_followup``). With ``precision``, static-best
    with quantized weights joins the slow tier too (``Search.precision_candidate``); where it measures at least
    as good as static-best the gates judge it before the decision, and a failed gate excludes it (on synthetic
    weights, whose near-tied logits make a verdict meaningless, the gates run only with ``gate`` and report their
    figures as the numerical error, unjudged)."""
    t0 = time.time()
    deadline = t0 + budget.seconds
    agents = default_agents() if agents is None else agents
    s = Search.start(cfg, board_path, search, hardware, baseline, log=log)
    if hasattr(log, "attach"):  # a progress display (pipelines/cli/progress.py) reads the search's counts
        log.attach(s)
    log(f"search {s.id}: cost model ranked {len(s.plan.entries)} knob variants; ranges {s.plan.ranges}")
    # the slow tier's share: static-best, the fast tier's best and, where the replay is real text, two settings
    # of speculation
    spec_slots = (2 if speculation and s.speculation_candidate() is not None else 0) + \
        (1 if precision and s.precision_candidate() is not None else 0) + len(s.layout_candidates())
    fast_budget = max(1, budget.experiments - (slow_top + 1 + spec_slots))
    s.measure_fast(deadline)  # the baseline, then the full model's calibration the fast tier scales from
    cal = s.cal
    log(f"calibrated on {cal.samples} full-model shapes (fit error {cal.fit_mape:.1%})")
    while time.time() < deadline and s.n_experiments(FAST) < fast_budget:
        queued = 0
        for agent in agents:
            room = fast_budget - s.n_experiments(FAST)
            if room <= 0 or time.time() >= deadline:
                break
            queued += s.propose(agent, min(per_agent, room))
            done = s.measure_fast(deadline)
            log(f"{agent.name}: {done.evaluated} measured, {done.failed} failed")
        if not queued:
            break
    slow_room = max(1, budget.experiments - s.n_experiments() - spec_slots)
    s.queue_slow(min(slow_top, slow_room - 1), speculation, precision)
    s.measure(SLOW)  # the slow tier's share of the budget was kept back; it runs to the end
    if speculation and s.speculation_followup() is not None:
        s.measure(SLOW)  # the speculation policy's second setting, chosen from the first one's acceptance
    log(f"slow tier: {len(s.results(SLOW))} measured")
    cost = s.cost_model_error(cal)
    # the choice is gated after the judge chose it and it held out of sample (a precision form always on real
    # weights, anything else with ``gate``; a failure keeps static-best); the judge gets what the search left
    from ops.judge.paired import JudgeConfig  # (at least a minute: a decision needs its probes)
    jcfg = jcfg or (JudgeConfig.for_cpu() if cfg.device == "cpu" else JudgeConfig())
    asked, jcfg = jcfg.seconds, replace(jcfg, seconds=min(jcfg.seconds, max(60.0, deadline - time.time())))
    if jcfg.seconds < asked:
        log(f"the judge gets {jcfg.seconds:.0f} s of the {asked:.0f} s asked: the stages before it took "
            f"{time.time() - t0:.0f} s of the search's {budget.seconds:.0f} s (the budget includes the judge)")
    choice, decision = s.decide(jcfg=jcfg)
    chosen = choice.variant if choice else s.baseline
    quality = None
    if chosen.variant_id != s.baseline.variant_id and (gate or (chosen.weight_dtype != "auto" and s.bench.real_text)):
        quality = s.gate(chosen)
        if quality["verdict"] == "fail":
            why = "failed the quality gate (" + "; ".join(quality["reasons"]) + ")"
            choice, decision = s.decide({chosen.variant_id: why}, jcfg=jcfg)
            decision["reason"] += f"; {chosen.variant_id} excluded: {why}"
            chosen = choice.variant if choice else s.baseline
    report = TuneReport(search=s.id, board=str(board_path), config=s.cfg.to_json(), baseline=s.baseline.to_json(),
                        chosen=chosen.to_json(), decision=decision, rows=s.rows(), cost_model=cost,
                        invalid_replies=s.invalid_replies(), wall_s=time.time() - t0, budget=asdict(budget),
                        quality=quality)
    s.board.close()
    return report
