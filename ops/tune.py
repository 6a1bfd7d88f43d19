"""A search: agents propose, workers measure on the fast tier, the best go to the slow tier, and the
decision records why (design sections 5 to 7). ``polyinf tune`` and the pipeline's
``variant_candidates`` / bench assets run this code.

Budget: at most ``experiments`` measurements (fast and slow together) and ``seconds`` of wall time;
the slow tier's share (the baseline and the ``slow_top`` best of the fast tier) is kept back.
"""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.variant import VariantSpec
from ops.agents import Agent, CostModelSeeder, LocalSearch, SearchState, TrafficRules, fast_score
from ops.board import Board
from ops.cost_model import ROOFLINE, calibrate, mape, plan, shapes_from_steps, simulate, spearman
from ops.hardware import HardwareProfile, probe
from ops.optimize import choose
from ops.worker import FAST, SLOW, SearchConfig, Workbench, bench_from, work


@dataclass(frozen=True)
class Budget:
    experiments: int = 12
    seconds: float = 900.0


@dataclass
class TuneReport:
    search: str
    board: str
    config: dict
    baseline: dict
    chosen: dict
    decision: dict  # reason, the result ids behind it, the board message id
    rows: list[dict]  # every experiment: proposer, rationale, tier, status, figures, result id
    cost_model: dict  # calibration, MAPE, Spearman
    invalid_replies: int
    wall_s: float
    budget: dict
    quality: dict | None = None

    def to_json(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        lines = [f"search {self.search} on {self.board} ({self.wall_s:.0f} s, budget {self.budget['experiments']} "
                 f"experiments / {self.budget['seconds']:.0f} s)", "",
                 f"{'id':>3} {'tier':4} {'proposer':14} {'variant':34} {'tok/s':>8} {'spread':>7} {'goodput':>8} "
                 f"{'result':>6}  status"]
        for r in self.rows:
            lines.append(f"{r['experiment']:>3} {r['tier']:4} {r['proposer'][:14]:14} {r['name'][:34]:34} "
                         f"{r.get('output_tok_s', float('nan')):8.1f} {r.get('spread', float('nan')):7.2f} "
                         f"{r.get('goodput', float('nan')):8.2f} {str(r.get('result_id', '-')):>6}  {r['status']}")
        cm = self.cost_model
        lines += ["", "cost model against the slow tier "
                  f"({cm['variants']} variants): MAPE calibrated {cm['mape_calibrated']:.1%}, roofline "
                  f"{cm['mape_roofline']:.1%}; Spearman on throughput: cost model {cm['spearman_cost_model']:.2f}, "
                  f"fast tier {cm['spearman_fast_tier']:.2f}",
                  f"decision: {self.decision['reason']}",
                  f"  rests on results {self.decision['refs']} (board message {self.decision['message_id']})"]
        b, c = self.decision["baseline"], self.decision["chosen"]
        if c:
            lines.append(f"  chosen/baseline: output tok/s {c['output_tok_s']:.2f}/{b['output_tok_s']:.2f} = "
                         f"{c['output_tok_s'] / b['output_tok_s']:.2f}x (spreads {c['spread']:.2f}, {b['spread']:.2f}); "
                         f"goodput {c['goodput']:.2f}/{b['goodput']:.2f} req/s")
        if self.quality:
            lines.append(f"gates: {self.quality['verdict']}" + (f" ({'; '.join(self.quality['reasons'])})"
                                                                  if self.quality.get("reasons") else ""))
        lines.append(f"invalid LLM replies recorded: {self.invalid_replies}")
        return "\n".join(lines)


def default_agents() -> list[Agent]:
    return [CostModelSeeder(), TrafficRules(), LocalSearch()]


def new_search_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]


