"""Trace import (Mooncake JSONL, Azure LLM-inference CSV, our own capture files) and traffic profiling."""
from __future__ import annotations

import csv
import dataclasses
import itertools
import json
import math
import random
import statistics
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

from engine.serving.capture import read_capture_lines
from engine.serving.trace_record import TraceRecord

MOONCAKE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A malformed trace row; the message names the file and line."""


@dataclass
class ImportStats:
    records: int = 0
    skipped: int = 0  # malformed rows skipped under lenient=True
    first_error: str | None = None


def detect_format(path: Path) -> str:
    if path.suffix == ".csv":
        return "azure"
    with open(path, encoding="utf-8", errors="replace") as f:
        # the first row that parses says which (a broken row before it is the reader's to report)
        for line in itertools.islice(f, 1000):
            try:
                obj = json.loads(line) if line.strip().startswith("{") else None
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                return "mooncake" if "hash_ids" in obj else "capture"
    return "capture"


def load_trace(path: str | Path, fmt: str | None = None, lenient: bool = False,
               stats: ImportStats | None = None) -> list[TraceRecord]:
    """All records of a trace file, sorted by arrival. Strict by default: the first bad row raises
    TraceError naming file and line; with lenient=True bad rows are counted in ``stats`` and skipped."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace file not found: {path}")
    stats = stats if stats is not None else ImportStats()
    fmt = fmt or detect_format(path)
    reader = {"mooncake": _mooncake, "azure": _azure, "capture": _capture}.get(fmt)
    if reader is None:
        raise TraceError(f"unknown trace format {fmt!r} (mooncake, azure, capture)")
    out = []
    for lineno, item in reader(path):
        if isinstance(item, Exception):
            msg = f"{path}:{lineno}: {item}"
            if not lenient:
                raise TraceError(msg)
            stats.skipped += 1
            stats.first_error = stats.first_error or msg
            continue
        out.append(item)
    stats.records = len(out)
    out.sort(key=lambda r: r.arrival_s)
    return spread_ticks(out) if fmt == "mooncake" else out


def spread_ticks(records: list[TraceRecord]) -> list[TraceRecord]:
    """Arrivals recorded on a coarse clock, spread evenly within their tick. The Mooncake trace's timestamps
    are quantised to steps of about 3 s (traces/README.md): replayed as recorded, each step's requests would
    arrive as one burst, and a burst stays a burst at every scaled rate, so a capacity search could never
    find a rate without it. The tick is the most common step between distinct timestamps; the requests of
    a timestamp get arrival times drawn uniformly over the tick (or up to the next timestamp, if that comes
    sooner), in their recorded order: given their count, that is how Poisson arrivals fall within an
    interval. The draw is seeded by the timestamp, so every load gives the same times."""
    times = sorted({r.arrival_s for r in records})
    steps = [round(b - a, 6) for a, b in zip(times, times[1:]) if b > a]
    if len(times) == len(records) or not steps:
        return records
    tick = statistics.mode(steps)
    out, i = [], 0
    for j, t in enumerate(times):
        group = []
        while i < len(records) and records[i].arrival_s == t:
            group.append(records[i])
            i += 1
        width = min(tick, times[j + 1] - t) if j + 1 < len(times) else tick
        rng = random.Random(round(t * 1e6))
        offsets = [0.0] + sorted(rng.random() * width for _ in group[1:])  # the tick's first request at its start
        out += [dataclasses.replace(r, arrival_s=t + o) for r, o in zip(group, offsets)]
    return out


def _mooncake(path: Path) -> Iterator[tuple[int, TraceRecord | Exception]]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                hashes = d["hash_ids"]
                if not isinstance(hashes, list):
                    raise ValueError("hash_ids must be a list")
                yield lineno, TraceRecord(
                    arrival_s=_num(d["timestamp"]) / 1000.0, input_tokens=_int(d["input_length"]),
                    output_tokens=_int(d["output_length"]), prefix_block_hashes=tuple(_int(h) for h in hashes),
                    block_tokens=MOONCAKE_BLOCK_TOKENS, source="mooncake")
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                yield lineno, ValueError(f"bad Mooncake row ({type(e).__name__}: {e})")


def _azure(path: Path) -> Iterator[tuple[int, TraceRecord | Exception]]:
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        rows = csv.reader(f)
        header = next(rows, None)
        need = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
        if header is None or any(h not in header for h in need):
            yield 1, ValueError(f"Azure trace header must name {', '.join(need)}, got {header}")
            return
        idx = [header.index(h) for h in need]
        good = []  # (line, timestamp, input, output): arrivals count from the earliest row, not the first
        for lineno, row in enumerate(rows, 2):
            if not row:
                continue
            try:
                ts = datetime.fromisoformat(row[idx[0]].strip()[:26])
                if ts.tzinfo is not None:  # one clock for every row: UTC without a zone
                    ts = ts.astimezone(timezone.utc).replace(tzinfo=None)
                good.append((lineno, ts, _int(row[idx[1]]), _int(row[idx[2]])))
            except (IndexError, ValueError) as e:
                yield lineno, ValueError(f"bad Azure row {row!r} ({e})")
    start = min((ts for _, ts, _, _ in good), default=None)
    for lineno, ts, n_in, n_out in good:
        try:
            yield lineno, TraceRecord(arrival_s=(ts - start).total_seconds(), input_tokens=n_in,
                                      output_tokens=n_out, source="azure")
        except (TypeError, ValueError) as e:
            yield lineno, ValueError(f"bad Azure row at line {lineno} ({e})")


def _capture(path: Path) -> Iterator[tuple[int, TraceRecord | Exception]]:
    for lineno, d in read_capture_lines(path):
        if isinstance(d, Exception):
            yield lineno, d
            continue
        try:
            yield lineno, TraceRecord.from_json(d)
        except (TypeError, ValueError) as e:
            yield lineno, ValueError(f"bad capture record ({e})")


