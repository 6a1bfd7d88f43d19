"""Drift sensors through build_sensor_context, with cursors."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import dagster as dg

from engine.capture import CaptureWriter
from engine.trace_record import TraceRecord
from ops.drift import DeploymentRecord
from ops.traces import load_trace, profile
from pipelines.sensors import DriftConfig, model_drift_sensor, traffic_drift_sensor

ROOT = Path(__file__).resolve().parents[2]
AZURE = ROOT.parent / "shared" / "traces" / "AzureLLMInferenceTrace_conv.csv"
TINY = ROOT / "tests" / "engine" / "tiny_moe"


def _setup(tmp_path, scale: float, deployed_ago: float = 7200.0, n: int = 200):
    base = load_trace(AZURE)[:n]
    tuned = profile(base)
    cap = tmp_path / "capture"
    w = CaptureWriter(cap)
    for r in base:  # the live endpoint's captured traffic, input lengths scaled
        w.write(TraceRecord(arrival_s=r.arrival_s, input_tokens=int(r.input_tokens * scale),
                            output_tokens=r.output_tokens, source="capture"))
    w.close()
    rec = tmp_path / "deployments" / "current.json"
    DeploymentRecord(endpoint="http://127.0.0.1:1", variant_id="v1", traffic_profile=tuned.to_json(),
                     model_weights_hash="h", model=str(TINY), deployed_at=time.time() - deployed_ago,
                     capture_dir=str(cap), partition_key="smollm2|cpu|embedded").save(rec)
    return DriftConfig(deployment_record=str(rec), min_interval_s=3600.0)


def _evaluate(sensor, drift, cursor=None):
    ctx = dg.build_sensor_context(cursor=cursor, resources={"drift": drift})
    result = sensor(ctx)
    return result, ctx.cursor


def test_grown_prompts_fire_and_unchanged_do_not(tmp_path):
    drift = _setup(tmp_path / "a", scale=1.8)
    result, cursor = _evaluate(traffic_drift_sensor, drift)
    assert isinstance(result, dg.RunRequest)
    assert "input_p50" in result.tags["polyinf/reason"] and "+80%" in result.tags["polyinf/reason"]
    assert result.tags["polyinf/trigger"] == "traffic drift"
    assert result.partition_key == "smollm2|cpu|embedded"  # re-optimizes the deployment that drifted
    # the same records are not counted again: the cursor holds what was seen
    again, _ = _evaluate(traffic_drift_sensor, drift, cursor)
    assert isinstance(again, dg.SkipReason) and "live requests so far" in again.skip_message
    same = _setup(tmp_path / "b", scale=1.0)
    result, _ = _evaluate(traffic_drift_sensor, same)
    assert isinstance(result, dg.SkipReason) and "matches" in result.skip_message


def test_second_drift_inside_the_minimum_interval_does_not_fire(tmp_path):
    drift = _setup(tmp_path, scale=1.8)
    first, cursor = _evaluate(traffic_drift_sensor, drift)
    assert isinstance(first, dg.RunRequest)
    # more drifted traffic arrives right away
    w = CaptureWriter(tmp_path / "capture")
    for i in range(50):
        w.write(TraceRecord(arrival_s=10_000.0 + i, input_tokens=3000, output_tokens=100, source="capture"))
    w.close()
    second, _ = _evaluate(traffic_drift_sensor, drift, cursor)
    assert isinstance(second, dg.SkipReason) and "minimum interval" in second.skip_message
    recent = _setup(tmp_path / "recent", scale=1.8, deployed_ago=60.0)  # deployed a minute ago
    result, _ = _evaluate(traffic_drift_sensor, recent)
    assert isinstance(result, dg.SkipReason) and "minimum interval" in result.skip_message


def test_hysteresis_needs_confirmations(tmp_path):
    drift = _setup(tmp_path, scale=1.8)
    drift = DriftConfig(**{**drift.model_dump(), "confirmations": 2})
    first, cursor = _evaluate(traffic_drift_sensor, drift)
    assert isinstance(first, dg.SkipReason) and "1/2" in first.skip_message


def test_changed_weights_fire_the_model_drift_sensor(tmp_path):
    from engine import resolve
    from ops.model_spec import weights_hash

    model = tmp_path / "model"
    shutil.copytree(TINY, model)
    rec = tmp_path / "current.json"
    DeploymentRecord(endpoint="x", variant_id="v", traffic_profile={}, model_weights_hash=weights_hash(
        resolve(str(model))), model=str(model), deployed_at=0.0).save(rec)
    drift = DriftConfig(deployment_record=str(rec))
    result, cursor = _evaluate(model_drift_sensor, drift)
    assert isinstance(result, dg.SkipReason) and "unchanged" in result.skip_message
    cfg = json.loads((model / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (model / "config.json").write_text(json.dumps(cfg))
    result, cursor = _evaluate(model_drift_sensor, drift, cursor)
    assert isinstance(result, dg.RunRequest) and result.tags["polyinf/trigger"] == "model drift"
    assert "weights hash" in result.tags["polyinf/reason"]
    again, _ = _evaluate(model_drift_sensor, drift, cursor)  # fired once for this change, not on every tick
    assert isinstance(again, dg.SkipReason)


def test_nightly_schedule_requests_every_deployment():
    from pipelines.sensors import nightly

    with dg.instance_for_test() as instance:
        assert isinstance(nightly(dg.build_schedule_context(instance=instance)), dg.SkipReason)
        instance.add_dynamic_partitions("deployments", ["smollm2|cpu|embedded", "llama|cuda|http://x"])
        import datetime

        when = datetime.datetime(2026, 12, 1, 3, 0, tzinfo=datetime.timezone.utc)
        requests = nightly(dg.build_schedule_context(instance=instance, scheduled_execution_time=when))
        assert {r.run_key for r in requests} == {"nightly-smollm2|cpu|embedded-20261201", "nightly-llama|cuda|http://x-20261201"}
        assert sorted(r.partition_key for r in requests) == ["llama|cuda|http://x", "smollm2|cpu|embedded"]
