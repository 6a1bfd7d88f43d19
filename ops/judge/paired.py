"""The judge's measurements: static-best and candidates replayed in lockstep on the same disjoint windows of the
traffic, the simulator's volume beside them, and the out-of-sample confirmation (the rules are ops/judge/rule.py's).

The traffic a search tunes on is split in two parts by arrival order: the **search part** (its first
``SearchConfig.requests`` requests are the slow tier's slice; the judge's windows follow them) and the
**held-out part** (its last third), which the search never replays: the confirmation and the live
verification after a swap draw their windows from there. A part too short for the windows asked of it is
replayed again from its start (its arrivals shifted), and the judgement says so.

Each rate probe takes the next window of the search part; every arm probes the same window at its own rate in
the same round (A B C, A B C, ...), so the arms see the same requests and arrivals and any drift of the machine
falls on all of them alike. Within one round the window is as long as the longest probe needs.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

from engine.config.sampling_params import SamplingParams
from engine.serving.trace_record import TraceRecord
from engine.config.variant import VariantSpec
from ops.measure import capacity
from ops.judge import rule as judge
from ops.measure.tiers import SLO, probe, saturation
from ops.traffic.traces import Windows


@dataclass(frozen=True)
class JudgeConfig:
    """How much the judge replays. The defaults suit a GPU; ``for_cpu`` the 2-core development machine."""

    first_look: int = 40  # counted requests at a probe's first look (then 2x, 4x, ... up to ``cap``)
    cap: int = 320  # most counted requests of one probe
    steady: float = 10.0  # a probe's counted requests span at least this many unloaded service times
    warmup: float = 2.0  # requests arriving within this many unloaded service times are not counted
    resolution: float = 1.10  # the bracket the search bisects to
    max_probes: int = 8  # per arm
    saturation_requests: int = 32  # the window replayed at once for the saturation throughput
    saturation_rounds: int = 3  # paired rounds of it (the guard needs every round lower to refuse)
    confirm_requests: int = 80  # counted requests of each arm in the held-out confirmation
    seconds: float = 600.0  # the whole judgement's budget (searches, confirmation); probes end at it
    confirm_share: float = 0.3  # of ``seconds`` kept for the held-out confirmation (the searches end before it)
    top: int = 2  # candidates compared with static-best (the simulator's best predicted)
    simulated_requests: int = 2000  # requests of the search part the simulator replays per variant
    allow_trade: bool = False  # latency at the traffic's own rate may be traded for capacity (named in the report)

    @classmethod
    def for_cpu(cls, **kw) -> "JudgeConfig":
        return cls(**{**dict(first_look=20, cap=60, steady=8.0, saturation_requests=16, confirm_requests=32,
                             seconds=140.0, confirm_share=0.3, top=1, simulated_requests=1000), **kw})

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class ArmRun:
    """One variant as the judge runs it: how to make its engine active, and what has been measured of it."""

    variant: VariantSpec
    predicted: float = 0.0  # simulator's capacity, req/s (0: none)
    saturation: float = 0.0
    samples: list = field(default_factory=list)  # step samples of every replay, for the simulator's calibration
    spans: dict = field(default_factory=dict)  # a search probe's window -> (first, end) of its steps in ``samples``
    rounds: list = field(default_factory=list)  # saturation throughput per paired round


def _service_time(slo: SLO, prompt: int, output: int) -> float:
    """An unloaded request's service time, from the SLO it was derived with (an upper bound: the SLO's targets
    are multiples of static-best's unloaded latency)."""
    from ops.measure.static_best_sweep import TPOT_FACTOR, TTFT_FACTOR

    return slo.ttft_limit(prompt) / TTFT_FACTOR + max(0, output - 1) * slo.tpot_s / TPOT_FACTOR


