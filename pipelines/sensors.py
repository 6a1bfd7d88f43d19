"""Sensors (traffic drift, model drift) and the nightly re-optimization schedule."""
from __future__ import annotations

import json
import time
from pathlib import Path

import dagster as dg

OPTIMIZE_JOB = dg.define_asset_job("reoptimize", selection=dg.AssetSelection.all(),
                                   description="Re-run the whole optimization graph for one deployment.")


@dg.schedule(job=OPTIMIZE_JOB, cron_schedule="0 3 * * *", name="nightly_reoptimization",
             description="Re-optimize every deployment every night on the traffic captured since.")
def nightly(context: dg.ScheduleEvaluationContext):
    keys = context.instance.get_dynamic_partitions("deployments")
    if not keys:
        return dg.SkipReason("no deployments yet")
    return [dg.RunRequest(run_key=f"nightly-{key}-{context.scheduled_execution_time:%Y%m%d}", partition_key=key,
                          tags={"polyinf/trigger": "nightly schedule"}) for key in keys]


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

    def thresholds(self):
        from ops.drift import DriftThresholds

        return DriftThresholds(self.input_p50_ratio, self.input_p90_ratio, self.output_p50_ratio,
                               self.arrival_rate_ratio, self.prefix_reuse_delta, self.min_requests,
                               self.confirmations, self.min_interval_s)


def _cursor(context) -> dict:
    try:
        return json.loads(context.cursor) if context.cursor else {}
    except json.JSONDecodeError:
        return {}


@dg.sensor(job=OPTIMIZE_JOB, minimum_interval_seconds=60,
           description="Fires when the live endpoint's captured traffic drifts from what its build was tuned on.")
def traffic_drift_sensor(context: dg.SensorEvaluationContext, drift: DriftConfig):
    from engine.capture import read_capture_dir
    from ops.drift import DeploymentRecord, traffic_drift
    from ops.traces import profile

    record = DeploymentRecord.load(Path(drift.deployment_record))
    if record is None or not record.capture_dir:
        return dg.SkipReason("no deployment with a capture directory to watch")
    cur = _cursor(context)
    t = drift.thresholds()
    # the cursor remembers which captured records were already counted (by arrival time) and the drift state
    records = [r for r in read_capture_dir(record.capture_dir) if r.arrival_s > cur.get("seen_until", -1.0)]
    window = cur.get("window", []) + [[r.arrival_s, r.input_tokens, r.output_tokens] for r in records]
    window = window[-2000:]
    seen_until = max([cur.get("seen_until", -1.0)] + [r.arrival_s for r in records])
    state = {"seen_until": seen_until, "window": window, "streak": cur.get("streak", 0),
             "last_fired": cur.get("last_fired", 0.0)}
    if len(window) < t.min_requests:
        context.update_cursor(json.dumps(state))
        return dg.SkipReason(f"{len(window)} live requests so far; {t.min_requests} needed")
    from engine.trace_record import TraceRecord

    live = profile([TraceRecord(arrival_s=a, input_tokens=i, output_tokens=o) for a, i, o in window])
    reasons = traffic_drift(live, record.traffic_profile, t)
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
    state["last_fired"], state["streak"], state["window"] = now, 0, []
    context.update_cursor(json.dumps(state))
    return dg.RunRequest(run_key=f"traffic-drift-{int(now)}", partition_key=record.partition_key or None,
                         tags={"polyinf/trigger": "traffic drift", "polyinf/reason": "; ".join(reasons)[:200]})


@dg.sensor(job=OPTIMIZE_JOB, minimum_interval_seconds=300,
           description="Fires when the served model's weights or config change.")
def model_drift_sensor(context: dg.SensorEvaluationContext, drift: DriftConfig):
    from engine import resolve
    from engine.errors import EngineError
    from ops.drift import DeploymentRecord
    from ops.model_spec import weights_hash

    record = DeploymentRecord.load(Path(drift.deployment_record))
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
