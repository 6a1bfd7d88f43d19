"""The judge: every decision of the loop (choose, deploy, keep, roll back) goes through this module.

A decision rests on capacity at the SLO, measured with its interval (ops/measure/capacity.py). Here:

- **A comparison** (``compare``) of a candidate with the baseline, both replayed on the same windows and
  arrivals in lockstep, gives the capacity ratio's 95% interval from the same bootstrap and a verdict:
  better, worse, no detectable difference, or censored. ``decide`` adopts a candidate only when the
  ratio's lower bound exceeds 1.05 after Holm's correction over the candidates, its saturation throughput is
  not 5% below the baseline's, and its latency at the traffic's own rate is not significantly worse than
  the baseline's by more than 5% (unless the trade is named).
- **Out of sample** (``confirm``): the choice is replayed with the baseline on a window the search did not
  see, at a rate between their capacities; it holds when its attainment there is higher (Newcombe 95%).
- **Live verification** (``verify_live``): attainment of the live traffic after a swap against the window
  before; significantly worse rolls back.

Nothing here touches an engine. References: pyperf and Criterion's "not significant", Newcombe (1998) for a
difference of proportions.
"""
from __future__ import annotations

import math
import random
import statistics
from dataclasses import asdict, dataclass, field
from typing import Callable

from ops.measure.capacity import TARGET, Capacity, Probe, _quantile, _replicate_range, ceiling, newcombe, wilson

MIN_GAIN = 1.05  # a capacity ratio whose lower bound does not clear this is no reason to change
TOLERANCE = 0.05  # saturation throughput and latency may not be worse by more than this


# ---- comparisons and the decision ------------------------------------------------------------------------
@dataclass
class Arm:
    """What the judge knows of one variant: its capacity, saturation throughput and, at the traffic's own rate,
    each request's TTFT and TPOT (the same requests for every arm: paired)."""

    variant_id: str
    name: str
    capacity: Capacity
    saturation: float = 0.0  # req/s with every request of a window at once (the median of its rounds)
    ttft: list[float] = field(default_factory=list)  # seconds, per request of the own-rate replay
    tpot: list[float] = field(default_factory=list)  # seconds, per request (None where not judged)
    predicted: float = 0.0  # the simulator's capacity (req/s), when it made one
    saturation_rounds: list[float] = field(default_factory=list)  # per paired round (the same window, alternated)


@dataclass
class Comparison:
    variant_id: str
    name: str
    ratio: float  # capacity, candidate / baseline (from the two estimates)
    low: float
    high: float  # math.inf when the candidate's capacity is censored above
    p_value: float  # one-sided, of "the ratio is at most MIN_GAIN", from the bootstrap
    verdict: str  # "better" | "worse" | "no detectable difference" | "censored"
    adopted: bool = False
    reasons: list[str] = field(default_factory=list)
    guards: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        d = asdict(self)
        d["high"] = None if self.high == math.inf else self.high
        d["ratio"] = self.ratio if self.ratio is not None and math.isfinite(self.ratio) else None
        return d

    def line(self) -> str:
        if not self.measured:
            return "no ratio (an arm was not measured)"
        if self.high == math.inf and self.low == 0.0:
            return "no ratio (its 95% interval runs from 0 to inf: an arm is known only as a bound)"
        if self.high == math.inf:  # some redrawn baselines passed no rate: bounded below only
            return f"{self.ratio:.2f}x (95% {self.low:.2f}x, no upper bound)"
        return f"{self.ratio:.2f}x (95% {self.low:.2f}-{self.high:.2f}x)"

    @property
    def measured(self) -> bool:
        return self.ratio is not None and math.isfinite(self.ratio) and self.ratio > 0


