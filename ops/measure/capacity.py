"""Capacity at the SLO, measured as a statistical quantity (the rules the judge, ops/judge/rule.py, decides on).

Capacity is the highest request rate at which at least 90% of requests meet their TTFT and TPOT targets.

- **A rate probe** replays a window of the traffic at a rate (its arrival pattern scaled), leaves out its
  warm-up requests, and decides pass or fail only when the Wilson 95% interval of its attainment excludes
  the target (``sequential_stop``: looked at after 1, 2, 4, ... times the first look's requests, extended with
  the next requests of the traffic up to a cap; "undecided" if it never excludes it; "void" when the load
  generator lagged behind the schedule, which says nothing about the engine).
- **The search** (``search_capacity``) starts from the measured saturation throughput (or a prediction
  below it), doubles or halves until a fitted pass and a fitted fail bracket the capacity, and bisects to a
  bracket of 10%; an end of the bracket that no probe decided gets a probe beyond it; a baseline that fails
  even where requests run alone is reported as "capacity below X".
- **The capacity** (``capacity_of``) is where one monotone (non-increasing) attainment curve, fitted over
  every probe, crosses the target; its 95% interval comes from a block bootstrap over each probe's requests,
  each replicate placing the crossing anywhere inside its bracket (a capacity is only known to lie between
  the probes around it).

Nothing here touches an engine: measurements come in through callables, so every rule is tested on synthetic
attainment curves. References: vLLM's ``bench serve`` and its SLA search, DistServe (goodput at 90%
attainment).
"""
from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field
from typing import Callable

Z95 = 1.959963984540054  # the two-sided 95% normal quantile
TARGET = 0.9  # share of requests that must meet the SLO


# ---- intervals -----------------------------------------------------------------------------------------
def wilson(good: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``good`` / ``n``; (0, 1) when ``n`` is 0."""
    if n <= 0:
        return 0.0, 1.0
    p = good / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


def newcombe(good1: int, n1: int, good2: int, n2: int, z: float = Z95) -> tuple[float, float, float]:
    """(p1 - p2, low, high): the difference of two independent proportions with Newcombe's hybrid score
    interval (his method 10), built from each one's Wilson interval."""
    p1, p2 = (good1 / n1 if n1 else 0.0), (good2 / n2 if n2 else 0.0)
    l1, u1 = wilson(good1, n1, z)
    l2, u2 = wilson(good2, n2, z)
    d = p1 - p2
    return d, d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)


def outcome(good: int, n: int, target: float = TARGET) -> str:
    """"pass" when the Wilson interval lies at or above ``target``, "fail" when below it, else "undecided"."""
    lo, hi = wilson(good, n)
    if n and lo >= target:
        return "pass"
    if n and hi < target:
        return "fail"
    return "undecided"


def looks(first: int, cap: int) -> list[int]:
    """The request counts a sequential probe is judged at: ``first``, doubling, up to ``cap`` (always last)."""
    first, cap = max(1, first), max(1, cap)
    out, n = [], first
    while n < cap:
        out.append(n)
        n *= 2
    return out + [cap]


def sequential_stop(status: list[bool | None], plan: list[int], target: float = TARGET) -> tuple[int, str] | None:
    """Whether a probe can stop, from its counted requests' status in arrival order (True: met the SLO,
    False: missed it, None: not known yet). At each look ``n`` of ``plan`` whose first ``n`` requests are all
    known, the probe stops when their Wilson interval excludes ``target`` (or at the last look). Before a look
    it stops as failed when the misses so far would fail that look even if every other request passed
    (futility). Returns (the look's request count, "pass" | "fail" | "undecided") or None to go on."""
    known = 0
    while known < len(status) and status[known] is not None:
        known += 1
    for n in plan:
        if known >= n:
            verdict = outcome(sum(1 for s in status[:n] if s), n, target)
            if verdict != "undecided" or n == plan[-1]:
                return n, verdict
            continue
        # the next look not yet reached: stop now if it is failed whatever the rest do
        misses = sum(1 for s in status[:n] if s is False)
        if misses and wilson(n - misses, n)[1] < target:
            return n, "fail"
        return None
    return None


