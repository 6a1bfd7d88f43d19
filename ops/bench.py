"""Measuring variants: the slow tier (a trace slice replayed through the engine) and the fast tier
(step times of the shape mix a traffic profile implies, on a few layers).

Both return BenchResult (design section 3). A measurement is a median over repeats with its
spread (max - min); a difference smaller than the spread is no difference.
"""
from __future__ import annotations

import platform
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.trace_record import TraceRecord
from ops.traces import percentile


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

    def to_json(self) -> dict:
        return asdict(self)


def hardware_label(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()} cpu x{torch.get_num_threads()}"


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 2.0
    tpot_s: float = 0.2


def _replay_once(engine: LLMEngine, records: list[TraceRecord], prompts: list[list[int]], max_output: int | None,
                 time_scale: float, slo: SLO, give_up_after: int | None = None) -> dict:
    """Adds each request when its (scaled) arrival time has passed, steps the engine, times every request.
    With ``give_up_after``, stops (aborting what runs) once that many requests have missed the SLO: a rate
    probe that has already failed need not run to the end.

    Time runs on the replay's own clock: wall time, plus every gap in which the engine had nothing to do
    before the next arrival, skipped instead of slept. An idle engine's state does not change with time,
    so every latency is what a real-time replay would measure, and a probe at a low rate takes its busy
    time, not its arrival span."""
    t0 = records[0].arrival_s
    skipped = 0.0

    def clock() -> float:
        return time.perf_counter() + skipped
    pending = list(range(len(records)))
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, tuple[float, int]] = {}
    run: dict[str, int] = {}  # tokens run per request so far (cached prefix included)
    samples: list[list[float]] = []
    start = clock()
    while pending or engine.has_unfinished():
        now = clock() - start
        while pending and (records[pending[0]].arrival_s - t0) * time_scale <= now:
            i = pending.pop(0)
            out = records[i].output_tokens if max_output is None else min(records[i].output_tokens, max_output)
            rid = engine.add_request(prompts[i], SamplingParams(max_tokens=max(1, out), ignore_eos=True))
            arrival[rid] = clock()
        if not engine.has_unfinished():
            skipped += max(0.0, (records[pending[0]].arrival_s - t0) * time_scale - now)
            continue
        ts = clock()
        outs = engine.step()
        te = clock()
        shape = [0, 0, len(outs), 0, te - ts]
        for o in outs:
            before = run.get(o.request_id, o.num_cached_tokens)
            now_run = o.num_cached_tokens + o.num_tokens_run
            n = max(0, now_run - before)
            run[o.request_id] = now_run
            shape[0] += n
            shape[1] += now_run
            shape[3] += n * (before + (n + 1) // 2)
        if shape[0]:
            samples.append(shape)
        for o in outs:
            t = te
            if o.token_ids and o.request_id not in first:
                first[o.request_id] = t
            if o.finished:
                done[o.request_id] = (t, len(o.token_ids))
        if give_up_after is not None and _missed(arrival, first, done, te, slo) >= give_up_after:
            for rid in arrival:
                engine.abort(rid)
            while engine.has_unfinished():  # a step launched ahead is collected and dropped
                engine.step()
            return {"gave_up": True, "missed": give_up_after}
    wall = clock() - start
    ttft = {r: first[r] - arrival[r] for r in done}
    e2e = {r: done[r][0] - arrival[r] for r in done}
    tpot = {r: (done[r][0] - first[r]) / (done[r][1] - 1) for r in done if done[r][1] > 1}
    out_tokens = sum(n for _, n in done.values())
    in_tokens = sum(len(p) for p in prompts)
    good = sum(1 for r in done if ttft[r] <= slo.ttft_s and tpot.get(r, 0.0) <= slo.tpot_s)
    return {"wall": wall, "out": out_tokens, "in": in_tokens, "ttft": list(ttft.values()),
            "tpot": list(tpot.values()), "e2e": list(e2e.values()), "good": good, "samples": samples}


def _missed(arrival: dict, first: dict, done: dict, now: float, slo: SLO) -> int:
    """Requests that can no longer meet the SLO: no first token within the TTFT target, or finished slower than
    the TPOT target."""
    n = 0
    for rid, a in arrival.items():
        f = first.get(rid)
        if (f is None and now - a > slo.ttft_s) or (f is not None and f - a > slo.ttft_s):
            n += 1
        elif rid in done and done[rid][1] > 1 and (done[rid][0] - f) / (done[rid][1] - 1) > slo.tpot_s:
            n += 1
    return n


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


def capacity_search(attain, guess: float, target: float = 0.9, resolution: float = 1.25,
                    max_probes: int = 6, min_rate: float = 0.0,
                    max_rate: float = float("inf")) -> tuple[float, float, list[list[float]]]:
    """The highest rate whose attainment (``attain(rate)``) reaches ``target``: from ``guess`` it doubles or
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


def slow_tier(engine: LLMEngine, records: list[TraceRecord], prompts: list[list[int]], trace_id: str,
              repeats: int = 3, time_scale: float = 1.0, max_output: int | None = None, slo: SLO = SLO(),
              capacity_guess: float | None = None, capacity_probes: int = 6) -> BenchResult:
    """Replays the slice ``repeats`` times (prefix cache dropped between runs) and reports medians; with
    ``capacity_guess`` (req/s, e.g. the cost model's), then searches the capacity at the SLO from there, each
    rate replayed ``repeats`` times (it passes only if every replay does)."""
    if not records or len(records) != len(prompts):
        raise ValueError("slow_tier needs one prompt per trace record")
    t0 = time.perf_counter()
    # untimed: a new variant's first steps compile and capture (Triton, CUDA graphs); no timed repeat pays for it
    engine.generate([prompts[0][:16], prompts[-1][:8]], SamplingParams(max_tokens=2, ignore_eos=True))
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
    )
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
    ``dp`` replicas behind the router: engine/router.py's ServedLayout, timed as ``start_s``), the slice replayed
    over HTTP in real time ``repeats`` times, then the capacity search as ``slow_tier``'s (a rate passes only if
    every replay does). Every variant of a search that compares layouts is measured this way, static-best too,
    so the HTTP path and real-time arrivals weigh on all of them alike. A failed request misses the SLO."""
    import asyncio

    from engine.loader import load_config
    from engine.router import ServedLayout
    from ops.replay import replay_async

    if not records or len(records) != len(prompts):
        raise ValueError("served_tier needs one prompt per trace record")
    t0 = time.perf_counter()
    variant = config.initial_variant()

    def replay(url: str, scale: float) -> dict:
        rep = asyncio.run(replay_async(records, prompts, url + "/v1", "polyinf", time_scale=scale,
                                       max_output=max_output, timeout=3600))
        ok = [r for r in rep.results if r.ok]
        tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
        good = sum(1 for r in ok if r.ttft <= slo.ttft_s and (r.output_tokens <= 1 or
                                                               (r.e2e - r.ttft) / (r.output_tokens - 1) <= slo.tpot_s))
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