def ratio_interval(cand: Capacity, base: Capacity, replicates: int = 2000, seed: int = 1,
                   target: float = TARGET) -> tuple[float, float, float, float]:
    """(ratio, low, high, p) of two capacities: the estimates' ratio, its 95% interval from the block
    bootstrap of both arms' probes, and the one-sided p-value of "ratio <= MIN_GAIN". A censored end enters
    as the range it leaves open (``_replicate_range``, as in each arm's own interval; above, up to the arm's
    ``ceiling``): the lower bound takes each replicate's least ratio, the upper bound its greatest, which errs
    against a verdict either way (an arm whose one probe decided nothing is not "below" in every replicate)."""
    rng = random.Random(seed)
    least, most = [], []
    b_top, c_top = ceiling(base.probes, base.saturation), ceiling(cand.probes, cand.saturation)
    for _ in range(replicates):
        b_lo, b_hi = _replicate_range(base.probes, rng, target, b_top)
        c_lo, c_hi = _replicate_range(cand.probes, rng, target, c_top)
        least.append(c_lo / b_hi if b_hi > 0 else math.inf)
        most.append(c_hi / b_lo if b_lo > 0 else math.inf)
    least.sort()
    most.sort()
    ratios = least
    est = cand.estimate / base.estimate if base.estimate > 0 else math.inf
    low, high = _quantile(least, 0.025), _quantile(most, 0.975)
    if cand.censored == "above" or base.censored == "below":
        high = math.inf  # the ratio is only bounded below
    if cand.censored == "below":
        low = 0.0  # the ratio is only bounded above
    elif base.censored == "above":  # static-best passed every rate: no more than its ceiling
        low = min(low, cand.low / b_top) if 0 < b_top < math.inf else 0.0
    p = (1 + sum(1 for r in ratios if r <= MIN_GAIN)) / (replicates + 1)
    return est, min(low, est), max(high, est), p


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return math.nan
    k = (len(xs) - 1) * q
    f = math.floor(k)
    c = min(f + 1, len(xs) - 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)


def latency_worse(cand: list[float], base: list[float], q: float, replicates: int = 1000,
                  seed: int = 2) -> tuple[float, float, bool]:
    """(ratio of the candidate's ``q`` percentile to the baseline's, its bootstrap lower bound, significantly
    worse by more than TOLERANCE): requests redrawn in pairs (the same requests replayed by both arms)."""
    pairs = [(c, b) for c, b in zip(cand, base) if c is not None and b is not None]
    if len(pairs) < 4:
        return math.nan, math.nan, False
    pb = _percentile([b for _, b in pairs], q)
    ratio = _percentile([c for c, _ in pairs], q) / pb if pb > 0 else math.nan
    rng, reps = random.Random(seed), []
    for _ in range(replicates):
        draw = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        b = _percentile([x for _, x in draw], q)
        reps.append(_percentile([x for x, _ in draw], q) / b if b > 0 else math.inf)
    reps.sort()
    low = _quantile(reps, 0.025)
    return ratio, low, low > 1 + TOLERANCE