# ---- probes and capacities -------------------------------------------------------------------------------
@dataclass
class Probe:
    """One rate probe: ``outcomes`` holds each counted request's result (1 met the SLO) in arrival order."""

    rate: float  # offered, req/s
    achieved: float = 0.0  # requests completed per second of the probe
    outcomes: list[int] = field(default_factory=list)
    warmup: int = 0  # requests replayed first and not counted
    window: int = 0  # index in the traffic of the probe's first request
    lag_s: float = 0.0  # the load generator's worst send lag behind the schedule
    verdict: str = "undecided"  # "pass" | "fail" | "undecided" | "void"
    seconds: float = 0.0
    arm: str = ""  # which variant was replayed (a comparison's probes carry it)
    replayed: int = 0  # requests of the window given to the replay (warm-up, then up to the cap)

    @property
    def n(self) -> int:
        return len(self.outcomes)

    @property
    def good(self) -> int:
        return sum(self.outcomes)

    @property
    def attainment(self) -> float:
        return self.good / self.n if self.n else 0.0

    @property
    def interval(self) -> tuple[float, float]:
        return wilson(self.good, self.n)

    def to_json(self) -> dict:
        lo, hi = self.interval
        return asdict(self) | {"n": self.n, "good": self.good, "attainment": self.attainment, "low": lo, "high": hi}

    @classmethod
    def from_json(cls, d: dict) -> "Probe":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def line(self) -> str:
        lo, hi = self.interval
        return (f"{self.rate:.3f} req/s offered, {self.achieved:.3f} achieved: {self.good}/{self.n} = "
                f"{self.attainment:.2f} ({lo:.2f}-{hi:.2f}) {self.verdict}"
                + (f" (client lag {1e3 * self.lag_s:.0f} ms)" if self.verdict == "void" else ""))


def _pav(points: list[tuple[float, float, float]]) -> list[tuple[float, float]]:
    """Pool-adjacent-violators: the weighted least-squares non-increasing fit of (rate, value, weight) points;
    returns (rate, fitted value) sorted by rate."""
    blocks: list[list[float]] = []  # [value, weight, count]
    pts = sorted(points)
    for _, v, w in pts:
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:  # an increase: pool the two
            v2, w2, c2 = blocks.pop()
            v1, w1, c1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2) if w1 + w2 else (v1 + v2) / 2, w1 + w2, c1 + c2])
    fitted = [b[0] for b in blocks for _ in range(int(b[2]))]
    return [(r, f) for (r, _, _), f in zip(pts, fitted)]


def fit(probes: list[Probe]) -> list[tuple[float, float]]:
    """The monotone attainment-vs-rate curve over every counted probe (void ones left out): several probes at
    one rate pool their requests; returns (rate, fitted attainment) by rising rate."""
    by_rate: dict[float, list[int]] = {}
    for p in probes:
        if p.verdict != "void" and p.n:
            by_rate.setdefault(p.rate, []).extend(p.outcomes)
    return _pav([(r, sum(o) / len(o), len(o)) for r, o in by_rate.items()])


def bracket(curve: list[tuple[float, float]], target: float = TARGET) -> tuple[float, float]:
    """(the highest rate fitted at or above ``target``, the lowest fitted below it): 0 when every rate is
    below, inf when none is."""
    passing = [r for r, a in curve if a >= target]
    failing = [r for r, a in curve if a < target]
    return (max(passing) if passing else 0.0), (min(failing) if failing else math.inf)


def crossing(curve: list[tuple[float, float]], target: float = TARGET) -> float:
    """Where the fitted curve crosses ``target``, interpolated in log rate between the two probes around it;
    at a censored end, the probed rate that bounds it (the lowest rate when all fail, the highest when none)."""
    lo, hi = bracket(curve, target)
    if not curve:
        return 0.0
    if lo == 0.0:
        return curve[0][0]
    if hi == math.inf:
        return curve[-1][0]
    a_lo = next(a for r, a in curve if r == lo)
    a_hi = next(a for r, a in curve if r == hi)
    f = (a_lo - target) / (a_lo - a_hi) if a_lo > a_hi else 0.5
    return math.exp(math.log(lo) + f * (math.log(hi) - math.log(lo)))


