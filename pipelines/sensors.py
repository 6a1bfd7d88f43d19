"""Sensors (traffic, model and hardware drift, deployments) and the nightly re-optimization schedule.

Every run they request for a deployment on record tunes on the traffic that deployment captured since its
last build: the request's run config points the ``traffic`` resource at that range of the capture directory
(``_capture_config``), so the run's traffic assets read the capture, not the trace file. Each deployment's
record is kept (``DriftConfig.record_for``): the schedule re-tunes each on its own capture; the drift sensors
watch the latest deployment's (``DriftConfig.record``).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import dagster as dg

from assets.resources import TrafficSource

WORKLOAD_GROUP = "workloads"  # assets/workloads.py's group: the non-LLM workloads' graph, its own job
OPTIMIZE_JOB = dg.define_asset_job("reoptimize",
                                   selection=dg.AssetSelection.all() - dg.AssetSelection.groups(WORKLOAD_GROUP),
                                   description="Re-run the whole optimization graph for one LLM deployment.")

WINDOW = 2000  # the newest records since the last build (or the last firing) that the traffic sensor profiles


class DriftConfig(dg.ConfigurableResource):
    """Where the deployed build's record lives, and the drift thresholds."""

    deployment_record: str = ".polyinf/artifacts/deployments/current.json"
    input_p50_ratio: float = 0.5
    input_p90_ratio: float = 0.5
    output_p50_ratio: float = 0.5
    arrival_rate_ratio: float = 1.0
    prefix_reuse_delta: float = 0.2
    min_requests: int = 20
    confirmations: int = 1
    min_interval_s: float = 3600.0
    deployments: list[str] = []  # partition keys (model|device|endpoint) to tune besides the one on record

    def thresholds(self):
        from ops.release.drift import DriftThresholds

        return DriftThresholds(self.input_p50_ratio, self.input_p90_ratio, self.output_p50_ratio,
                               self.arrival_rate_ratio, self.prefix_reuse_delta, self.min_requests,
                               self.confirmations, self.min_interval_s)

    def record(self):
        """The ops.release.drift.DeploymentRecord of the latest deployed build, or None before the first deployment."""
        from ops.release.drift import DeploymentRecord

        return DeploymentRecord.load(Path(self.deployment_record))

    def record_for(self, key: str):
        """The record of the deployment partition ``key`` (each deployment's is kept beside the latest), or None."""
        from assets.deployments import record_file
        from ops.release.drift import DeploymentRecord

        latest = self.record()
        if latest is not None and latest.partition_key == key:
            return latest
        return DeploymentRecord.load(record_file(Path(self.deployment_record).parent, key))

    def records(self) -> list:
        """Every deployment's record: the latest, and each one kept beside it."""
        from ops.release.drift import DeploymentRecord

        folder = Path(self.deployment_record).parent
        found = [DeploymentRecord.load(p) for p in sorted(folder.glob("*.json"))] if folder.is_dir() else []
        latest = self.record()
        by_key = {r.partition_key: r for r in found if r is not None and r.partition_key}
        return [*([latest] if latest is not None else []),
                *(r for k, r in by_key.items() if latest is None or k != latest.partition_key)]


def _capture_config(traffic: TrafficSource, capture) -> dict:
    """Run config that makes a run's ``traffic`` resource read ``capture`` (an ops.release.drift.CaptureSlice).

    Run config replaces a resource's whole configuration (Dagster does not merge it with the values the
    Definitions gave), so the rest of the traffic settings come from this code location's own resource."""
    return {"resources": {"traffic": {"config": {
        **traffic.model_dump(), "capture_dir": capture.capture_dir, "capture_from": capture.start,
        "capture_until": capture.end}}}}


def _since_build(record, traffic: TrafficSource, min_requests: int) -> tuple[dict, str]:
    """(run config, what it tunes on) for a run re-tuning the deployment on record: the traffic captured since
    its build went live, or, with fewer than ``min_requests`` records there, the resource's trace file."""
    from ops.release.drift import read_capture

    if record.capture_dir:
        capture = read_capture(record.capture_dir, record.capture_start, lenient=True)
        if len(capture.records) >= min_requests:
            return _capture_config(traffic, capture), f"capture {capture.capture_dir} [{capture.start}, {capture.end})"
        return {}, f"trace file {traffic.trace} ({len(capture.records)} records captured since the build)"
    return {}, f"trace file {traffic.trace} (the deployment captures nothing)"


