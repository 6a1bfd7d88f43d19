"""Drift sensors and the nightly schedule through build_sensor_context / build_schedule_context, with cursors,
real capture files, and the traffic assets materialized with the run config the sensors request."""
from __future__ import annotations

import dataclasses
import datetime
import json
import shutil
import time
from pathlib import Path

import dagster as dg
import pytest

from assets import pipeline
from assets.resources import TrafficSource
from engine.serving.capture import CaptureWriter
from engine.serving.trace_record import TraceRecord
from ops.release.drift import DeploymentRecord, HardwareIdentity, capture_position, hardware_identity, read_capture
from ops.traffic.traces import load_trace, profile
from pipelines.sensors import DriftConfig, hardware_drift_sensor, model_drift_sensor, nightly, traffic_drift_sensor

ROOT = Path(__file__).resolve().parents[2]
AZURE = ROOT / "traces" / "AzureLLMInferenceTrace_conv.csv"
TINY = ROOT / "tests" / "engine" / "tiny_moe"
KEY = "smollm2|cpu|embedded"


def _serve(cap: Path, base: list[TraceRecord], scale: float, after: float = 0.0) -> float:
    """Captures ``base`` as the live endpoint would, prompts scaled, arriving from ``after`` on; returns the
    last arrival."""
    w = CaptureWriter(cap)
    for r in base:
        w.write(TraceRecord(arrival_s=after + r.arrival_s, input_tokens=int(r.input_tokens * scale),
                            output_tokens=r.output_tokens, source="capture"))
    w.close()
    return after + base[-1].arrival_s


def _deploy(tmp_path, tuned, cap: Path, deployed_ago: float = 7200.0, capture_start: int = 0,
            hardware: HardwareIdentity | None = None) -> Path:
    rec = tmp_path / "deployments" / "current.json"
    DeploymentRecord(endpoint="http://127.0.0.1:1", variant_id="v1", traffic_profile=tuned.to_json(),
                     model_weights_hash="h", model=str(TINY), deployed_at=time.time() - deployed_ago,
                     capture_dir=str(cap), partition_key=KEY, capture_start=capture_start,
                     hardware=(hardware or hardware_identity("cpu")).to_json()).save(rec)
    return rec


def _setup(tmp_path, scale: float, deployed_ago: float = 7200.0, n: int = 200):
    base = load_trace(AZURE)[:n]
    _serve(tmp_path / "capture", base, scale)  # the live endpoint's captured traffic, input lengths scaled
    rec = _deploy(tmp_path, profile(base), tmp_path / "capture", deployed_ago)
    return DriftConfig(deployment_record=str(rec), min_interval_s=3600.0)


def _evaluate(sensor, drift, cursor=None, traffic: TrafficSource | None = None):
    traffic = traffic or TrafficSource(trace=str(AZURE))
    with dg.build_sensor_context(cursor=cursor, resources={"drift": drift, "traffic": traffic}) as ctx:
        return sensor(ctx), ctx.cursor


def _traffic_config(request: dg.RunRequest) -> dict:
    return request.run_config["resources"]["traffic"]["config"]


def _materialize_traffic(request: dg.RunRequest):
    """The run's traffic assets, with the request's run config over a resource that names only the trace file."""
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("deployments", [request.partition_key])
        return dg.materialize([pipeline.traffic_traces, pipeline.traffic_profile, pipeline.traffic_traces_expectations],
                              resources={"traffic": TrafficSource(trace=str(AZURE))}, run_config=request.run_config,
                              partition_key=request.partition_key, instance=instance)


def _metadata(result, asset: str) -> dict:
    (mat,) = result.asset_materializations_for_node(asset)
    return {k: v.value for k, v in mat.metadata.items()}


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


def test_the_run_tunes_on_the_capture_since_the_build(tmp_path):
    base = load_trace(AZURE)[:200]
    cap = tmp_path / "capture"
    end = _serve(cap, base, 1.0)  # what the previous build served, before this one went live
    start = capture_position(cap)
    _serve(cap, base, 1.8, after=end + 1.0)  # since the build went live: prompts grew 1.8x
    rec = _deploy(tmp_path, profile(base), cap, capture_start=start)
    traffic = TrafficSource(trace=str(AZURE), max_requests=200, max_input=256)
    request, _ = _evaluate(traffic_drift_sensor, DriftConfig(deployment_record=str(rec)), traffic=traffic)
    assert isinstance(request, dg.RunRequest) and "+80%" in request.tags["polyinf/reason"]
    config = _traffic_config(request)
    assert (config["capture_dir"], config["capture_from"], config["capture_until"]) == (str(cap), 200, 400)
    assert config["max_requests"] == 200 and config["max_input"] == 256  # the rest of the resource carried over
    assert config["trace"] == str(AZURE)

    run = _materialize_traffic(request)
    assert run.success
    tuned, live = profile(base), run.output_for_node("traffic_profile")
    assert live.requests == 200 and live.sources == ("capture",)  # only the records since the build
    assert live.input_p50 == pytest.approx(1.8 * tuned.input_p50, rel=0.01)
    assert live.input_p90 == pytest.approx(1.8 * tuned.input_p90, rel=0.01)
    assert [c.passed for c in run.get_asset_check_evaluations()] == [True]
    for asset in ("traffic_traces", "traffic_profile"):  # each says which traffic it read
        md = _metadata(run, asset)
        assert md["source kind"] == "capture" and md["source"] == str(cap) and md["capture positions"] == "[200, 400)"
        assert md["window"] == f"{end + 1.0:.1f} s .. {2 * end + 1.0:.1f} s"
    assert _metadata(run, "traffic_traces")["requests"] == 200
    # the benchmark workers load the same records from a file
    replayed = load_trace(TrafficSource(**config).trace_file())
    assert [r.input_tokens for r in replayed] == [r.input_tokens for r in run.output_for_node("traffic_traces")]