@dataclass
class Capacity:
    """A capacity at the SLO with its 95% interval, and every probe behind it."""

    estimate: float  # req/s where the fitted curve crosses the target (a bound when censored)
    low: float
    high: float  # math.inf when nothing failed
    censored: str = ""  # "" | "below" (failed at every rate probed) | "above" (passed at every rate)
    status: str = "converged"  # "converged" | "undecided" (budget or probes ran out before a 10% bracket)
    #                            | "unmeasured" (no request counted: no estimate, no bound)
    probes: list[Probe] = field(default_factory=list)
    saturation: float = 0.0  # req/s completed with every request of a window at once

    @property
    def requests(self) -> int:
        return sum(p.n for p in self.probes)

    def describe(self) -> str:
        if self.status == "unmeasured":
            return "not measured (the budget ended before a request of it was counted)"
        if self.censored == "below":
            lowest = min((p for p in self.probes if p.verdict != "void" and p.n), key=lambda p: p.rate, default=None)
            at = f" (attained {lowest.attainment:.2f}, {lowest.interval[0]:.2f}-{lowest.interval[1]:.2f}, " \
                 f"n {lowest.n})" if lowest else ""
            return f"below {self.estimate:.3f} req/s{at}"
        if self.censored == "above":
            return f"above {self.estimate:.3f} req/s (nothing probed failed)"
        hi = "inf" if self.high == math.inf else f"{self.high:.3f}"
        return f"{self.estimate:.3f} req/s (95% {self.low:.3f}-{hi})" + \
            (" undecided: the budget or the probe limit ended the search before a 10% bracket" if self.status == "undecided" else "")

    def to_json(self) -> dict:
        d = asdict(self)
        d["probes"] = [p.to_json() for p in self.probes]
        d["high"] = None if self.high == math.inf else self.high
        d["requests"] = self.requests
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Capacity":
        return cls(estimate=d["estimate"], low=d["low"], high=math.inf if d.get("high") is None else d["high"],
                   censored=d.get("censored", ""), status=d.get("status", "converged"),
                   probes=[Probe.from_json(p) for p in d.get("probes", [])], saturation=d.get("saturation", 0.0))


def _blocks(outcomes: list[int]) -> list[list[int]]:
    """Consecutive requests in blocks of about n^(1/3) (at least 2): the unit the bootstrap redraws, so that
    the correlation of neighbours in one queue stays inside a block."""
    n = len(outcomes)
    b = max(2, round(n ** (1 / 3)))
    return [outcomes[i:i + b] for i in range(0, n, b)]


def _resample(probes: list[Probe], rng: random.Random) -> list[Probe]:
    out = []
    for p in probes:
        if p.verdict == "void" or not p.n:
            continue
        blocks = _blocks(p.outcomes)
        drawn: list[int] = []
        while len(drawn) < p.n:
            drawn.extend(blocks[rng.randrange(len(blocks))])
        out.append(Probe(rate=p.rate, outcomes=drawn[:p.n]))
    return out


def _replicate_range(probes: list[Probe], rng: random.Random, target: float,
                     top: float = math.inf) -> tuple[float, float]:
    """One bootstrap replicate of a capacity as the range it can lie in: where the redrawn curve (its requests
    redrawn in blocks) crosses the target, a point drawn anywhere inside its bracket (log-uniform); (0, lowest
    rate] where every redrawn rate failed; [highest rate, ``top``] where every one passed (``top``: the arm's
    ``ceiling``). A probe that decided nothing (its interval holds the target) is redrawn to either side, so its
    arm's bound is not taken for a measurement."""
    curve = fit(_resample(probes, rng))
    lo, hi = bracket(curve, target)
    if not curve:
        return 0.0, top
    if lo == 0.0:
        return 0.0, curve[0][0]
    if hi == math.inf:
        return curve[-1][0], max(top, curve[-1][0])
    x = math.exp(rng.uniform(math.log(lo), math.log(hi)))
    return x, x


def ceiling(probes: list[Probe], saturation: float) -> float:
    """The most a capacity can be: the saturation throughput (arrivals faster than the engine completes requests
    with a whole window at once build an unbounded queue, so no steady rate above it meets the SLO), or the
    highest rate probed where that is higher; inf where no saturation was measured. A bootstrap replicate in which
    every redrawn probe passed is bounded there, not at infinity."""
    top = max((p.rate for p in probes if p.verdict != "void" and p.n), default=0.0)
    return max(saturation, top) if saturation > 0 else math.inf


def capacity_of(probes: list[Probe], target: float = TARGET, replicates: int = 1000, seed: int = 0,
                status: str = "converged", saturation: float = 0.0) -> Capacity:
    """The capacity the probes show: the crossing of their monotone fit, its 95% interval from the block
    bootstrap of the range each replicate leaves open (``_replicate_range``, the replicates the judge's ratio
    takes too: an end probe that decided nothing opens the interval on its side, to 0 below, to ``ceiling``
    above). Censored below (every rate failed) its estimate is the lowest rate probed, an upper bound; censored
    above, the highest, a lower bound."""
    curve = fit(probes)
    est = crossing(curve, target)
    lo, hi = bracket(curve, target)
    censored = "below" if curve and lo == 0.0 else "above" if curve and hi == math.inf else ""
    if not curve:  # no counted request: nothing is known, not even a bound
        return Capacity(0.0, 0.0, math.inf, "", "unmeasured", list(probes), saturation)
    rng = random.Random(seed)
    top = ceiling(probes, saturation)
    ranges = [_replicate_range(probes, rng, target, top) for _ in range(replicates)]
    low = _quantile(sorted(r_lo for r_lo, _ in ranges), 0.025)
    high = _quantile(sorted(r_hi for _, r_hi in ranges), 0.975)
    if censored == "below":
        low = 0.0
    if censored == "above":
        high = math.inf
    return Capacity(est, min(low, est), max(high, est), censored, status, list(probes), saturation)