def compare(cand: Arm, base: Arm, allow_trade: bool = False) -> Comparison:
    """The candidate against the baseline: the capacity ratio's interval and verdict, then the guards (each
    measured on the same requests): saturation throughput not lower by more than 5%, p50/p99 TTFT and TPOT at
    the traffic's own rate not significantly worse by more than 5% (waived, and named, with ``allow_trade``)."""
    unmeasured = [a.name for a in (cand, base) if a.capacity.status == "unmeasured"]
    if unmeasured:  # no request of an arm was counted: no ratio, no verdict either way
        ratio, low, high, p = math.nan, 0.0, math.inf, 1.0
    else:
        ratio, low, high, p = ratio_interval(cand.capacity, base.capacity)
    c, b = cand.capacity.censored, base.capacity.censored
    if unmeasured:
        verdict = "no detectable difference"
    elif c and c == b:
        verdict = "censored"
    elif low > MIN_GAIN:
        verdict = "better"
    elif high < 1 / MIN_GAIN:
        verdict = "worse"
    else:
        verdict = "no detectable difference"
    reasons, guards = [], {}
    if unmeasured:
        reasons.append(" and ".join(unmeasured) + " not measured: the judge's budget ended first")
    if verdict == "censored":
        reasons.append(f"both capacities are censored {c} the rates probed: "
                       f"{cand.capacity.describe()} and {base.capacity.describe()}")
        shared = shared_rate(cand.capacity, base.capacity, highest=c == "above")
        if shared:
            reasons.append(shared)
    if base.saturation > 0 and cand.saturation > 0:
        s = cand.saturation / base.saturation
        guards["saturation_ratio"] = s
        rounds = [c / b for c, b in zip(cand.saturation_rounds, base.saturation_rounds) if b > 0] or [s]
        if max(rounds) < 1 - TOLERANCE:  # lower by more than 5% in every paired round, not one noisy round
            reasons.append(f"saturation throughput {s:.2f}x static-best's ({cand.saturation:.2f} vs "
                           f"{base.saturation:.2f} req/s; rounds " + ", ".join(f"{r:.2f}x" for r in rounds)
                           + f"): lower by more than {TOLERANCE:.0%}")
    trades = []
    for label, cv, bv in (("TTFT", cand.ttft, base.ttft), ("TPOT", cand.tpot, base.tpot)):
        for q in (0.5, 0.99):
            r, lo, worse = latency_worse(cv, bv, q)
            key = f"{label} p{int(q * 100)}"
            guards[key] = r
            if worse:
                trades.append(f"{key} at the traffic's own rate {r:.2f}x static-best's (95% lower bound {lo:.2f})")
    if trades and not allow_trade:
        reasons += [t + f": worse by more than {TOLERANCE:.0%}" for t in trades]
    elif trades:
        guards["trade"] = "; ".join(trades) + " (accepted: the SLO asks for capacity)"
    return Comparison(cand.variant_id, cand.name, ratio, low, high, p, verdict, reasons=reasons, guards=guards)


