"""Drift: is the live traffic (or the model) different enough from what the deployed build was tuned on?

Thresholds are configuration. This module measures and compares; the hysteresis (a drift seen on
``confirmations`` consecutive evaluations before it fires) and the minimum interval between
re-optimizations are the traffic-drift sensor's (pipelines/sensors.py), which keeps them in its cursor.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ops.traces import TrafficProfile


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