@dg.schedule(job=OPTIMIZE_JOB, cron_schedule="0 3 * * *", name="nightly_reoptimization",
             description="Re-optimize every deployment every night on the traffic captured since its last build.")
def nightly(context: dg.ScheduleEvaluationContext, drift: DriftConfig, traffic: TrafficSource):
    from engine.workloads.workload import WORKLOADS

    # the LLM deployments (a workload's key, model = a workload's name, is the optimize_workload job's)
    keys = [k for k in context.instance.get_dynamic_partitions("deployments") if k.split("|")[0] not in WORKLOADS]
    if not keys:
        return dg.SkipReason("no deployments yet")
    requests = []
    for key in keys:
        run_config, tuned_on = {}, f"trace file {traffic.trace}"
        record = drift.record_for(key)
        if record is not None:  # a deployment whose capture is on record
            run_config, tuned_on = _since_build(record, traffic, drift.min_requests)
        requests.append(dg.RunRequest(run_key=f"nightly-{key}-{context.scheduled_execution_time:%Y%m%d}",
                                      partition_key=key, run_config=run_config,
                                      tags={"polyinf/trigger": "nightly schedule", "polyinf/traffic": tuned_on[:200]}))
    return requests


def _cursor(context) -> dict:
    try:
        return json.loads(context.cursor) if context.cursor else {}
    except json.JSONDecodeError:
        return {}


@dg.sensor(job=OPTIMIZE_JOB, minimum_interval_seconds=60,
           description="Fires when the live endpoint's captured traffic drifts from what its build was tuned on.")
def traffic_drift_sensor(context: dg.SensorEvaluationContext, drift: DriftConfig, traffic: TrafficSource):
    from ops.release.drift import read_capture, traffic_drift
    from ops.traffic.traces import profile

    record = drift.record()
    if record is None or not record.capture_dir:
        return dg.SkipReason("no deployment with a capture directory to watch")
    t = drift.thresholds()
    # The cursor holds where the window starts (a capture position: the build's first record, moved past what
    # a firing acted on), the drift streak (hysteresis) and when it last fired (minimum interval). A new
    # deployment starts a new window and streak; the minimum interval spans deployments.
    cur = _cursor(context)
    deployment = f"{record.variant_id}@{record.deployed_at}"
    if cur.get("deployment") != deployment:
        cur = {"last_fired": cur.get("last_fired", 0.0)}
    start = max(record.capture_start, cur.get("window_from", 0))
    capture = read_capture(record.capture_dir, start, lenient=True)
    window = capture.records[-WINDOW:]
    state = {"deployment": deployment, "window_from": start, "seen": capture.end, "streak": cur.get("streak", 0),
             "last_fired": cur.get("last_fired", 0.0)}
    if len(window) < t.min_requests:
        context.update_cursor(json.dumps(state))
        return dg.SkipReason(f"{len(window)} live requests so far; {t.min_requests} needed")
    reasons = traffic_drift(profile(window), record.traffic_profile, t)
    state["streak"] = state["streak"] + 1 if reasons else 0
    now = time.time()
    if not reasons:
        context.update_cursor(json.dumps(state))
        return dg.SkipReason("live traffic matches the deployed build's profile")
    if state["streak"] < t.confirmations:
        context.update_cursor(json.dumps(state))
        return dg.SkipReason(f"drift seen {state['streak']}/{t.confirmations} times: waiting for confirmation")
    if now - max(state["last_fired"], record.deployed_at) < t.min_interval_s:
        context.update_cursor(json.dumps(state))
        return dg.SkipReason("drifted, but inside the minimum interval since the last re-optimization: "
                             + "; ".join(reasons))
    state.update(last_fired=now, streak=0, window_from=capture.end)  # the next window starts after this one
    context.update_cursor(json.dumps(state))
    return dg.RunRequest(run_key=f"traffic-drift-{int(now)}", partition_key=record.partition_key or None,
                         run_config=_capture_config(traffic, capture), tags={
                             "polyinf/trigger": "traffic drift", "polyinf/reason": "; ".join(reasons)[:200],
                             "polyinf/traffic": f"capture {capture.capture_dir} [{capture.start}, {capture.end})"})