def holm(p_values: list[float], alpha: float = 0.025) -> list[bool]:
    """Holm's step-down procedure: which of the hypotheses are rejected at family-wise level ``alpha``."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    out = [False] * len(p_values)
    for k, i in enumerate(order):
        if p_values[i] > alpha / (len(p_values) - k):
            break
        out[i] = True
    return out


@dataclass
class Confirmation:
    """The choice and the baseline replayed on a window the search did not see: at one rate after another (the
    same requests and arrivals for both), until the choice is significantly better at one of them (holds), the
    baseline significantly better or better on the point estimates where the choice fails (does not hold), or
    the rates run out. ``base``/``cand``/``diff``... are the last rate's; ``steps`` every rate's."""

    rate: float
    window: int
    base: Probe
    cand: Probe
    diff: float
    low: float
    high: float
    holds: bool
    steps: list = field(default_factory=list)  # [rate, base attainment, cand attainment, diff, low, high]

    def to_json(self) -> dict:
        return {"rate": self.rate, "window": self.window, "base": self.base.to_json(), "cand": self.cand.to_json(),
                "diff": self.diff, "low": self.low, "high": self.high, "holds": self.holds, "steps": self.steps}

    @classmethod
    def from_json(cls, d: dict) -> "Confirmation":
        return cls(d["rate"], d["window"], Probe.from_json(d["base"]), Probe.from_json(d["cand"]), d["diff"],
                   d["low"], d["high"], d["holds"], d.get("steps", []))

    def line(self) -> str:
        before = "".join(f"{r:.3f} req/s: {c:.2f} vs {b:.2f}; " for r, b, c, *_ in self.steps[:-1])
        if not (self.base.n and self.cand.n):
            return (f"held-out window (requests from #{self.window}), " + (f"{before}" if before else "")
                    + "the judge's budget ended before both arms replayed the next rate: not confirmed")
        return (f"held-out window (requests from #{self.window}), " + (f"first {before}then " if before else "")
                + f"at {self.rate:.3f} req/s: attainment {self.cand.attainment:.2f} ({self.cand.interval[0]:.2f}-"
                f"{self.cand.interval[1]:.2f}, n {self.cand.n}) vs static-best {self.base.attainment:.2f} "
                f"({self.base.interval[0]:.2f}-{self.base.interval[1]:.2f}, n {self.base.n}): difference "
                f"{self.diff:+.2f} (95% {self.low:+.2f} to {self.high:+.2f}): "
                f"{'holds' if self.holds else 'does not hold'}")


def confirm_rate(cand: Capacity, base: Capacity) -> float:
    """Where the held-out window tells the two apart first: between the two capacities (their geometric mean)."""
    return math.sqrt(max(cand.estimate, 1e-9) * max(base.estimate, 1e-9))


def confirm(replay: Callable[[str, float], Probe], cand: Capacity, base: Capacity, max_rates: int = 3,
            target: float = TARGET) -> Confirmation:
    """Replays the baseline ("base") and the choice ("cand") on held-out traffic, first between their capacities.
    A held-out window may be lighter or heavier than the search's: where both meet the target the rate goes up
    (by the claimed ratio, 1.1x to 2x), where both miss it down, where only the choice meets it up a little
    (the gap widens with load); the choice holds as soon as its attainment is significantly higher
    (Newcombe's interval above 0) and does not hold where the baseline's is significantly higher, where the
    baseline meets the target and the choice does not, or when ``max_rates`` or the budget (a replay with no
    counted request) run out."""
    ratio = max(cand.estimate, 1e-9) / max(base.estimate, 1e-9)
    step = max(1.1, min(2.0, ratio))
    rate = confirm_rate(cand, base)
    steps = []
    light = heavy = 0.0  # the highest rate both met the target at, the lowest both missed it at
    for k in range(max(1, max_rates)):
        b = replay("base", rate)
        c = replay("cand", rate)
        d, lo, hi = newcombe(c.good, c.n, b.good, b.n)
        steps.append([rate, b.attainment, c.attainment, d, lo, hi])
        void = c.verdict == "void" or b.verdict == "void"
        holds = lo > 0 and not void
        spent = not (b.n and c.n)  # the budget ended before both replayed the window
        done = holds or void or spent or hi < 0 or (b.attainment >= target > c.attainment) or k == max_rates - 1
        if done:
            return Confirmation(rate, b.window, b, c, d, lo, hi, holds, steps)
        if b.attainment >= target and c.attainment >= target:
            light = rate
        elif b.attainment < target and c.attainment < target:
            heavy = rate
        if light and heavy:  # both passed below and both missed above: between them, not back to either
            rate = math.sqrt(light * heavy)
        elif light == rate:
            rate *= step
        elif heavy == rate:
            rate /= step
        else:
            rate *= math.sqrt(step)
    raise AssertionError("unreachable")


@dataclass
class Judgement:
    """A decision: the baseline's capacity, every compared candidate, the choice, the out-of-sample check."""

    baseline: str  # variant id
    chosen: str  # variant id (the baseline's when kept)
    verdict: str  # the word for the run: better | worse | no detectable difference | censored
    reason: str
    arms: dict[str, dict] = field(default_factory=dict)  # variant id -> {name, capacity, saturation, predicted}
    comparisons: list[Comparison] = field(default_factory=list)
    confirmation: Confirmation | None = None
    simulator_error: float = math.nan  # max |predicted - measured| / measured over the compared arms
    simulator_probe_error: float = math.nan  # the same, the simulator replaying the judge's own probes
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"baseline": self.baseline, "chosen": self.chosen, "verdict": self.verdict, "reason": self.reason,
                "arms": self.arms, "comparisons": [c.to_json() for c in self.comparisons],
                "confirmation": self.confirmation.to_json() if self.confirmation else None,
                "simulator_error": None if math.isnan(self.simulator_error) else self.simulator_error,
                "simulator_probe_error": None if math.isnan(self.simulator_probe_error) else self.simulator_probe_error,
                "seconds": self.seconds, "notes": self.notes}

    @classmethod
    def from_json(cls, d: dict) -> "Judgement":
        comps = [Comparison(**{**c, "high": math.inf if c.get("high") is None else c["high"],
                               "ratio": math.nan if c.get("ratio") is None else c["ratio"]})
                 for c in d.get("comparisons", [])]
        conf = Confirmation.from_json(d["confirmation"]) if d.get("confirmation") else None
        err, on_probes = d.get("simulator_error"), d.get("simulator_probe_error")
        return cls(d["baseline"], d["chosen"], d["verdict"], d["reason"], d.get("arms", {}), comps, conf,
                   math.nan if err is None else err, math.nan if on_probes is None else on_probes,
                   d.get("seconds", 0.0), d.get("notes", []))

    def capacity(self, variant_id: str) -> Capacity | None:
        arm = self.arms.get(variant_id)
        return Capacity.from_json(arm["capacity"]) if arm and arm.get("capacity") else None

    def comparison(self, variant_id: str) -> Comparison | None:
        return next((c for c in self.comparisons if c.variant_id == variant_id), None)

    @property
    def kept(self) -> bool:
        return self.chosen == self.baseline

    def lines(self) -> list[str]:
        """The judgement as a person reads it: per arm its capacity with its interval, saturation throughput, the
        simulator's figures and every probe; each comparison with its interval, verdict and guards; the
        out-of-sample check; the verdict."""
        out = [f"judge ({self.seconds:.0f} s): {self.verdict}"]
        for vid, a in self.arms.items():
            cap = Capacity.from_json(a["capacity"]) if a.get("capacity") else None
            sim = a.get("predicted")
            err = f", error {abs(sim - cap.estimate) / cap.estimate:.0%}" if sim and cap and cap.estimate > 0 \
                and not cap.censored else ""
            out.append(f"  {short_name(a['name'])}: capacity {cap.describe() if cap else '-'} from "
                       f"{cap.requests if cap else 0} requests in {len(cap.probes) if cap else 0} probes; saturation {a.get('saturation', 0.0):.3f} "
                       f"req/s" + (f"; predicted {sim:.3f} req/s by the simulator{err}" if sim else ""))
            obs = a.get("observed_rate")
            if obs:
                head = f"{cap.estimate / obs:.2f}" if cap and cap.estimate > 0 else "-"
                out.append(f"    at the traffic's rate {obs:.3f} req/s (headroom {head}x): simulated goodput " + ", ".join(
                    f"{a.get(f'goodput_{k}x', 0.0):.2f} req/s (attainment {a.get(f'attainment_{k}x', 0.0):.2f}) at {k}x"
                    for k in ("1", "1.5", "2")))
            if a.get("capacity_gamma") is not None:
                base, slow = a.get("capacity_simulated") or 0.0, a.get("capacity_steps_slower")
                out.append(f"    robustness: gamma arrivals of CV {a.get('interarrival_cv', 0.0):.2f}, simulated "
                           f"capacity {a['capacity_gamma']:.3f} req/s" + (f"; every step 10% slower: {slow:.3f} req/s "
                           f"({slow / base - 1:+.0%})" if slow is not None and base > 0 else ""))
            for p in (cap.probes if cap else []):
                out.append(f"    probe {p.line()}, {p.warmup} warm-up, window #{p.window}")
        for c in self.comparisons:
            g = ", ".join(f"{k} {v:.2f}x" if isinstance(v, float) and not math.isnan(v) else f"{k} {v}"
                          for k, v in c.guards.items() if not (isinstance(v, float) and math.isnan(v)))
            out.append(f"  {short_name(c.name)} / static-best: {c.line()}: {c.verdict}, p {c.p_value:.3f} "
                       f"({'adopted' if c.adopted else 'not adopted'})" + (f"; guards: {g}" if g else "")
                       + "".join(f"; {r}" for r in c.reasons))
        if self.confirmation:
            out.append(f"  out of sample: {self.confirmation.line()}")
        if not math.isnan(self.simulator_error):
            out.append(f"  simulator's capacity error against the replays: {self.simulator_error:.0%} (target 10%)")
        if not math.isnan(self.simulator_probe_error):
            err, fixed = (max((a[k] for a in self.arms.values() if k in a), default=None)
                          for k in ("attainment_error_on_probes", "attainment_error_drift_corrected"))
            out.append(f"  the simulator replaying the judge's own probes (their windows, rates and counted requests):"
                       f" capacity error {self.simulator_probe_error:.0%}" + ("" if err is None else
                       f", attainment off by {err:.2f} per probe on average (the worst arm)") + ("" if fixed is None
                       else f"; {fixed:.2f} with each probe's steps at their measured speed"))
        out += [f"  note: {n}" for n in self.notes]
        return out

    def headline(self) -> str:
        """The line every report prints: the ratio with its interval, the verdict, the capacities."""
        base = self.capacity(self.baseline)
        shown = self.comparison(self.chosen) if not self.kept else \
            max(self.comparisons, key=lambda c: c.low, default=None)
        if base is None:
            return "capacity at SLO, chosen / static-best: not measured (" + self.reason + ")"
        if shown is None:
            return (f"capacity at SLO: static-best {base.describe()}; no candidate compared: {self.verdict}")
        cap = self.capacity(shown.variant_id)
        who = "chosen" if not self.kept else f"best candidate ({shown.name})"
        return (f"capacity at SLO, {who} / static-best: {shown.line()}, {shown.verdict}"
                f"{', kept static-best' if self.kept else ''}; {cap.describe() if cap else '?'} vs {base.describe()}")