def _quantile(xs: list[float], q: float) -> float:
    if not xs:
        return math.nan
    i = min(len(xs) - 1, max(0, int(math.floor(q * (len(xs) - 1) + 0.5))))
    return xs[i]


class Searcher:
    """The capacity search as a state machine, so that several arms can be probed in lockstep: ``rate`` is the
    next rate to probe (None when done), ``record(probe)`` takes its result.

    From ``start`` (the measured saturation throughput, or a prediction below it) the rate is multiplied or
    divided by ``step`` until the fitted curve has a pass and a fail, then bisected (geometrically) until their
    ratio is at most ``resolution`` (then ``_settle`` probes beyond an undecided end). ``floor``: the rate below
    which requests no longer overlap (no lower rate can do better): failing there, the capacity is censored below
    it. ``ceiling``: the rate at which the window arrives at once: passing there, censored above. A void probe (the
    load generator lagged) is repeated once; ``max_probes`` spent ends the search "undecided" unless it has
    converged."""

    def __init__(self, start: float, *, target: float = TARGET, resolution: float = 1.10, step: float = 2.0,
                 max_probes: int = 8, floor: float = 0.0, ceiling: float = math.inf):
        self.target, self.resolution, self.step, self.max_probes = target, resolution, step, max_probes
        self.floor, self.ceiling = floor, ceiling
        self.probes: list[Probe] = []
        self.status = "undecided"
        self.rate: float | None = min(max(start, floor, 1e-6), ceiling)
        self._voids = 0

    def record(self, p: Probe) -> None:
        self.probes.append(p)
        self.rate = self._next(p)
        if self.rate is not None and len(self.probes) >= self.max_probes:
            self.rate = None

    def _next(self, p: Probe) -> float | None:
        if p.verdict == "void":
            self._voids += 1
            return p.rate if self._voids < 2 else None
        self._voids = 0
        counted = [q for q in self.probes if q.verdict != "void"]
        lo, hi = bracket(fit(counted), self.target)
        if lo > 0 and hi < math.inf:
            if hi / lo <= self.resolution * (1 + 1e-9):
                self.status = "converged"
                return self._settle(counted, lo, hi)
            rate = math.sqrt(lo * hi)
        elif lo == 0.0:  # every rate so far failed: lower, down to where requests run alone
            lowest = min(q.rate for q in counted)
            if lowest <= self.floor * (1 + 1e-9):
                self.status = "converged"  # fails even unloaded: censored below, found
                return None
            rate = max(lowest / self.step, self.floor)
            self.step = min(2.0, self.step ** 1.5)  # a start far off: widen the steps
        else:  # every rate so far passed: higher, up to where the window arrives at once
            highest = max(q.rate for q in counted)
            if highest >= self.ceiling * (1 - 1e-9):
                self.status = "converged"
                return None
            rate = min(highest * self.step, self.ceiling)
            self.step = min(2.0, self.step ** 1.5)
        if any(abs(q.rate - rate) <= 1e-9 * rate for q in counted):
            return None  # nothing new to probe
        return rate

    def _settle(self, counted: list[Probe], lo: float, hi: float) -> float | None:
        """Once bracketed: a probe beyond an end of the bracket that no probe decided (no pass at or below ``lo``,
        no fail at or above ``hi``), a step of ``resolution`` squared past the farthest probe on that side, so
        that the capacity's interval gets a bound there instead of one drawn to either side; None when both ends
        are decided or the floor or ceiling stops it."""
        tol = 1 + 1e-9
        if not any(q.verdict == "pass" and q.rate <= lo * tol for q in counted):
            rate = max(min(q.rate for q in counted) / self.resolution ** 2, self.floor)
            if rate * tol < min(q.rate for q in counted):
                return rate
        if not any(q.verdict == "fail" and q.rate * tol >= hi for q in counted):
            rate = min(max(q.rate for q in counted) * self.resolution ** 2, self.ceiling)
            if rate > max(q.rate for q in counted) * tol:
                return rate
        return None

    def censored_below(self) -> float | None:
        """The lowest rate probed when every counted probe failed (the capacity censored below it), else None."""
        counted = [q for q in self.probes if q.verdict != "void" and q.n]
        if not counted:
            return None
        lo, _ = bracket(fit(counted), self.target)  # no fitted rate at or above the target
        return min(q.rate for q in counted) if lo == 0.0 else None

    def reopen(self, floor: float) -> bool:
        """Lowers the floor to ``floor`` when the search ended censored below a floor above it (a floor the budget
        had raised, which the time left now affords lower): the search goes on below. True when it did."""
        lowest = self.censored_below()
        if self.rate is not None or lowest is None or floor >= min(lowest, self.floor) / 1.05 \
                or len(self.probes) >= self.max_probes:
            return False
        self.floor = floor
        self.status = "undecided"
        self.rate = max(lowest / self.step, floor)
        return True

    def capacity(self, saturation: float = 0.0, seed: int = 0) -> "Capacity":
        return capacity_of(self.probes, self.target, status=self.status, saturation=saturation, seed=seed)


def search_capacity(probe_at: Callable[[float], Probe], start: float, *, target: float = TARGET,
                    resolution: float = 1.10, step: float = 2.0, max_probes: int = 8, floor: float = 0.0,
                    ceiling: float = math.inf, deadline: Callable[[], bool] | None = None,
                    saturation: float = 0.0, seed: int = 0) -> Capacity:
    """One arm's search (``Searcher``) run to its end, or until ``deadline()`` is true ("undecided")."""
    s = Searcher(start, target=target, resolution=resolution, step=step, max_probes=max_probes, floor=floor,
                 ceiling=ceiling)
    while s.rate is not None and not (deadline and deadline()):
        s.record(probe_at(s.rate))
    return s.capacity(saturation, seed)


def search_crossing(probes: list[list[float]], target: float = TARGET) -> float:
    """``capacity_search``'s capacity interpolated: ``crossing`` between its highest passing rate and the lowest
    failing one above it ([rate, attainment] pairs), the estimate the judge's fitted curve gives a measurement,
    where the highest passing rate alone is biased low by up to the bracket. That rate when nothing failed above
    it (a bound), 0 when nothing passed."""
    passed = [(r, a) for r, a in probes if a >= target]
    if not passed:
        return 0.0
    rp, ap = max(passed)
    failed = [(r, a) for r, a in probes if a < target and r > rp]
    return crossing([(rp, ap), min(failed)], target) if failed else rp


def capacity_search(attain, guess: float, target: float = 0.9, resolution: float = 1.25,
                    max_probes: int = 6, min_rate: float = 0.0,
                    max_rate: float = float("inf")) -> tuple[float, float, list[list[float]]]:
    """For a deterministic attainment (the simulator; static-best's offline sweep of forms, where one
    replay per rate is the measure): the highest rate whose attainment (``attain(rate)``) reaches ``target``: from ``guess`` it doubles or
    halves until a passing and a failing rate bracket it, then bisects (geometrically) until the bracket is
    within ``resolution``. Returns (capacity, the bracket's width, [rate, attainment] per probe); capacity 0
    when even the lowest rate probed fails. Below ``min_rate`` (where requests no longer overlap, so a lower
    rate cannot help and only makes the replay longer) it does not probe; above ``max_rate`` (where the whole
    slice arrives at once, so a higher rate replays the same) it probes ``max_rate`` once, and if that passes
    the capacity is a lower bound set by the slice's size (spread infinite), not a measure of the engine."""
    passed, failed, probes = 0.0, float("inf"), []
    rate = min(max(guess, min_rate, 1e-3), max_rate)
    for _ in range(max_probes):
        if probes and (rate < min_rate or rate <= passed):
            break
        a = attain(rate)
        probes.append([rate, a])
        if a >= target:
            passed = max(passed, rate)
        else:
            failed = min(failed, rate)
        if failed < float("inf") and passed > 0 and failed / passed <= resolution:
            break
        if failed == float("inf"):
            rate = min(passed * 2, max_rate)
        elif passed == 0:
            rate = failed / 2
        else:
            rate = (passed * failed) ** 0.5
    # without a failing rate the capacity is a lower bound (its spread infinite); without a passing one, 0 up
    # to the lowest rate tried
    width = failed - passed if passed > 0 else failed
    return passed, width, probes