def _int(v) -> int:
    if isinstance(v, bool):
        raise ValueError(f"expected an integer, got {v!r}")
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, str):
        v = int(v.strip())
    if not isinstance(v, int) or v < 0:
        raise ValueError(f"expected a non-negative integer, got {v!r}")
    return v


def _num(v) -> float:
    f = float(v)
    if not math.isfinite(f) or f < 0:
        raise ValueError(f"expected a non-negative number, got {v!r}")
    return f


# ---- profiling -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrafficProfile:
    window_s: float
    requests: int
    arrival_rate: float  # requests per second over the window
    interarrival_cv: float  # burstiness: coefficient of variation of inter-arrival gaps
    peak_second_rate: float  # most requests arriving within one second
    input_p50: float
    input_p90: float
    input_p99: float
    input_max: int
    output_p50: float
    output_p90: float
    output_p99: float
    output_max: int
    prefix_reuse: float  # share of input tokens in hashed blocks seen before in the trace
    estimated_concurrency: float  # Little's law: arrival rate x mean end-to-end latency
    sources: tuple[str, ...] = ()

    def to_json(self) -> dict:
        d = asdict(self)
        d["sources"] = list(self.sources)
        return d


def percentile(values, q: float) -> float:
    """The q-quantile (0..1) with linear interpolation between ranks, as numpy's default; 0 for no values."""
    v = sorted(values)
    if not v:
        return 0.0
    k = (len(v) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return float(v[lo] + (v[hi] - v[lo]) * (k - lo))


def profile(records: list[TraceRecord], nominal_tpot_s: float = 0.05) -> TrafficProfile:
    """The traffic profile of a trace. Without measured latencies, end-to-end time is estimated as
    output tokens x ``nominal_tpot_s``."""
    if not records:
        raise TraceError("cannot profile an empty trace")
    recs = sorted(records, key=lambda r: r.arrival_s)
    t0, t1 = recs[0].arrival_s, recs[-1].arrival_s
    window = max(t1 - t0, 1e-9)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(recs, recs[1:])]
    mean_gap = sum(gaps) / len(gaps) if gaps else 0.0
    cv = (math.sqrt(sum((g - mean_gap) ** 2 for g in gaps) / len(gaps)) / mean_gap) if gaps and mean_gap > 0 else 0.0
    per_second: dict[int, int] = {}
    for r in recs:
        per_second[int(r.arrival_s)] = per_second.get(int(r.arrival_s), 0) + 1
    ins = sorted(r.input_tokens for r in recs)
    outs = sorted(r.output_tokens for r in recs)
    seen: set[int] = set()
    reused = total_hashed = 0
    for r in recs:
        for i, h in enumerate(r.prefix_block_hashes):
            n = min(r.block_tokens, max(0, r.input_tokens - i * r.block_tokens))
            total_hashed += n
            if h in seen:
                reused += n
            seen.add(h)
    total_in = sum(ins)
    e2e = [r.e2e_s if r.e2e_s is not None else r.output_tokens * nominal_tpot_s for r in recs]
    rate = len(recs) / window if len(recs) > 1 else 0.0
    return TrafficProfile(
        window_s=window, requests=len(recs), arrival_rate=rate, interarrival_cv=cv,
        peak_second_rate=float(max(per_second.values())),
        input_p50=percentile(ins, 0.5), input_p90=percentile(ins, 0.9), input_p99=percentile(ins, 0.99), input_max=ins[-1],
        output_p50=percentile(outs, 0.5), output_p90=percentile(outs, 0.9), output_p99=percentile(outs, 0.99), output_max=outs[-1],
        prefix_reuse=reused / total_in if total_in else 0.0,
        estimated_concurrency=rate * (sum(e2e) / len(e2e)),
        sources=tuple(sorted({r.source for r in recs})),
    )


@dataclass
class Windows:
    """Disjoint windows of a trace's two parts, by arrival order: the **search part** (a search's slow-tier
    slice, ``skip`` requests, then the judge's windows) and the **held-out part** (the last third), which a
    search never replays (ops/judge/paired.py). A part too short for the windows asked of it is replayed again from
    its start, its arrivals shifted (``wrapped`` names it)."""

    records: list[TraceRecord]
    skip: int = 0  # the slow tier's slice at the start of the search part
    held_fraction: float = 1 / 3
    cursor: dict = field(default_factory=dict)
    wrapped: set = field(default_factory=set)

    def bounds(self, part: str) -> tuple[int, int]:
        n = len(self.records)
        split = max(1, min(n - 1, round(n * (1 - self.held_fraction)))) if n > 1 else n
        return (min(self.skip, max(0, split - 1)), split) if part == "search" else (split, n)

    def take(self, part: str, n: int) -> tuple[int, list[TraceRecord]]:
        """The next ``n`` requests of ``part`` (arrival times kept; replayed from the part's start, shifted, when
        it runs out), and the index of the first."""
        lo, hi = self.bounds(part)
        if hi <= lo:
            lo, hi = 0, len(self.records)
        at = self.cursor.get(part, lo)
        out: list[TraceRecord] = []
        first = at
        shift = 0.0
        while len(out) < n:
            if at >= hi:
                self.wrapped.add(part)
                span = self.records[hi - 1].arrival_s - self.records[lo].arrival_s
                gap = span / max(1, hi - lo - 1) if hi - lo > 1 else 1.0
                shift += span + gap
                at = lo
            r = self.records[at]
            out.append(dataclasses.replace(r, arrival_s=r.arrival_s + shift) if shift else r)
            at += 1
        self.cursor[part] = at
        return first, out