def short_name(name: str, width: int = 48) -> str:
    """A variant's name for a report line: whole up to ``width`` characters, else its head and its tail around
    "..." (arms named as a base plus a change differ at the end, so a cut head alone would name both alike)."""
    if len(name) <= width:
        return name
    head = (width - 3) // 3
    return name[:head] + "..." + name[len(name) - (width - 3 - head):]


def shared_rate(cand: Capacity, base: Capacity, highest: bool = False) -> str:
    """Where both arms were probed at one rate (the judge's lockstep rounds: the same requests and arrivals), the
    difference of their attainments there with its Newcombe 95% interval (for independent samples: on the same
    requests, conservative): the evidence a pair of censored capacities still carries. The lowest such rate (two
    arms censored below), or the highest (``highest``: censored above); "" when there is none."""
    def by_rate(cap: Capacity) -> dict[tuple[float, int], Probe]:
        return {(round(p.rate, 9), p.window): p for p in cap.probes if p.verdict != "void" and p.n}
    cp, bp = by_rate(cand), by_rate(base)
    common = sorted(set(cp) & set(bp))
    if not common:
        return ""
    at = common[-1] if highest else common[0]
    c, b = cp[at], bp[at]
    d, lo, hi = newcombe(c.good, c.n, b.good, b.n)
    word = "higher" if lo > 0 else "lower" if hi < 0 else "not detectably different"
    return (f"at {c.rate:.3f} req/s (both arms, the same window) the candidate attained {c.good}/{c.n} = "
            f"{c.attainment:.2f} against {b.good}/{b.n} = {b.attainment:.2f}: {d:+.3f} (Newcombe 95% {lo:+.3f} to "
            f"{hi:+.3f}), {word}")


