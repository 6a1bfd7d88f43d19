"""Drift: is the live traffic, the model or the hardware different enough from what the deployed build was
tuned on?

Thresholds are configuration. This module measures and compares; the hysteresis (a drift seen on
``confirmations`` consecutive evaluations before it fires) and the minimum interval between
re-optimizations are the traffic-drift sensor's (pipelines/sensors.py), which keeps them in its cursor.

A capture directory is read as one stream of records (rotated files oldest first, then the current one).
A record's *position* is its index in that stream; positions never move, since the capture only appends
and rotation only renames. A deployment records the position its capture had reached when it went live,
so "the traffic its build served" is the stream from there on. Arrival times cannot mark it: they are
seconds since the serving process started, so they restart from zero whenever the server does.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import subprocess
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from engine.serving.capture import capture_files, read_capture_lines
from engine.serving.trace_record import TraceRecord
from ops.traffic.traces import TrafficProfile


@dataclass(frozen=True)
class DriftThresholds:
    input_p50_ratio: float = 0.5  # relative change of the median prompt length that counts as drift
    input_p90_ratio: float = 0.5
    output_p50_ratio: float = 0.5
    arrival_rate_ratio: float = 1.0
    prefix_reuse_delta: float = 0.2  # absolute change of the prefix-reuse share
    min_requests: int = 20  # fewer live requests than this say nothing
    confirmations: int = 1  # consecutive drifted evaluations before firing
    min_interval_s: float = 3600.0  # between two re-optimizations


def _rel(new: float, old: float) -> float:
    return abs(new - old) / max(abs(old), 1e-9)


def traffic_drift(live: TrafficProfile, tuned: dict, t: DriftThresholds) -> list[str]:
    """Reasons the live profile drifted from the tuned one (empty: no drift)."""
    if live.requests < t.min_requests:
        return []
    reasons = []
    for field_name, limit in (("input_p50", t.input_p50_ratio), ("input_p90", t.input_p90_ratio),
                              ("output_p50", t.output_p50_ratio), ("arrival_rate", t.arrival_rate_ratio)):
        new, old = getattr(live, field_name), float(tuned[field_name])
        if _rel(new, old) > limit:
            reasons.append(f"{field_name} {old:.1f} -> {new:.1f} ({100 * (new - old) / max(old, 1e-9):+.0f}%, "
                           f"limit {100 * limit:.0f}%)")
    if abs(live.prefix_reuse - float(tuned["prefix_reuse"])) > t.prefix_reuse_delta:
        reasons.append(f"prefix_reuse {float(tuned['prefix_reuse']):.2f} -> {live.prefix_reuse:.2f}")
    return reasons


# ---- captured traffic ----------------------------------------------------------------------------
@dataclass(frozen=True)
class CaptureSlice:
    """The records of a capture directory at positions [start, end), arrival-sorted on one clock."""

    capture_dir: str
    start: int
    end: int  # one past the last position read: the capture's length when it was read without a bound
    records: tuple[TraceRecord, ...]
    skipped: int = 0  # malformed lines in the range, under lenient reading


# a record finishing this much earlier than the one written before it was served by a restarted process
_RESTART_S = 1.0


def read_capture(capture_dir: str | Path, start: int = 0, end: int | None = None,
                 lenient: bool = False) -> CaptureSlice:
    """The captured records at positions [start, end) (``end`` None: to the newest). A malformed line keeps
    its position; it raises ValueError naming file and line, or with ``lenient`` is counted and skipped.

    Records are written when they finish, so on one process's clock finish times (arrival + end-to-end) never
    go back; where they do, the server restarted and its clock began again at zero. Later lifetimes are
    shifted to start where the one before ended, so the slice's arrivals stay in order across restarts."""
    if start < 0 or (end is not None and end < start):
        raise ValueError(f"bad capture range [{start}, {end})")
    records, skipped, pos = [], 0, 0
    offset = last_finish = 0.0
    for path in capture_files(capture_dir):
        for lineno, d in read_capture_lines(path):
            pos += 1
            if pos <= start or (end is not None and pos > end):
                continue
            try:
                if isinstance(d, Exception):
                    raise d
                r = TraceRecord.from_json(d)
            except (TypeError, ValueError) as e:
                if not lenient:
                    raise ValueError(f"{path}:{lineno}: {e}") from None
                skipped += 1
                continue
            finish = r.arrival_s + (r.e2e_s or 0.0)
            if offset + finish < last_finish - _RESTART_S:
                offset = last_finish
            last_finish = max(last_finish, offset + finish)
            records.append(replace(r, arrival_s=offset + r.arrival_s) if offset else r)
    records.sort(key=lambda r: r.arrival_s)
    return CaptureSlice(str(capture_dir), start, min(pos, end) if end is not None else pos, tuple(records), skipped)


def capture_position(capture_dir: str | Path) -> int:
    """How many records the capture holds: the position the next one will have (0 for no capture yet)."""
    if not Path(capture_dir).is_dir():
        return 0
    return sum(1 for path in capture_files(capture_dir) for _ in read_capture_lines(path))


# ---- hardware ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HardwareIdentity:
    """Which hardware a build was tuned for, from a look at the devices that runs nothing on them (the
    measured figures are ops.measure.hardware.probe's). Builds are keyed by it; when it changes, the deployed
    build was tuned for other hardware."""

    backend: str  # "cuda" or "cpu"
    device: str  # the device model, e.g. "NVIDIA H200" (the models, comma-separated, when they differ)
    device_count: int  # GPUs, or the CPUs this process may run on
    driver: str = ""  # the NVIDIA driver version; "" on a CPU

    @property
    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:12]

    def changes_from(self, old: "HardwareIdentity") -> list[str]:
        """What differs from ``old``, one line per field (empty: the same hardware)."""
        fields = ("backend", "device", "device_count", "driver")
        return [f"{f} {getattr(old, f)!r} -> {getattr(self, f)!r}" for f in fields
                if getattr(old, f) != getattr(self, f)]

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "HardwareIdentity":
        return cls(**d)


def hardware_identity(device: str = "cpu") -> HardwareIdentity:
    """The identity of the devices of kind ``device`` ("cuda", "cuda:1", "cpu") on this machine."""
    if device.split(":")[0] == "cuda":
        import torch

        count = torch.cuda.device_count()
        names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
        return HardwareIdentity("cuda", ", ".join(names), count, _nvidia_driver() if count else "")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return HardwareIdentity("cpu", _cpu_model(), cpus)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _nvidia_driver() -> str:
    try:  # "NVRM version: NVIDIA UNIX [Open ]Kernel Module [for x86_64]  550.54.15  ..."
        m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", Path("/proc/driver/nvidia/version").read_text())
        if m:
            return m.group(1)
    except OSError:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.split()[0] if out.returncode == 0 and out.stdout.split() else ""
    except (OSError, subprocess.TimeoutExpired):
        return ""


# ---- the deployed build --------------------------------------------------------------------------
@dataclass
class DeploymentRecord:
    """What the drift sensors compare against: written when a build is deployed."""

    endpoint: str
    variant_id: str
    traffic_profile: dict
    model_weights_hash: str
    model: str
    deployed_at: float
    capture_dir: str = ""
    partition_key: str = ""  # the deployment's Dagster partition (model x hardware x endpoint)
    capture_start: int = 0  # the capture's position when this build went live: its traffic starts there
    hardware: dict = field(default_factory=dict)  # HardwareIdentity.to_json() of what the build runs on

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> "DeploymentRecord | None":
        try:
            return cls(**json.loads(path.read_text()))
        except (FileNotFoundError, json.JSONDecodeError, TypeError):
            return None