@dg.sensor(job=OPTIMIZE_JOB, minimum_interval_seconds=300,
           description="Fires when the served model's weights or config change.")
def model_drift_sensor(context: dg.SensorEvaluationContext, drift: DriftConfig):
    from engine import resolve
    from engine.errors import EngineError
    from ops.measure.model_spec import weights_hash

    record = drift.record()
    if record is None:
        return dg.SkipReason("nothing deployed yet")
    try:
        current = weights_hash(resolve(record.model))
    except (EngineError, OSError) as e:
        return dg.SkipReason(f"cannot read the model: {e}")
    cur = _cursor(context)
    if current == record.model_weights_hash or cur.get("fired_for") == current:
        return dg.SkipReason("the model's weights and config are unchanged")
    context.update_cursor(json.dumps({"fired_for": current}))
    return dg.RunRequest(run_key=f"model-drift-{current}", partition_key=record.partition_key or None, tags={
        "polyinf/trigger": "model drift",
        "polyinf/reason": f"weights hash {record.model_weights_hash} -> {current} for {record.model}"})


@dg.sensor(job=OPTIMIZE_JOB, minimum_interval_seconds=300,
           description="Fires when the hardware the deployment runs on changes (device model, count or driver): "
                       "its build was tuned for other hardware.")
def hardware_drift_sensor(context: dg.SensorEvaluationContext, drift: DriftConfig, traffic: TrafficSource):
    from ops.release.drift import HardwareIdentity, hardware_identity

    record = drift.record()
    if record is None:
        return dg.SkipReason("nothing deployed yet")
    if not record.hardware:
        return dg.SkipReason("the deployment record names no hardware to compare with")
    tuned = HardwareIdentity.from_json(record.hardware)
    current = hardware_identity(tuned.backend)  # a look at the devices, not a benchmark
    changes = current.changes_from(tuned)
    if not changes:
        return dg.SkipReason(f"the hardware is unchanged ({tuned.key})")
    if _cursor(context).get("fired_for") == current.key:
        return dg.SkipReason(f"already re-tuning for hardware {current.key}: " + "; ".join(changes))
    context.update_cursor(json.dumps({"fired_for": current.key}))
    run_config, tuned_on = _since_build(record, traffic, drift.min_requests)
    return dg.RunRequest(run_key=f"hardware-drift-{current.key}-{int(record.deployed_at)}",
                         partition_key=record.partition_key or None, run_config=run_config, tags={
                             "polyinf/trigger": "hardware drift", "polyinf/reason": "; ".join(changes)[:200],
                             "polyinf/hardware": current.key, "polyinf/traffic": tuned_on[:200]})


@dg.sensor(minimum_interval_seconds=60,
           description="Registers a partition for each deployment it sees (the configured ones, those on record), "
                       "so the schedule and the drift sensors tune each of them from this one code location.")
def deployments_sensor(context: dg.SensorEvaluationContext, drift: DriftConfig):
    from assets.deployments import DEPLOYMENTS, Deployment

    seen = [*drift.deployments, *(r.partition_key for r in drift.records() if r.partition_key)]
    keys = []
    for key in dict.fromkeys(seen):
        try:
            keys.append(Deployment.parse(key).key)
        except ValueError as e:
            context.log.warning(f"not a deployment: {e}")
    known = set(context.instance.get_dynamic_partitions(DEPLOYMENTS.name))
    new = [k for k in keys if k not in known]
    if not new:
        return dg.SkipReason(f"{len(keys)} deployment(s) seen, all registered" if keys else "no deployments seen")
    return dg.SensorResult(dynamic_partitions_requests=[DEPLOYMENTS.build_add_request(new)])
