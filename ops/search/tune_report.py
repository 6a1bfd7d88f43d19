"""What a search reports: every experiment with its proposer, tier and figures, the cost model's error, the
decision with the results it rests on, and the lines for the dimensions only the slow tier judges
(speculation's acceptance, precision against static-best)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ops.search.config import SLOW


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
                 f"SLO: TTFT <= {1e3 * self.config['slo_ttft_s']:.0f} ms, TPOT <= {1e3 * self.config['slo_tpot_s']:.0f} "
                 f"ms for 90% of requests ({self.config.get('slo_source', 'given')})",
                 f"{'id':>3} {'tier':4} {'proposer':14} {'variant':34} {'tok/s':>8} {'spread':>7} {'capacity':>9} "
                 f"{'spread':>7} {'attain':>6} {'result':>6}  status   (capacity: the simulator's prediction; the judge's "
                 "measured capacities follow)"]
        for r in self.rows:
            lines.append(f"{r['experiment']:>3} {r['tier']:4} {r['proposer'][:14]:14} {r['name'][:34]:34} "
                         f"{r.get('output_tok_s', float('nan')):8.1f} {r.get('spread', float('nan')):7.2f} "
                         f"{r.get('capacity', float('nan')):9.3f} {r.get('capacity_spread', float('nan')):7.3f} "
                         f"{r.get('attainment', float('nan')):6.2f} {str(r.get('result_id', '-')):>6}  {r['status']}")
        base_row = next((r for r in self.rows if r["tier"] == SLOW and r["variant_id"] == self.baseline["variant_id"]
                         and "capacity" in r), None)
        for r in self.rows:
            if r.get("weight_dtype", "auto") != "auto" and r["tier"] == SLOW and "capacity" in r and base_row:
                lines.append(f"    precision: {r['name']}: capacity {r['capacity']:.3f} (predicted) vs static-best "
                             f"{base_row['capacity']:.3f} req/s, output {r['output_tok_s']:.1f} vs "
                             f"{base_row['output_tok_s']:.1f} tok/s ({r['output_tok_s'] / base_row['output_tok_s']:.2f}x)")
        for r in self.rows:
            if r["tier"] == SLOW and "capacity" in r and (r.get("tp", 1), r.get("dp", 1)) != (1, 1) and base_row:
                lines.append(f"    layout: {r['name']}: capacity {r['capacity']:.3f} vs static-best on one device "
                             f"{base_row['capacity']:.3f} req/s, output {r['output_tok_s']:.1f} vs "
                             f"{base_row['output_tok_s']:.1f} tok/s; started (restart-scope swap) in "
                             f"{r.get('start_s', 0.0):.1f} s")
        for r in self.rows:
            if r.get("spec_accepted_length"):
                lines.append(f"    {r['name']}: speculation accepted {r['spec_acceptance']:.0%} of drafted tokens, "
                             f"{r['spec_accepted_length']:.2f} tokens per verified draft")
        cm = self.cost_model
        lines += ["", "cost model against the slow tier "
                  f"({cm['variants']} variants): MAPE calibrated {cm['mape_calibrated']:.1%}, roofline "
                  f"{cm['mape_roofline']:.1%}; Spearman on throughput: cost model {cm['spearman_cost_model']:.2f}, "
                  f"fast tier {cm['spearman_fast_tier']:.2f}; capacity: MAPE {cm.get('mape_capacity', float('nan')):.1%}"
                  f", Spearman cost model {cm.get('spearman_capacity_cost_model', float('nan')):.2f}, fast tier "
                  f"{cm.get('spearman_capacity_fast_tier', float('nan')):.2f}",
                  f"decision: {self.decision['reason']}",
                  f"  rests on results {self.decision['refs']} (board message {self.decision['message_id']})"]
        b, c = self.decision["baseline"], self.decision["chosen"]
        j = self.decision.get("judgement")
        if j:
            from ops.judge.rule import Judgement

            judged = Judgement.from_json(j)
            lines += judged.lines()
            lines.append(judged.headline())
        if c and b:
            lines.append(f"  output tok/s {c['output_tok_s']:.2f} / {b['output_tok_s']:.2f} = "
                         f"{c['output_tok_s'] / b['output_tok_s']:.2f}x (spreads {c['spread']:.2f}, {b['spread']:.2f}); "
                         f"SLO attainment at the traffic's own rate {c['attainment']:.2f} / {b['attainment']:.2f}")
        if self.quality:
            lines.append(f"gates: {self.quality['verdict']}" + (f" ({'; '.join(self.quality['reasons'])})"
                                                                  if self.quality.get("reasons") else ""))
        lines.append(f"invalid LLM replies recorded: {self.invalid_replies}")
        return "\n".join(lines)