class PairedJudge:
    """Measures arms in lockstep with one engine that hot-swaps between them (``activate``), and decides.

    ``prompts_for(records, seed)``: token ids for a window's requests (real text where the model has a tokenizer).
    ``activate(variant)``: the engine with ``variant`` active (weights are not reloaded)."""

    def __init__(self, activate: Callable[[VariantSpec], object], prompts_for: Callable[[list, int], list],
                 windows: Windows, slo: SLO, max_output: int | None, cfg: JudgeConfig,
                 log: Callable[[str], None] = lambda m: None):
        self.activate, self.prompts_for, self.windows = activate, prompts_for, windows
        self.slo, self.max_output, self.cfg, self.log = slo, max_output, cfg, log
        self._prompts: dict = {}
        self.deadline = math.inf
        self._active: str | None = None

    def _engine(self, v: VariantSpec):
        eng = self.activate(v)
        if self._active != v.variant_id:  # a swapped-in form's first steps are not timed
            eng.generate([[100 + i for i in range(8)]], SamplingParams(max_tokens=2, ignore_eos=True))
            self._active = v.variant_id
        return eng

    def _window(self, part: str, n: int) -> tuple[int, list, list]:
        idx, recs = self.windows.take(part, n)
        key = (part, idx, n)
        if key not in self._prompts:
            self._prompts[key] = self.prompts_for(recs, idx)
        return idx, recs, self._prompts[key]

    def _plan(self, rate: float, typical: float) -> tuple[int, list[int]]:
        """(warm-up requests, looks) of a probe at ``rate``: the warm-up spans ``warmup`` service times, the
        first look ``steady`` of them (at least ``first_look`` requests), the last the cap."""
        c = self.cfg
        warm = max(2, math.ceil(rate * c.warmup * typical))
        first = min(c.cap, max(c.first_look, math.ceil(rate * c.steady * typical)))
        return warm, capacity.looks(first, c.cap)

    def typical_service(self, records: list[TraceRecord]) -> float:
        out = [r.output_tokens if self.max_output is None else min(r.output_tokens, self.max_output) for r in records]
        pr = sorted(r.input_tokens for r in records)[len(records) // 2]
        return _service_time(self.slo, pr, sorted(out)[len(out) // 2])

    def measure_saturation(self, arms: list[ArmRun]) -> int:
        """Every arm's saturation throughput: one window's requests at once, in ``saturation_rounds`` paired
        rounds (the arms' order alternated), the median kept and every round's figure for the guard."""
        idx, recs, prompts = self._window("search", self.cfg.saturation_requests)
        for k in range(max(1, self.cfg.saturation_rounds)):
            for a in (arms if k % 2 == 0 else arms[::-1]):
                sat, samples = saturation(self._engine(a.variant), recs, prompts, self.max_output, self.slo)
                a.rounds.append(sat)
                a.samples += samples
        for a in arms:
            a.saturation = statistics.median(a.rounds)
            self.log(f"judge: {a.variant.name}: saturation {a.saturation:.3f} req/s ({len(recs)} requests at once; "
                     "rounds " + ", ".join(f"{x:.2f}" for x in a.rounds) + ")")
        return idx

    def search(self, arms: list[ArmRun], sim_error: float = math.nan) -> dict[str, capacity.Capacity]:
        """Each arm's capacity: the judge's search (``capacity.Searcher``) for every arm, probed round by round on
        shared windows. An arm starts at its saturation throughput, or below it at the simulator's prediction
        with a first step of twice the simulator's error (given, or a prior of 20%; 15% to 100%) instead of
        doubling; never below the slowest rate whose first looks the budget affords (an arm failing there is
        censored below it)."""
        # an unloaded request's service time on this traffic: a probe's warm-up and first look are multiples of it
        self._typical = self.typical_service(self.windows.take("search", 0)[1] or self.windows.records[:32])
        searches: dict[str, capacity.Searcher] = {}
        self._floors: dict[str, float] = {}  # each arm's floor before the budget raised it
        # the slowest rate the budget affords: two first looks per arm (warm-up included) in the time left. A
        # probe below it would count nothing before the deadline, so the search starts and stops no lower, and
        # an arm failing there is censored below it instead of left unmeasured
        left = self.deadline - time.perf_counter()
        affordable = 2 * len(arms) * (self.cfg.first_look + 2) / left if left > 0 else math.inf
        for a in arms:
            sat = a.saturation or 1.0
            start, step = sat, 2.0
            if a.predicted > 0:  # start just below the prediction, bracket it by the simulator's typical error
                start = min(sat, 0.95 * a.predicted)
                # the simulator's error on this run's traffic is unknown until the replays measure it: a prior
                # of 20% (a step of 1.4x) brackets in a probe or two where the prediction is that far off
                err = sim_error if not math.isnan(sim_error) else 0.2
                step = min(2.0, max(1.15, 1 + 2 * err))
            floor = sat / (5 * max(1, a.variant.max_num_seqs))  # requests rarely overlap below this
            if affordable > sat:  # not even a probe at saturation fits: the arm stays unmeasured, and says why
                self.log(f"judge: {a.variant.name}: the {max(0.0, left):.0f} s left afford no first look "
                         f"({self.cfg.first_look} requests per arm, twice) at or below its saturation {sat:.3f} "
                         f"req/s")
            elif affordable > max(floor, start):
                self.log(f"judge: {a.variant.name}: the budget affords probes no slower than {affordable:.3f} "
                         f"req/s (start {start:.3f}, floor {floor:.3f} raised to it)")
            self._floors[a.variant.variant_id] = floor
            floor = min(max(floor, affordable), 4 * sat)
            start = max(start, floor)
            searches[a.variant.variant_id] = capacity.Searcher(start, step=step, floor=floor, ceiling=4 * sat,
                                                            resolution=self.cfg.resolution,
                                                            max_probes=self.cfg.max_probes)
        by_id = {a.variant.variant_id: a for a in arms}
        self._searches, self._by_id = searches, by_id
        while True:
            self._probe_rounds(searches, by_id)
            if not self._reopen(searches, by_id):
                break
        return {vid: s.capacity(by_id[vid].saturation) for vid, s in searches.items()}

    def resume(self) -> dict[str, capacity.Capacity] | None:
        """More rounds of the last ``search`` up to ``deadline`` (moved later): every arm's capacity again, or None
        when no arm has a rate left to probe."""
        searches = getattr(self, "_searches", {})
        if not any(s.rate is not None for s in searches.values()):
            return None
        self.log(f"judge: the searches go on for {max(0.0, self.deadline - time.perf_counter()):.0f} s more")
        self._probe_rounds(searches, self._by_id)
        return {vid: s.capacity(self._by_id[vid].saturation) for vid, s in searches.items()}

    def _reopen(self, searches: dict[str, capacity.Searcher], by_id: dict[str, ArmRun]) -> bool:
        """After the rounds ended: the arms censored below a floor the budget had raised get a lower floor where
        the time left affords one first look each (warm-up included, 10% to spare) at a rate at least 5% lower,
        so that a slow capacity is bracketed instead of bounded. True when any search goes on."""
        left = self.deadline - time.perf_counter()
        low = [vid for vid, s in searches.items() if s.censored_below() is not None]
        if left <= 0 or not low:
            return False
        affordable = 1.1 * len(low) * (self.cfg.first_look + 2) / left
        floors = {vid: max(self._floors.get(vid, 0.0), affordable) for vid in low}
        # the round's first looks at those floors, warm-ups included (``_plan``), must fit in the time left (a
        # search goes on at its floor or above, where a first look takes no longer)
        need = 0.0
        for f in floors.values():
            warm, plan = self._plan(f, self._typical)
            need += (warm + plan[0]) / f
        if 1.1 * need > left:
            return False
        reopened = [vid for vid in low if searches[vid].reopen(floors[vid])]
        for vid in reopened:
            self.log(f"judge: {by_id[vid].variant.name}: censored below {searches[vid].censored_below():.3f} req/s "
                     f"with {left:.0f} s left: probing down to {searches[vid].floor:.3f} req/s")
        return bool(reopened)

    def _probe_rounds(self, searches: dict[str, capacity.Searcher], by_id: dict[str, ArmRun]) -> None:
        """Probes every search's next rate, round by round on shared windows, until none is due or the time left
        cannot hold another round's first looks."""
        while time.perf_counter() < self.deadline:
            pending = {vid: s.rate for vid, s in searches.items() if s.rate is not None}
            if not pending:
                break
            plans = {vid: self._plan(rate, self._typical) for vid, rate in pending.items()}
            # a round whose first looks cannot all arrive before the deadline would count nothing: not started
            first_looks = sum((w + plan[0]) / rate for (w, plan), rate in zip(plans.values(), pending.values()))
            if time.perf_counter() + first_looks > self.deadline:
                self.log(f"judge: {self.deadline - time.perf_counter():.0f} s left, too little for another round "
                         f"of first looks ({first_looks:.0f} s at the rates due)")
                break
            need = max(w + plan[-1] for w, plan in plans.values())
            idx, recs, prompts = self._window("search", need)
            for k, (vid, rate) in enumerate(pending.items()):
                now = time.perf_counter()
                if now >= self.deadline:
                    break
                warm, plan = plans[vid]
                n = warm + plan[-1]
                # each arm of the round gets its share of the time left: one arm cannot spend another's
                share = now + (self.deadline - now) / (len(pending) - k)
                p, samples = probe(self._engine(by_id[vid].variant), recs[:n], prompts[:n], rate, self.slo, warm,
                                   plan, self.max_output, window=idx, deadline=share)
                p.arm = vid
                by_id[vid].spans[idx] = (len(by_id[vid].samples), len(by_id[vid].samples) + len(samples))
                by_id[vid].samples += samples
                if not p.n and p.verdict != "void":  # the deadline came before a request was counted
                    self.log(f"judge: {by_id[vid].variant.name}: probe at {rate:.3f} req/s ended by the budget "
                             "before a request was counted (not recorded)")
                    continue
                self.log(f"judge: {by_id[vid].variant.name}: probe {p.line()}, {p.seconds:.0f} s")
                searches[vid].record(p)

    def confirm(self, base: ArmRun, cand: ArmRun, caps: dict[str, capacity.Capacity]) -> judge.Confirmation:
        """The choice and static-best on windows of the held-out part (``judge.confirm``): at each rate a fresh
        window, replayed by both."""
        n = self.cfg.confirm_requests
        typical = self.typical_service(self.windows.take("held", 0)[1] or self.windows.records[-32:])
        arms = {"base": base, "cand": cand}
        current: dict = {}

        def replay(which: str, r: float) -> capacity.Probe:
            if current.get("rate") != r:  # a new rate: a new window, for both arms
                warm = max(2, math.ceil(r * self.cfg.warmup * typical))
                current.update(rate=r, warm=warm, window=self._window("held", warm + n))
            idx, recs, prompts = current["window"]
            a = arms[which]
            p, samples = probe(self._engine(a.variant), recs, prompts, r, self.slo, current["warm"], [n],
                               self.max_output, window=idx, deadline=self.deadline)
            a.samples += samples
            p.arm = a.variant.variant_id
            self.log(f"judge: held-out {a.variant.name}: {p.line()}")
            return p
        return judge.confirm(replay, caps[cand.variant.variant_id], caps[base.variant.variant_id])


def run_judgement(pj: PairedJudge, base: ArmRun, cands: list[ArmRun], latencies: dict[str, tuple[list, list]],
                  sim_error_prior: float = math.nan) -> tuple[judge.Judgement, dict[str, capacity.Capacity]]:
    """Saturation, the lockstep search, the decision (``judge.decide``) and, when it chose a candidate, the
    out-of-sample confirmation, which refuses a choice that does not hold. ``latencies``: variant id ->
    (TTFT, TPOT) per request of its replay at the traffic's own rate (the same requests for every arm)."""
    t0 = time.perf_counter()
    pj.deadline = t0 + pj.cfg.seconds * (1 - pj.cfg.confirm_share)
    arms = [base] + cands
    pj.measure_saturation(arms)
    caps = pj.search(arms, sim_error_prior)

    def arm(a: ArmRun) -> judge.Arm:
        ttft, tpot = latencies.get(a.variant.variant_id, ([], []))
        return judge.Arm(a.variant.variant_id, a.variant.name, caps[a.variant.variant_id], a.saturation, ttft, tpot,
                         a.predicted, list(a.rounds))
    j = judge.decide(arm(base), [arm(c) for c in cands], allow_trade=pj.cfg.allow_trade)
    if j.kept and cands and j.verdict in ("censored", "no detectable difference"):
        # nothing chosen, so no confirmation will spend its share: half of it carries the searches on
        pj.deadline = t0 + pj.cfg.seconds * (1 - pj.cfg.confirm_share / 2)
        more = pj.resume()
        if more is not None:
            caps = more
            j = judge.decide(arm(base), [arm(c) for c in cands], allow_trade=pj.cfg.allow_trade)
    predicted = [(a.predicted, caps[a.variant.variant_id]) for a in arms
                 if a.predicted > 0 and not caps[a.variant.variant_id].censored
                 and caps[a.variant.variant_id].status != "unmeasured"]
    errs = [abs(p - c.estimate) / c.estimate for p, c in predicted if c.estimate > 0]
    j.simulator_error = max(errs) if errs else math.nan
    inside = [c.low <= p <= c.high for p, c in predicted]
    if inside:  # where the measurement itself is wide (a small host), the fairer test of the simulator
        j.notes.append(f"the simulator's capacity falls inside the measured 95% interval for {sum(inside)} of "
                       f"{len(inside)} arms")
    if not j.kept:
        chosen = next(c for c in cands if c.variant.variant_id == j.chosen)
        pj.deadline = max(t0 + pj.cfg.seconds, time.perf_counter() + 10)  # the confirmation's share of the budget
        conf = pj.confirm(base, chosen, caps)
        j.confirmation = conf
        if not conf.holds:
            j.notes.append(f"{chosen.variant.name} did not hold on held-out traffic")
            j.reason = f"kept static-best: {chosen.variant.name} was better on the search's windows " \
                       f"({j.comparison(j.chosen).line()}) but did not hold on traffic the search did not see"
            j.chosen = j.baseline
            j.verdict = "no detectable difference"
    if pj.windows.wrapped:
        j.notes.append("the trace was too short for disjoint windows: its "
                       + " and ".join(sorted(pj.windows.wrapped)) + " part was replayed again (arrivals shifted)")
    j.seconds = time.perf_counter() - t0
    return j, caps


def live_windows(trace: str, model: str, skip: int, n: int, max_input: int | None, lenient: bool = False,
                 seed: int = 7, rounds: int = 1) -> list[tuple[tuple[list, list], tuple[list, list]]]:
    """``rounds`` pairs of disjoint windows of ``n`` requests from the end of the trace's held-out part (the
    confirmation takes its start), with their prompts (real text where the model has a tokenizer): the live traffic
    a deployment is verified on before and after its swap, a pair per round (ops/deploy.LiveWindows)."""
    from engine import resolve
    from engine.loader.model_source import load_config
    from engine.loader.tokenizer import Tokenizer
    from ops.traffic.corpus import corpus_for
    from ops.traffic.replay import synthesize_prompts
    from ops.traffic.traces import load_trace

    records = load_trace(trace, lenient=lenient)
    w = Windows(records, skip=skip)
    lo, hi = w.bounds("held")
    w.cursor["held"] = max(lo, hi - 2 * n * rounds)
    source = resolve(model)
    tok = Tokenizer(source.tokenizer_path) if source.tokenizer_path and source.kind != "synthetic" else None
    vocab = load_config(source).vocab_size
    out = []
    for k in range(2 * rounds):
        idx, recs = w.take("held", n)
        out.append((recs, synthesize_prompts(recs, vocab, max_input=max_input, tokenizer=tok, seed=seed + idx,
                                             corpus=corpus_for(trace) if tok else None)))
    return [(out[2 * k], out[2 * k + 1]) for k in range(rounds)]