def test_a_file_trace_says_so(tmp_path):
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("deployments", [KEY])
        run = dg.materialize([pipeline.traffic_traces, pipeline.traffic_profile],
                             resources={"traffic": TrafficSource(trace=str(AZURE), max_requests=8)},
                             partition_key=KEY, instance=instance)
    md = _metadata(run, "traffic_traces")
    assert (md["source kind"], md["source"], md["requests"]) == ("trace file", str(AZURE), 8)
    assert run.output_for_node("traffic_profile").sources == ("azure",)


def test_a_restarted_server_keeps_the_capture_in_order(tmp_path):
    cap = tmp_path / "capture"
    w = CaptureWriter(cap)
    for life in range(2):  # the server's clock starts at zero again after a restart
        for i in range(5):
            w.write(TraceRecord(arrival_s=10.0 * i, input_tokens=100 * life + i, output_tokens=4, e2e_s=1.0,
                                source="capture"))
    w.close()
    capture = read_capture(cap, 2)
    assert (capture.start, capture.end) == (2, 10)
    assert [r.input_tokens for r in capture.records] == [2, 3, 4, 100, 101, 102, 103, 104]
    assert capture.records[3].arrival_s == pytest.approx(41.0)  # after the first life's last finish


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


def test_alternating_traffic_retunes_at_most_once_per_interval(tmp_path):
    """A -> B -> A -> ... faster than the minimum interval: one re-tune, whose build then goes live; the swing
    back is drift against that build, yet nothing fires again until an interval has passed."""
    base = load_trace(AZURE)[:100]
    cap, scales = tmp_path / "capture", {"A": 1.0, "B": 2.5}
    rec = _deploy(tmp_path, profile(base), cap)  # tuned on A, two hours ago
    drift = DriftConfig(deployment_record=str(rec), min_interval_s=3600.0)
    traffic = TrafficSource(trace=str(AZURE), max_requests=10_000)
    clock, cursor, fired, skips = 0.0, None, [], set()
    for phase in "BABABA":
        clock = _serve(cap, base, scales[phase], after=clock + 1.0)
        for _ in range(2):  # two sensor ticks per phase
            result, cursor = _evaluate(traffic_drift_sensor, drift, cursor, traffic)
            if isinstance(result, dg.SkipReason):
                skips.add(result.skip_message.split(":")[0])
                continue
            fired.append(phase)
            run = _materialize_traffic(result)  # the re-tune's build goes live, tuned on what the run read
            DeploymentRecord(**{**json.loads(rec.read_text()), "variant_id": f"v{len(fired) + 1}",
                                "traffic_profile": run.output_for_node("traffic_profile").to_json(),
                                "deployed_at": time.time(), "capture_start": _traffic_config(result)["capture_until"]
                                }).save(rec)
    assert fired == ["B"]
    assert "drifted, but inside the minimum interval since the last re-optimization" in skips
    # an interval later, traffic settled on A drifts from the B build and re-tunes once
    state = json.loads(cursor)
    cursor = json.dumps({**state, "last_fired": state["last_fired"] - 3601})
    DeploymentRecord(**{**json.loads(rec.read_text()), "deployed_at": time.time() - 3601}).save(rec)
    for _ in range(6):
        clock = _serve(cap, base, scales["A"], after=clock + 1.0)
    results = []
    for _ in range(3):
        result, cursor = _evaluate(traffic_drift_sensor, drift, cursor, traffic)
        results.append(result)
    assert [type(r) for r in results] == [dg.RunRequest, dg.SkipReason, dg.SkipReason]
    assert "input_p50" in results[0].tags["polyinf/reason"]


def test_hysteresis_needs_confirmations(tmp_path):
    drift = _setup(tmp_path, scale=1.8)
    drift = DriftConfig(**{**drift.model_dump(), "confirmations": 2})
    first, cursor = _evaluate(traffic_drift_sensor, drift)
    assert isinstance(first, dg.SkipReason) and "1/2" in first.skip_message


