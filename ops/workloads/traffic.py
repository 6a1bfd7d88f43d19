"""Request-size traffic for a workload: arrival times and request sizes, derived from a real LLM trace.

No public trace records PDE grids, weather resolutions, proteins or forecast channels per request, so the real
LLM traces lend their **arrival pattern** and their **size distribution's shape**: each request keeps its
recorded arrival time, and its prompt length becomes a size level of the workload by rank. The trace's prompt
lengths are cut at their quantiles into as many equally likely bins as the workload has size levels (bin k of
len(levels)); a prompt in bin k asks for level k. So the mix is even over the levels, and the trace's bursts of
long prompts become bursts of large requests. The mapping is deterministic: the same trace slice gives the same
sizes.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path

from engine.workloads.workload import Workload
from ops.traffic.traces import load_trace

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = ROOT / "traces" / "AzureLLMInferenceTrace_conv.csv"


@dataclass(frozen=True)
class SizeRequest:
    arrival_s: float  # seconds from the trace's first request
    size: int  # on the workload's size axis


@dataclass(frozen=True)
class SizeTrace:
    workload: str
    source: str  # the trace file and slice it came from
    requests: tuple[SizeRequest, ...]

    def __post_init__(self) -> None:
        if not self.requests:
            raise ValueError(f"{self.workload}: a size trace needs at least one request")

    @property
    def sizes(self) -> list[int]:
        return [r.size for r in self.requests]

    @property
    def rate(self) -> float:
        """Requests per second over the trace's span (its arrival rate as recorded)."""
        span = self.requests[-1].arrival_s - self.requests[0].arrival_s
        return (len(self.requests) - 1) / span if span > 0 else float("inf")

    def mix(self) -> dict[int, float]:
        """Share of requests per size."""
        out: dict[int, float] = {}
        for s in self.sizes:
            out[s] = out.get(s, 0.0) + 1 / len(self.requests)
        return dict(sorted(out.items()))

    def scaled(self, rate: float) -> "SizeTrace":
        """The same requests arriving at ``rate`` requests per second on average (the pattern kept)."""
        if rate <= 0:
            raise ValueError(f"rate must be positive, got {rate}")
        k = self.rate / rate if self.rate != float("inf") else 0.0
        t0 = self.requests[0].arrival_s
        return SizeTrace(self.workload, f"{self.source} at {rate:.3g} req/s",
                         tuple(SizeRequest((r.arrival_s - t0) * k, r.size) for r in self.requests))


def size_trace(workload: Workload, n: int = 200, start: int = 0, path: str | Path = DEFAULT_TRACE) -> SizeTrace:
    """``n`` requests of the trace at ``path`` from request ``start`` on, sizes mapped by rank (module docstring).
    The bins are cut over the whole trace, so a slice keeps the trace's own proportions of sizes."""
    if n < 1 or start < 0:
        raise ValueError(f"need n >= 1 and start >= 0, got n={n}, start={start}")
    records = load_trace(path)
    if start + n > len(records):
        raise ValueError(f"{path} has {len(records)} requests; asked for {n} from #{start}")
    lengths = sorted(r.input_tokens for r in records)
    levels = workload.size_levels
    cuts = [lengths[(k * len(lengths)) // len(levels)] for k in range(1, len(levels))]
    chosen = records[start:start + n]
    t0 = chosen[0].arrival_s
    reqs = tuple(SizeRequest(r.arrival_s - t0, levels[bisect.bisect_right(cuts, r.input_tokens)]) for r in chosen)
    return SizeTrace(workload.name, f"{Path(path).name} #{start}-{start + n - 1}", reqs)