def decide(base: Arm, cands: list[Arm], allow_trade: bool = False, alpha: float = 0.025) -> Judgement:
    """The rule: compare each candidate with the baseline, correct the one-sided tests of "ratio > MIN_GAIN"
    for their number (Holm, family-wise ``alpha``), and adopt the candidate with the highest lower bound among
    those that are better after the correction and pass every guard. The out-of-sample confirmation comes
    after (``confirm``) and may still refuse the choice."""
    comps = [compare(c, base, allow_trade) for c in cands]
    rejected = holm([c.p_value for c in comps], alpha)
    for c, r in zip(comps, rejected):
        if c.verdict == "better" and not r:
            c.verdict = "no detectable difference"
            c.reasons.append(f"not significant after Holm's correction over {len(comps)} candidates "
                             f"(p {c.p_value:.3f})")
        c.adopted = c.verdict == "better" and not c.reasons
    arms = {a.variant_id: {"name": a.name, "capacity": a.capacity.to_json(), "saturation": a.saturation,
                           "predicted": a.predicted} for a in [base] + cands}
    adopted = [c for c in comps if c.adopted]
    if adopted:
        best = max(adopted, key=lambda c: (c.low, c.ratio))
        reason = (f"{best.name} ({best.variant_id}): capacity {best.line()} static-best's, "
                  f"{Capacity.from_json(arms[best.variant_id]['capacity']).describe()} vs {base.capacity.describe()}")
        return Judgement(base.variant_id, best.variant_id, "better", reason, arms, comps)
    if not comps:
        return Judgement(base.variant_id, base.variant_id, "no detectable difference",
                         "no candidate was compared with static-best; kept static-best", arms, comps)
    top = max(comps, key=lambda c: (c.low, c.ratio))
    words = {c.verdict for c in comps}
    verdict = "censored" if words == {"censored"} else "worse" if words == {"worse"} else \
        "better" if "better" in words else "no detectable difference"
    why = "; ".join(f"{c.name}: {c.verdict}, {c.line()}" + (f" ({'; '.join(c.reasons)})" if c.reasons else "")
                    for c in comps)
    return Judgement(base.variant_id, base.variant_id, verdict, f"kept static-best: {why}", arms, comps,
                     notes=[f"closest: {top.name}"])


