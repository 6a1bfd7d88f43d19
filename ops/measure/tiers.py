"""Measuring variants: the slow tier (a trace slice replayed through the engine) and the fast tier
(step times of the shape mix a traffic profile implies, on a few layers).

Both return BenchResult. A measurement is a median over repeats with its
spread (max - min); a difference smaller than the spread is no difference.
"""
from __future__ import annotations

import platform
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from engine.core.llm_engine import LLMEngine
from engine.config.sampling_params import SamplingParams
from engine.serving.trace_record import TraceRecord
from ops.measure.capacity import capacity_search
from ops.traffic.traces import percentile


@dataclass
class BenchResult:
    variant_id: str
    tier: str  # "fast" | "slow"
    layers: int
    trace_id: str  # the trace slice or shape mix measured
    output_tok_s: float
    total_tok_s: float
    ttft_p50: float = 0.0
    ttft_p90: float = 0.0
    ttft_p99: float = 0.0
    tpot_p50: float = 0.0
    tpot_p90: float = 0.0
    tpot_p99: float = 0.0
    e2e_p50: float = 0.0
    e2e_p90: float = 0.0
    e2e_p99: float = 0.0
    goodput: float = 0.0  # requests/s meeting the SLO
    repeats: int = 1
    spread: float = 0.0  # max - min of output_tok_s over repeats
    hardware: str = ""
    wall_s: float = 0.0
    step_times_ms: dict[str, float] = field(default_factory=dict)  # fast tier: shape -> median step time
    goodput_spread: float = 0.0  # max - min of goodput over repeats
    # capacity at SLO: the highest request rate (req/s) at which >= 90% of requests meet both targets, the
    # slice's recorded arrival pattern replayed at scaled rates; its spread is the width of the final bracket
    capacity: float = 0.0
    capacity_spread: float = 0.0
    attainment: float = 0.0  # share of requests meeting both targets at the slice's own (configured) rate
    slo_ttft_s: float = 0.0
    slo_tpot_s: float = 0.0
    rate_probes: list[list[float]] = field(default_factory=list)  # [rate req/s, attainment] per replay
    # slow tier: every engine step of the median run as [new tokens, KV tokens, sequences, attended pairs, seconds]
    step_samples: list[list[float]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    # prompt-lookup speculation over the timed replays: accepted / drafted tokens, and tokens emitted per
    # verified draft (vLLM's mean acceptance length); 0 when the variant did not speculate
    spec_acceptance: float = 0.0
    spec_accepted_length: float = 0.0
    # served layouts (``served_tier``): seconds from starting the variant's processes to serving it, what a
    # restart-scope swap to its parallel layout costs; 0 for the in-process replay
    start_s: float = 0.0
    # per request of the median replay at the slice's own rate, in record order (None: unfinished, or one token):
    # what the judge compares paired, request by request, with static-best's replay of the same requests
    ttfts: list = field(default_factory=list)
    tpots: list = field(default_factory=list)
    saturation: float = 0.0  # req/s completed with every request of the slice at once (0: not measured)
    saturation_samples: list[list[float]] = field(default_factory=list)  # its steps, as step_samples
    slo_ttft_per_token_s: float = 0.0
    capacity_predicted: float = 0.0  # the simulator's capacity (req/s), calibrated on this variant's own steps

    def to_json(self) -> dict:
        return asdict(self)


def hardware_label(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()} cpu x{torch.get_num_threads()}"


@dataclass(frozen=True)
class SLO:
    """Per-request latency targets. The TTFT target grows with the prompt (``ttft_per_token_s`` per prompt
    token beyond ``ttft_s``: a long prompt's prefill takes longer even alone); TPOT is judged only for outputs
    of ``tpot_min_tokens`` or more (a few tokens' average says little about decoding)."""

    ttft_s: float = 2.0
    tpot_s: float = 0.2
    ttft_per_token_s: float = 0.0
    tpot_min_tokens: int = 8

    def ttft_limit(self, prompt_tokens: int) -> float:
        return self.ttft_s + self.ttft_per_token_s * prompt_tokens

    def judges_tpot(self, output_tokens: int) -> bool:
        return output_tokens >= max(2, self.tpot_min_tokens)

    def met(self, ttft: float, tpot: float | None, prompt_tokens: int, output_tokens: int) -> bool:
        return ttft <= self.ttft_limit(prompt_tokens) and (
            tpot is None or not self.judges_tpot(output_tokens) or tpot <= self.tpot_s)

    def describe(self) -> str:
        grow = f" + {1e3 * self.ttft_per_token_s:.2f} ms per prompt token" if self.ttft_per_token_s else ""
        return (f"TTFT <= {1e3 * self.ttft_s:.0f} ms{grow} and TPOT <= {1e3 * self.tpot_s:.0f} ms (outputs of "
                f"{max(2, self.tpot_min_tokens)}+ tokens) for 90% of requests")


def _replay(engine: LLMEngine, records: list[TraceRecord], prompts: list[list[int]], max_output: int | None,
            time_scale: float, slo: SLO, stop=None, counted_from: int = 0, deadline: float | None = None) -> dict:
    """Adds each request when its (scaled) arrival time has passed, steps the engine, times every request
    from its scheduled arrival (a request that arrives during a step waits for it, as on a server).

    Time runs on the replay's own clock: wall time, plus every gap in which the engine had nothing to do
    before the next arrival, skipped instead of slept. An idle engine's state does not change with time, so
    every latency is what a real-time replay would measure, and a replay at a low rate takes its busy time,
    not its arrival span.

    ``stop(status)``, called after every step with the status of the requests from ``counted_from`` on in
    arrival order (True: met the SLO, False: missed it, None: not known yet), ends the replay early when it
    returns true (what runs is aborted); so does ``deadline`` (time.perf_counter()). Returns per request, in
    record order, its TTFT, TPOT (None when unfinished or one token), end-to-end time, output tokens, send lag
    and status, and the run's totals and step samples."""
    n = len(records)
    t0 = records[0].arrival_s
    skipped = 0.0

    def clock() -> float:
        return time.perf_counter() + skipped
    start = clock()
    due = [start + (r.arrival_s - t0) * time_scale for r in records]
    outs_n = [max(1, r.output_tokens if max_output is None else min(r.output_tokens, max_output)) for r in records]
    rid_of: dict[str, int] = {}
    first: list[float | None] = [None] * n
    end: list[float | None] = [None] * n
    got: list[int] = [0] * n
    lag: list[float] = [0.0] * n
    status: list[bool | None] = [None] * n
    run: dict[str, int] = {}
    samples: list[list[float]] = []
    nxt = 0
    stopped = False
    last: float | None = None  # the previous step's end while the engine stays busy

    def resolve(i: int, now: float) -> None:
        if status[i] is not None:
            return
        limit = due[i] + slo.ttft_limit(len(prompts[i]))
        if first[i] is None:
            if now > limit:
                status[i] = False
            return
        if first[i] > limit:
            status[i] = False
        elif end[i] is not None:
            tpot = (end[i] - first[i]) / (got[i] - 1) if got[i] > 1 else None
            status[i] = slo.met(first[i] - due[i], tpot, len(prompts[i]), got[i])
        elif slo.judges_tpot(outs_n[i]) and now - first[i] > slo.tpot_s * (outs_n[i] - 1):
            status[i] = False  # cannot finish within its TPOT target any more
    while nxt < n or engine.has_unfinished():
        now = clock()
        while nxt < n and due[nxt] <= now:
            rid = engine.add_request(prompts[nxt], SamplingParams(max_tokens=outs_n[nxt], ignore_eos=True))
            rid_of[rid] = nxt
            lag[nxt] = clock() - due[nxt]
            nxt += 1
        if not engine.has_unfinished():
            skipped += max(0.0, due[nxt] - now)
            last = None
            continue
        ts = clock()
        outs = engine.step()
        te = clock()
        # a busy engine's step takes from the previous step's end: the loop's own work between steps (adding
        # arrivals, judging requests) is part of what a request waits for, and so of what the simulator calibrates
        shape = [0, 0, len(outs), 0, te - (ts if last is None else last)]
        last = te
        for o in outs:
            before = run.get(o.request_id, o.num_cached_tokens)
            now_run = o.num_cached_tokens + o.num_tokens_run
            k = max(0, now_run - before)
            run[o.request_id] = now_run
            shape[0] += k
            shape[1] += now_run
            shape[3] += k * (before + (k + 1) // 2)
        if shape[0]:
            samples.append(shape)
        for o in outs:
            i = rid_of.get(o.request_id)
            if i is None:
                continue
            if o.token_ids and first[i] is None:
                first[i] = te
            got[i] = len(o.token_ids)
            if o.finished:
                end[i] = te
        for i in range(counted_from, nxt):
            resolve(i, te)
        if (stop is not None and stop(status[counted_from:])) or \
                (deadline is not None and time.perf_counter() > deadline):
            stopped = True
            for rid in rid_of:
                engine.abort(rid)
            while engine.has_unfinished():  # a step launched ahead is collected and dropped
                engine.step()
            break
    wall = clock() - start
    ttft = [first[i] - due[i] if first[i] is not None else None for i in range(n)]
    tpot = [(end[i] - first[i]) / (got[i] - 1) if end[i] is not None and got[i] > 1 else None for i in range(n)]
    e2e = [end[i] - due[i] if end[i] is not None else None for i in range(n)]
    done = [i for i in range(n) if end[i] is not None]
    return {"wall": wall, "out": sum(got[i] for i in done), "in": sum(len(prompts[i]) for i in done),
            "ttft": ttft, "tpot": tpot, "e2e": e2e, "status": status, "lag": lag[:nxt], "samples": samples,
            "done": len(done), "added": nxt, "stopped": stopped, "good": sum(1 for s in status if s)}


def _replay_once(engine: LLMEngine, records: list[TraceRecord], prompts: list[list[int]], max_output: int | None,
                 time_scale: float, slo: SLO, give_up_after: int | None = None) -> dict:
    """The whole slice replayed (``_replay``); with ``give_up_after``, stopped once that many requests have
    missed the SLO (a rate probe that has already failed need not run to the end). ``ttft``, ``tpot`` and
    ``e2e`` keep the finished requests' figures; ``*_all`` every request's, in record order (None: none)."""
    stop = (lambda st: sum(1 for s in st if s is False) >= give_up_after) if give_up_after is not None else None
    r = _replay(engine, records, prompts, max_output, time_scale, slo, stop=stop)
    if r["stopped"]:
        return {"gave_up": True, "missed": sum(1 for s in r["status"] if s is False)}
    for k in ("ttft", "tpot", "e2e"):
        r[k + "_all"] = r[k]
        r[k] = [x for x in r[k] if x is not None]
    return r


def probe(engine: LLMEngine, records: list[TraceRecord], prompts: list[list[int]], rate: float, slo: SLO,
          warmup: int, plan: list[int], max_output: int | None, window: int = 0, target: float = 0.9,
          deadline: float | None = None):
    """One rate probe of the judge (ops/judge/rule.py): ``records`` (the first ``warmup`` of them not counted) replayed
    with their arrival pattern scaled to ``rate`` req/s, stopped as soon as the counted requests decide it
    (``sequential_stop`` at the looks of ``plan``) or at ``deadline``. Returns (the Probe, the replay's step
    samples). In process the load generator is the engine loop itself: its send lag is at most the step in
    progress, which a server's request would wait for too, so a probe here is never void."""
    from ops.measure.capacity import Probe, sequential_stop

    engine.block_manager.reset_prefix_cache()
    scale = own_rate(records) / rate if rate > 0 else 0.0
    decided: list = []

    def stop(status) -> bool:
        got = sequential_stop(status, plan, target)
        if got is not None:
            decided.append(got)
        return got is not None
    t = time.perf_counter()
    r = _replay(engine, records, prompts, max_output, scale, slo, stop=stop, counted_from=warmup, deadline=deadline)
    status = r["status"][warmup:]
    if decided:
        n, verdict = decided[-1]
    else:  # the deadline came first: undecided, with what is known
        n, verdict = len(status), "undecided"
    # the first n counted requests (all known at a look; at a futility stop or the deadline, the known ones)
    outcomes = [int(s) for s in status[:n] if s is not None]
    span = r["wall"]
    p = Probe(rate=rate, achieved=r["done"] / span if span > 0 else 0.0,
              outcomes=outcomes, warmup=warmup, window=window,
              lag_s=max(r["lag"], default=0.0), verdict=verdict, seconds=time.perf_counter() - t,
              replayed=len(records))
    return p, r["samples"]


def saturation(engine: LLMEngine, records: list[TraceRecord], prompts: list[list[int]], max_output: int | None,
               slo: SLO) -> tuple[float, list[list[float]]]:
    """Saturation throughput: requests completed per second with every request of ``records`` at once (as
    ``vllm bench serve`` at an infinite rate), and the replay's step samples."""
    engine.block_manager.reset_prefix_cache()
    r = _replay(engine, records, prompts, max_output, 0.0, slo)
    return (r["done"] / r["wall"] if r["wall"] > 0 else 0.0), r["samples"]


def own_rate(records: list[TraceRecord]) -> float:
    """The slice's recorded request rate (requests per second of its arrival span)."""
    span = records[-1].arrival_s - records[0].arrival_s
    return (len(records) - 1) / span if span > 0 and len(records) > 1 else float(len(records))


def attainment_at(engine: LLMEngine, records: list[TraceRecord], prompts: list[list[int]], rate: float,
                  max_output: int | None, slo: SLO, target: float = 0.9, repeats: int = 1) -> float:
    """SLO attainment with the slice's arrival pattern replayed at ``rate`` req/s (0: every request at once);
    a replay that has already missed more than 1 - ``target`` of its requests stops early (and reports so).
    With ``repeats`` > 1 the rate is replayed that many times and the worst attainment counts (a rate passes
    only when every replay passes; the first failing replay ends the probe)."""
    scale = own_rate(records) / rate if rate > 0 else 0.0
    allowed = int((1 - target) * len(records)) + 1
    worst = 1.0
    for _ in range(max(1, repeats)):
        engine.block_manager.reset_prefix_cache()
        r = _replay_once(engine, records, prompts, max_output, scale, slo, give_up_after=allowed)
        worst = min(worst, (len(records) - r["missed"]) / len(records) if r.get("gave_up")
                    else r["good"] / len(records))
        if worst < target:
            break
    return worst


def slow_tier(engine: LLMEngine, records: list[TraceRecord], prompts: list[list[int]], trace_id: str,
              repeats: int = 3, time_scale: float = 1.0, max_output: int | None = None, slo: SLO = SLO(),
              capacity_guess: float | None = None, capacity_probes: int = 6,
              saturation_of: bool = False) -> BenchResult:
    """Replays the slice ``repeats`` times (prefix cache dropped between runs) and reports medians; with
    ``saturation_of``, also the saturation throughput (the slice at once); with ``capacity_guess`` (req/s, e.g.
    the cost model's), then a quick capacity search from there, each rate replayed ``repeats`` times (it
    passes only if every replay does). Decisions do not use that quick search: the judge (ops/judge/rule.py)
    measures the capacities it compares itself."""
    if not records or len(records) != len(prompts):
        raise ValueError("slow_tier needs one prompt per trace record")
    t0 = time.perf_counter()
    # untimed: a new variant's first steps compile and capture (Triton, CUDA graphs), then alone the longest prompt
    # (full chunks) and 97 of its tokens reversed (rows no multiple of 16, no shared prefix): prefill-sized kernels
    # (W8A8 from 65 rows) compile here, not in the first requests' TTFT; each replay below starts with no cache
    engine.generate([prompts[0][:16], prompts[-1][:8]], SamplingParams(max_tokens=2, ignore_eos=True))
    longest = max(prompts, key=len)
    for warm in (longest, longest[::-1][:97]):
        engine.generate([warm], SamplingParams(max_tokens=1, ignore_eos=True))
    runs = []
    st = engine.stats
    drafts, drafted, accepted = st.spec_drafts, st.spec_draft_tokens, st.spec_accepted_tokens
    for _ in range(repeats):
        engine.block_manager.reset_prefix_cache()
        runs.append(_replay_once(engine, records, prompts, max_output, time_scale, slo))
    drafts, drafted, accepted = st.spec_drafts - drafts, st.spec_draft_tokens - drafted, st.spec_accepted_tokens - accepted
    rates = [r["out"] / r["wall"] for r in runs]
    mid = sorted(range(repeats), key=lambda i: rates[i])[repeats // 2]
    m = runs[mid]
    res = BenchResult(
        variant_id=engine.variant.variant_id, tier="slow", layers=engine.model_config.num_hidden_layers,
        trace_id=trace_id, output_tok_s=statistics.median(rates),
        total_tok_s=(m["out"] + m["in"]) / m["wall"],
        ttft_p50=percentile(m["ttft"], .5), ttft_p90=percentile(m["ttft"], .9), ttft_p99=percentile(m["ttft"], .99),
        tpot_p50=percentile(m["tpot"], .5), tpot_p90=percentile(m["tpot"], .9), tpot_p99=percentile(m["tpot"], .99),
        e2e_p50=percentile(m["e2e"], .5), e2e_p90=percentile(m["e2e"], .9), e2e_p99=percentile(m["e2e"], .99),
        goodput=m["good"] / m["wall"], repeats=repeats, spread=max(rates) - min(rates),
        goodput_spread=max(r["good"] / r["wall"] for r in runs) - min(r["good"] / r["wall"] for r in runs),
        step_samples=m["samples"], attainment=m["good"] / len(records), slo_ttft_s=slo.ttft_s, slo_tpot_s=slo.tpot_s,
        hardware=hardware_label(engine.device), wall_s=time.perf_counter() - t0,
        spec_acceptance=accepted / drafted if drafted else 0.0, spec_accepted_length=1 + accepted / drafts if drafts else 0.0,
        ttfts=m["ttft_all"], tpots=m["tpot_all"], slo_ttft_per_token_s=slo.ttft_per_token_s,
    )
    if saturation_of:
        res.saturation, res.saturation_samples = saturation(engine, records, prompts, max_output, slo)
    if capacity_guess is not None:
        # below one request per median latency the requests run one at a time: no lower rate does better; above
        # the whole slice arriving within a twentieth of the fastest request's latency, they arrive at once
        res.capacity, res.capacity_spread, res.rate_probes = capacity_search(
            lambda rate: attainment_at(engine, records, prompts, rate, max_output, slo, repeats=repeats), capacity_guess,
            max_probes=capacity_probes, min_rate=0.5 / max(res.e2e_p50, 1e-3),
            max_rate=max(1, len(records) - 1) / (0.05 * max(min(m["e2e"]), 1e-3)))
        res.wall_s = time.perf_counter() - t0
    return res


def served_tier(config, records: list[TraceRecord], prompts: list[list[int]], trace_id: str, repeats: int = 3,
                time_scale: float = 1.0, max_output: int | None = None, slo: SLO = SLO(),
                capacity_guess: float | None = None, capacity_probes: int = 6) -> BenchResult:
    """The slow tier through the variant as it would serve: its parallel layout started on loopback (``tp`` ranks,
    ``dp`` replicas behind the router: engine/entrypoints/router.py's ServedLayout, timed as ``start_s``), the slice replayed
    over HTTP in real time ``repeats`` times, then the capacity search as ``slow_tier``'s (a rate passes only if
    every replay does). Every variant of a search that compares layouts is measured this way, static-best too,
    so the HTTP path and real-time arrivals weigh on all of them alike. A failed request misses the SLO."""
    import asyncio

    from engine.loader.model_source import load_config
    from engine.entrypoints.router import ServedLayout
    from ops.traffic.replay import replay_async

    if not records or len(records) != len(prompts):
        raise ValueError("served_tier needs one prompt per trace record")
    t0 = time.perf_counter()
    variant = config.initial_variant()

    def replay(url: str, scale: float) -> dict:
        rep = asyncio.run(replay_async(records, prompts, url + "/v1", "polyinf", time_scale=scale,
                                       max_output=max_output, timeout=3600))
        ok = [r for r in rep.results if r.ok]
        tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
        good = sum(1 for r in ok if slo.met(r.ttft, (r.e2e - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1
                                             else None, r.input_tokens, r.output_tokens))
        return {"wall": rep.duration_s, "out": rep.total_output_tokens, "in": rep.total_input_tokens,
                "ttft": [r.ttft for r in ok], "tpot": tpot, "e2e": [r.e2e for r in ok], "good": good,
                "errors": rep.errors}

    with ServedLayout(config) as served:
        asyncio.run(replay_async(records[:2], [p[:16] for p in prompts[:2]], served.url + "/v1", "polyinf",
                                 time_scale=0.0, max_output=2))  # untimed: first steps compile and capture
        runs = [replay(served.url, time_scale) for _ in range(repeats)]
        rates = [r["out"] / r["wall"] for r in runs]
        mid = sorted(range(repeats), key=lambda i: rates[i])[repeats // 2]
        m = runs[mid]
        res = BenchResult(
            variant_id=variant.variant_id, tier="slow", trace_id=trace_id,
            layers=config.layers or load_config(config.source).num_hidden_layers,
            output_tok_s=statistics.median(rates), total_tok_s=(m["out"] + m["in"]) / m["wall"],
            ttft_p50=percentile(m["ttft"], .5), ttft_p90=percentile(m["ttft"], .9), ttft_p99=percentile(m["ttft"], .99),
            tpot_p50=percentile(m["tpot"], .5), tpot_p90=percentile(m["tpot"], .9), tpot_p99=percentile(m["tpot"], .99),
            e2e_p50=percentile(m["e2e"], .5), e2e_p90=percentile(m["e2e"], .9), e2e_p99=percentile(m["e2e"], .99),
            goodput=m["good"] / m["wall"], repeats=repeats, spread=max(rates) - min(rates),
            goodput_spread=max(r["good"] / r["wall"] for r in runs) - min(r["good"] / r["wall"] for r in runs),
            attainment=m["good"] / len(records), slo_ttft_s=slo.ttft_s, slo_tpot_s=slo.tpot_s,
            hardware=hardware_label(torch.device(config.device)), errors=m["errors"], start_s=served.start_s)
        if capacity_guess is not None:
            def attain(rate: float) -> float:
                scale = own_rate(records) / rate if rate > 0 else 0.0
                worst = 1.0
                for _ in range(max(1, repeats)):
                    worst = min(worst, replay(served.url, scale)["good"] / len(records))
                    if worst < 0.9:
                        break
                return worst
            res.capacity, res.capacity_spread, res.rate_probes = capacity_search(
                attain, capacity_guess, max_probes=capacity_probes, min_rate=0.5 / max(res.e2e_p50, 1e-3),
                max_rate=max(1, len(records) - 1) / (0.05 * max(min(m["e2e"] or [1e-3]), 1e-3)))
    res.wall_s = time.perf_counter() - t0
    return res


def fast_tier(engine: LLMEngine, prefill_lengths: list[int], decode_batches: list[tuple[int, int]],
              repeats: int = 5, decode_steps: int = 4) -> BenchResult:
    """Median step time of each shape: a prefill of n tokens; a decode step of b sequences at context c.

    ``output_tok_s`` is decode tokens per second over the decode shapes (sum b / sum step time).
    """
    t0 = time.perf_counter()
    times: dict[str, float] = {}
    vocab = engine.model_config.vocab_size

    def ids(n: int, salt: int) -> list[int]:
        return [(salt * 7919 + i * 104729) % (vocab - 1) + 1 for i in range(n)]

    def sync():
        if engine.device.type == "cuda":
            torch.cuda.synchronize()

    for n in prefill_lengths:
        samples = []
        for r in range(repeats):
            engine.block_manager.reset_prefix_cache()
            engine.add_request(ids(n, r), SamplingParams(max_tokens=1, ignore_eos=True))
            sync()
            t = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
            sync()
            samples.append(time.perf_counter() - t)
        times[f"prefill n={n}"] = 1e3 * statistics.median(samples)
    decode_tokens = decode_time = 0.0
    spreads = []
    bm = engine.block_manager
    for b, c in decode_batches:
        # as many sequences as the KV pool holds to their last token and the scheduler runs at once: a batch
        # the pool cannot hold would be preempted into a smaller one, and timed under the wrong shape
        need = -(-(c + decode_steps * repeats + 2) // bm.block_size)
        b = min(b, bm.num_blocks // need, engine.scheduler.config.max_num_seqs)
        if b < 1:
            continue
        bm.reset_prefix_cache()
        for i in range(b):
            engine.add_request(ids(c, 1000 + i), SamplingParams(max_tokens=decode_steps * repeats + 2, ignore_eos=True))
        while engine.scheduler.waiting or any(not s.output_token_ids for s in engine.scheduler.running):
            engine.step()  # prefill until every sequence decodes
        samples = []
        for _ in range(repeats):
            sync()
            t = time.perf_counter()
            for _ in range(decode_steps):
                engine.step()
            sync()
            samples.append((time.perf_counter() - t) / decode_steps)
        while engine.has_unfinished():
            engine.step()
        med = statistics.median(samples)
        times[f"decode b={b} ctx={c}"] = 1e3 * med
        spreads.append((max(samples) - min(samples)) / med if med else 0.0)
        decode_tokens += b
        decode_time += med
    rate = decode_tokens / decode_time if decode_time else 0.0
    return BenchResult(
        variant_id=engine.variant.variant_id, tier="fast", layers=engine.model_config.num_hidden_layers,
        trace_id=f"shapes:{len(prefill_lengths)}p/{len(decode_batches)}d", output_tok_s=rate, total_tok_s=rate,
        repeats=repeats, spread=rate * max(spreads, default=0.0), hardware=hardware_label(engine.device),
        wall_s=time.perf_counter() - t0, step_times_ms=times,
    )


def fast_shapes(traffic, variant, max_input: int = 256) -> tuple[list[int], list[tuple[int, int]]]:
    """The shape mix a traffic profile implies for a variant: prefill of a short, the median and the p90
    prompt (clipped to ``max_input``); decode at batch 1, the profile's concurrency and twice it (capped
    by the variant's max_num_seqs) at the median context."""
    prefill = sorted({16, min(max_input, max(8, int(traffic.input_p50))), min(max_input, max(8, int(traffic.input_p90)))})
    conc = max(1, round(traffic.estimated_concurrency))
    ctx = min(max_input, int(traffic.input_p50)) + 8
    batches = sorted({1, min(conc, variant.max_num_seqs), min(2 * conc, variant.max_num_seqs)})
    return prefill, [(b, ctx) for b in batches]