def test_changed_weights_fire_the_model_drift_sensor(tmp_path):
    from engine import resolve
    from ops.measure.model_spec import weights_hash

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


@pytest.mark.parametrize("change", [{"device": "another CPU model"}, {"device_count": 4096}, {"driver": "550.54.15"}])
def test_changed_hardware_fires_the_hardware_drift_sensor(tmp_path, change):
    here, base, cap = hardware_identity("cpu"), load_trace(AZURE)[:40], tmp_path / "capture"
    _serve(cap, base, 1.0)
    rec = _deploy(tmp_path, profile(base), cap, hardware=here)
    drift = DriftConfig(deployment_record=str(rec))
    same, _ = _evaluate(hardware_drift_sensor, drift)
    assert isinstance(same, dg.SkipReason) and "unchanged" in same.skip_message
    tuned_for = dataclasses.replace(here, **change)
    assert tuned_for.key != here.key  # builds are keyed by the hardware
    _deploy(tmp_path, profile(base), cap, hardware=tuned_for)
    result, cursor = _evaluate(hardware_drift_sensor, drift)
    assert isinstance(result, dg.RunRequest) and result.tags["polyinf/trigger"] == "hardware drift"
    (field,) = change
    assert result.tags["polyinf/reason"].startswith(f"{field} ") and result.tags["polyinf/hardware"] == here.key
    assert result.partition_key == KEY
    config = _traffic_config(result)  # re-tunes on the traffic captured since the build
    assert (config["capture_dir"], config["capture_from"], config["capture_until"]) == (str(cap), 0, 40)
    again, _ = _evaluate(hardware_drift_sensor, drift, cursor)  # once per change, not on every tick
    assert isinstance(again, dg.SkipReason) and "already re-tuning" in again.skip_message


def test_a_record_without_hardware_is_not_compared(tmp_path):
    rec = tmp_path / "current.json"
    DeploymentRecord(endpoint="x", variant_id="v", traffic_profile={}, model_weights_hash="h", model="m",
                     deployed_at=0.0).save(rec)
    result, _ = _evaluate(hardware_drift_sensor, DriftConfig(deployment_record=str(rec)))
    assert isinstance(result, dg.SkipReason) and "no hardware" in result.skip_message


def _nightly(instance, drift: DriftConfig, when=None):
    # closed after use: building its resources entered the instance, which would otherwise stay current
    with dg.build_schedule_context(instance=instance, scheduled_execution_time=when,
                                   resources={"drift": drift, "traffic": TrafficSource(trace=str(AZURE))}) as context:
        return nightly(context)


def test_nightly_schedule_requests_every_deployment(tmp_path):
    drift = DriftConfig(deployment_record=str(tmp_path / "none.json"))  # nothing deployed through this location
    with dg.instance_for_test() as instance:
        assert isinstance(_nightly(instance, drift), dg.SkipReason)
        instance.add_dynamic_partitions("deployments", ["smollm2|cpu|embedded", "llama|cuda|http://x"])
        when = datetime.datetime(2026, 12, 1, 3, 0, tzinfo=datetime.timezone.utc)
        requests = _nightly(instance, drift, when)
        assert {r.run_key for r in requests} == {"nightly-smollm2|cpu|embedded-20261201", "nightly-llama|cuda|http://x-20261201"}
        assert sorted(r.partition_key for r in requests) == ["llama|cuda|http://x", "smollm2|cpu|embedded"]
        assert all(not r.run_config for r in requests)  # no capture known: the trace file


def test_nightly_schedule_tunes_on_the_capture_since_the_build(tmp_path):
    base = load_trace(AZURE)[:60]
    cap = tmp_path / "capture"
    end = _serve(cap, base, 1.0)
    rec = _deploy(tmp_path, profile(base), cap, capture_start=capture_position(cap))
    _serve(cap, base, 1.5, after=end + 1.0)
    drift = DriftConfig(deployment_record=str(rec))
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("deployments", [KEY, "llama|cuda|http://x"])
        when = datetime.datetime(2026, 12, 1, 3, 0, tzinfo=datetime.timezone.utc)
        requests = {r.partition_key: r for r in _nightly(instance, drift, when)}
    config = _traffic_config(requests[KEY])
    assert (config["capture_dir"], config["capture_from"], config["capture_until"]) == (str(cap), 60, 120)
    assert requests[KEY].tags["polyinf/traffic"] == f"capture {cap} [60, 120)"
    assert not requests["llama|cuda|http://x"].run_config  # no capture on record for that deployment
    run = _materialize_traffic(requests[KEY])
    assert [r.input_tokens for r in run.output_for_node("traffic_traces")] == \
        [int(r.input_tokens * 1.5) for r in base][-16:]  # the newest max_requests records