def tune(cfg: SearchConfig, board_path: str | Path, agents: list[Agent] | None = None, budget: Budget = Budget(),
         slow_top: int = 2, per_agent: int = 2, hardware: HardwareProfile | None = None,
         baseline: VariantSpec | None = None, gate: bool = False, search: str | None = None,
         log=lambda msg: None) -> TuneReport:
    t0 = time.time()
    deadline = t0 + budget.seconds
    agents = default_agents() if agents is None else agents
    board = Board(board_path)
    search = search or new_search_id()
    board.create_search(search, cfg.to_json())
    hw = hardware or probe(cfg.device, size_mb=64 if cfg.device == "cpu" else 256)
    bench = Workbench(cfg, hw)
    spec = bench.spec_for(SLOW)
    base = baseline or VariantSpec(name="baseline (default)")
    p = plan(spec, hw, bench.traffic, base, records=bench.records, **cfg.sim)
    board.post("cost-model", "note", {"plan_top": [e.to_json() | {"variant": e.variant.name}
                                                   for e in p.entries[:5]],
                                      "ranges": p.ranges, "layouts": p.layouts})
    log(f"cost model ranked {len(p.entries)} knob variants; ranges {p.ranges}")
    fast_budget = max(1, budget.experiments - (slow_top + 1))
    board.enqueue(search, base, FAST, "baseline", "the engine's default configuration")
    work(board, search, bench, FAST, deadline=deadline)

    def n_fast() -> int:
        return sum(1 for e in board.experiments(search) if e["tier"] == FAST)

    while time.time() < deadline and n_fast() < fast_budget:
        queued = 0
        for agent in agents:
            room = fast_budget - n_fast()
            if room <= 0 or time.time() >= deadline:
                break
            state = SearchState.read(board, search, spec=spec, hardware=hw, traffic=bench.traffic, plan=p,
                                     baseline=base, device=cfg.device, max_input=cfg.max_input)
            for prop in agent.propose(state, min(per_agent, room)):
                _, fresh = board.enqueue(search, prop.variant, FAST, agent.name, prop.rationale, list(prop.refs))
                queued += fresh
            done = work(board, search, bench, FAST, deadline=deadline)
            log(f"{agent.name}: {done.evaluated} measured, {done.failed} failed")
        if not queued:
            break

    fast = board.results(search, FAST)
    base_fast = next((r for r, v in fast if v.variant_id == base.variant_id), None)
    ranked = sorted((rv for rv in fast if rv[1].variant_id != base.variant_id),
                    key=lambda rv: fast_score(rv[0].bench), reverse=True)
    slow_room = max(0, budget.experiments - len(board.experiments(search)))
    board.enqueue(search, base, SLOW, "tuner", "baseline for the slow tier", [base_fast.id] if base_fast else [])
    for r, v in ranked[: max(0, min(slow_top, slow_room - 1))]:
        g, tps = fast_score(r.bench)
        board.enqueue(search, v, SLOW, "tuner", f"fast tier rank: implied goodput {g:.2f} req/s, {tps:.1f} tok/s",
                      [r.id])
    work(board, search, bench, SLOW)  # the slow tier's share of the budget was kept back; it runs to the end
    slow = board.results(search, SLOW)
    # calibration: correction factors fitted to the baseline's measured full-model forward passes
    base_slow_r = next((r for r, v in slow if v.variant_id == base.variant_id), None)
    cal = calibrate(spec, hw, shapes_from_steps(base_slow_r.bench["step_samples"])) if base_slow_r else ROOFLINE
    board.post("cost-model", "note", {"calibration": cal.to_json(),
                                      "from_result": base_slow_r.id if base_slow_r else None},
               [base_slow_r.id] if base_slow_r else [])

    # the cost model's error and both tiers' ranking against the slow tier
    fast_by_id = {v.variant_id: r for r, v in fast}
    measured = [r.bench["output_tok_s"] for r, _ in slow]
    pred_cal = [simulate(spec, hw, bench.records, v, cal, **cfg.sim).output_tok_s for _, v in slow]
    pred_roof = [simulate(spec, hw, bench.records, v, ROOFLINE, **cfg.sim).output_tok_s for _, v in slow]
    fast_tier = [fast_score(fast_by_id[v.variant_id].bench)[1] if v.variant_id in fast_by_id else float("nan")
                 for _, v in slow]
    nan = float("nan")
    cost = {"variants": len(slow), "calibration": cal.to_json(),
            "mape_calibrated": mape(pred_cal, measured) if slow else nan,
            "mape_roofline": mape(pred_roof, measured) if slow else nan,
            "spearman_cost_model": spearman(pred_cal, measured) if len(slow) > 1 else nan,
            "spearman_fast_tier": spearman(fast_tier, measured) if len(slow) > 1 and not any(
                math.isnan(x) for x in fast_tier) else nan,
            "points": [{"variant_id": v.variant_id, "measured": m, "calibrated": pc, "roofline": pr, "fast": f}
                       for (_, v), m, pc, pr, f in zip(slow, measured, pred_cal, pred_roof, fast_tier)]}
    board.post("cost-model", "note", {"error": {k: v for k, v in cost.items() if k != "points"}},
               [r.id for r, _ in slow])

    base_slow = next(((r, v) for r, v in slow if v.variant_id == base.variant_id), None)
    decision: dict = {"reason": "no slow-tier measurement of the baseline; nothing chosen", "refs": [],
                      "baseline": None, "chosen": None, "message_id": None}
    chosen_variant = base
    if base_slow:
        cands = [(v, bench_from(r.bench)) for r, v in slow if v.variant_id != base.variant_id]
        choice = choose(cands, (base, bench_from(base_slow[0].bench)))
        chosen_variant = choice.variant
        ids = {v.variant_id: r.id for r, v in slow}
        refs = sorted({ids[base.variant_id], ids[choice.variant.variant_id]})
        decision = {"reason": choice.reason, "refs": refs, "variant_id": choice.variant.variant_id,
                    "baseline": base_slow[0].bench, "chosen": choice.result.to_json()}
        decision["message_id"] = board.post("tuner", "decision", {k: v for k, v in decision.items()
                                                                   if k not in ("baseline", "chosen")}, refs)
    quality = None
    if gate and chosen_variant.variant_id != base.variant_id:
        from checks.gates import gate_variant

        report = gate_variant(bench.engine(SLOW, base), chosen_variant)
        quality = report.to_json()
        board.post("gates", "note", {"variant_id": chosen_variant.variant_id, "verdict": report.verdict,
                                     "reasons": report.reasons})

    results = {r.experiment_id: r for r, _ in fast + slow}
    rows = []
    for e in board.experiments(search):
        row = {"experiment": e["id"], "tier": e["tier"], "proposer": e["proposer"], "rationale": e["rationale"],
               "name": json.loads(e["variant"])["name"], "variant_id": e["variant_id"], "status": e["status"],
               "attempts": e["attempts"], "error": (e["error"] or "").split("\n")[0]}
        r = results.get(e["id"])
        if r:
            row.update(result_id=r.id, output_tok_s=r.bench["output_tok_s"], spread=r.bench["spread"],
                       goodput=r.bench["goodput"] if e["tier"] == SLOW else fast_score(r.bench)[0])
        rows.append(row)
    invalid = sum(1 for m in board.messages("invalid_reply") if m["body"].get("search") == search)
    report = TuneReport(search=search, board=str(board_path), config=cfg.to_json(), baseline=base.to_json(),
                        chosen=chosen_variant.to_json(), decision=decision, rows=rows, cost_model=cost,
                        invalid_replies=invalid, wall_s=time.time() - t0, budget=asdict(budget), quality=quality)
    board.close()
    return report