# ---- live verification -------------------------------------------------------------------------------------
@dataclass
class LiveCheck:
    """Attainment of the live traffic in a window before a swap and one after it."""

    before_good: int
    before_n: int
    after_good: int
    after_n: int
    diff: float
    low: float
    high: float
    worse: bool  # significantly worse: the interval of (after - before) lies below 0
    predicted_before: float = math.nan
    predicted_after: float = math.nan

    def to_json(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        b = self.before_good / self.before_n if self.before_n else 0.0
        a = self.after_good / self.after_n if self.after_n else 0.0
        lb, hb = wilson(self.before_good, self.before_n)
        la, ha = wilson(self.after_good, self.after_n)
        pred = "" if math.isnan(self.predicted_after) else \
            f" (predicted {self.predicted_after:.2f} vs {self.predicted_before:.2f})"
        return (f"live SLO attainment {a:.2f} ({la:.2f}-{ha:.2f}, n {self.after_n}) after vs {b:.2f} "
                f"({lb:.2f}-{hb:.2f}, n {self.before_n}) before{pred}: difference {self.diff:+.2f} "
                f"(95% {self.low:+.2f} to {self.high:+.2f})")


def verify_live(before: list[bool], after: list[bool], predicted_before: float = math.nan,
                predicted_after: float = math.nan) -> LiveCheck:
    """Compares the live windows; ``worse`` (roll back) when after is significantly below before."""
    bg, ag = sum(before), sum(after)
    d, lo, hi = newcombe(ag, len(after), bg, len(before))
    return LiveCheck(bg, len(before), ag, len(after), d, lo, hi, worse=hi < 0 and bool(before) and bool(after),
                     predicted_before=predicted_before, predicted_after=predicted_after)


def median_or_nan(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan
