"""Past one machine: the shared services' settings, secrets through dg.EnvVar, outputs through S3, deployments as
partitions registered by a sensor, and the whole graph with every step in its own process against a real S3
server (moto) and a real Postgres board, deploying to a running engine by its URL."""
from __future__ import annotations

import datetime
import os
import pickle
from pathlib import Path

import boto3
import dagster as dg
import httpx
import pytest

from assets import pipeline
from assets.deployments import Deployment, deployment_key, for_deployment, record_file
from assets.resources import Endpoint, EngineRunner, TrafficSource
from engine.generated.isolation import without_secrets
from pipelines.sensors import DriftConfig, deployments_sensor
from pipelines.wiring import Services, code_location_resources

ROOT = Path(__file__).resolve().parents[2]
AZURE = ROOT / "traces" / "AzureLLMInferenceTrace_conv.csv"


@pytest.mark.parametrize("settings, message", [
    ({"board": "postgresql://polyinf:hunter22@db/board"}, "POLYINF_BOARD postgresql://polyinf:\\*\\*\\*@db/board "
                                                          "holds a password.*POLYINF_BOARD_PASSWORD"),
    ({"board": "mysql://db/board"}, "not a postgresql:// URL"),
    ({"s3_bucket": "My_Bucket"}, "not an S3 bucket name"),
    ({"s3_prefix": "/runs/"}, "without leading or trailing /"),
    ({"s3_endpoint_url": "minio:9000"}, "not an http\\(s\\) URL"),
    ({"deployments": ("smollm2|tpu|embedded",)}, "device 'tpu' is not cpu, cuda or cuda:N"),
    ({"deployments": ("smollm2|cpu",)}, "is not model\\|device\\|endpoint"),
    ({"deployments": ("smollm2|cpu|engine:8000",)}, "not an http\\(s\\) URL"),
])
def test_bad_service_settings_are_refused_clearly(settings, message):
    with pytest.raises(ValueError, match=message) as err:
        Services(**settings)
    assert "hunter22" not in str(err.value)


def test_secrets_reach_resources_as_env_vars_never_as_values(monkeypatch):
    secrets = {"POLYINF_BOARD_PASSWORD": "board-secret", "AWS_ACCESS_KEY_ID": "key-id-secret",
               "AWS_SECRET_ACCESS_KEY": "aws-secret", "POLYINF_ADMIN_TOKEN": "admin-secret",
               "OPENAI_API_KEY": "llm-secret"}
    env = {**secrets, "POLYINF_BOARD": "postgresql://polyinf@db:5432/board", "POLYINF_S3_BUCKET": "runs",
           "POLYINF_ENDPOINT_URL": "http://polyinf-engine:8000", "POLYINF_CAPTURE_DIR": "/shared/capture",
           "POLYINF_ARTIFACTS": "/shared/artifacts", "POLYINF_DTYPE": "bfloat16"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    res = code_location_resources()
    fields = {("source", "board_password"): "POLYINF_BOARD_PASSWORD", ("source", "llm_api_key"): "OPENAI_API_KEY",
              ("endpoint", "admin_token"): "POLYINF_ADMIN_TOKEN",
              ("artifacts", "aws_access_key_id"): "AWS_ACCESS_KEY_ID",
              ("artifacts", "aws_secret_access_key"): "AWS_SECRET_ACCESS_KEY"}
    for (resource, field), name in fields.items():
        value = getattr(res[resource], field)
        assert isinstance(value, dg.EnvVar) and value == name, (resource, field, value)
    s3 = res["io_manager"].s3_resource
    assert (s3.aws_access_key_id, s3.aws_secret_access_key) == ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    assert isinstance(s3.aws_secret_access_key, dg.EnvVar)
    assert res["source"].board == env["POLYINF_BOARD"] and res["endpoint"].url == env["POLYINF_ENDPOINT_URL"]
    assert res["endpoint"].capture_dir == "/shared/capture" and res["runner"].dtype == "bfloat16"
    assert res["drift"].deployment_record == res["endpoint"].deployment_record == \
        "/shared/artifacts/deployments/current.json"  # where the deploy step writes, the sensors read
    # nothing a child process of ours (the embedded server) inherits holds one
    assert not set(secrets.values()) & set(without_secrets().values())
    assert "PGPASSWORD" not in without_secrets({"PGPASSWORD": "x"})


def test_an_endpoint_url_without_its_token_fails_naming_the_variable(monkeypatch):
    monkeypatch.delenv("POLYINF_ADMIN_TOKEN", raising=False)
    with pytest.raises(dg.Failure, match="no admin token.*POLYINF_ADMIN_TOKEN"):
        Endpoint(url="http://polyinf-engine:8000").connect(EngineRunner())


def test_a_partition_key_names_the_model_device_and_endpoint():
    key = deployment_key("/models/llama", "cuda", "http://polyinf-engine:8000")
    assert key == "/models/llama|cuda|http://polyinf-engine:8000"
    assert Deployment.parse(key) == Deployment("/models/llama", "cuda", "http://polyinf-engine:8000")
    assert Deployment.parse("smollm2|cpu|embedded").endpoint == ""

    @dg.asset(partitions_def=pipeline.DEPLOYMENTS)
    def derived(context, runner: EngineRunner, endpoint: Endpoint):
        r, e = for_deployment(context, runner, endpoint)
        return (r.model, r.device, r.dtype, r.fast_layers, e.url, e.watch_requests)

    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("deployments", [key, "smollm2|cpu|embedded"])
        res = {"runner": EngineRunner(dtype="bfloat16", fast_layers=2),
               "endpoint": Endpoint(url="http://elsewhere:1", watch_requests=3)}
        out = [dg.materialize([derived], resources=res, partition_key=k, instance=instance).output_for_node("derived")
               for k in (key, "smollm2|cpu|embedded")]
    # the key's model, device and endpoint; the rest from the resources
    assert out == [("/models/llama", "cuda", "bfloat16", 2, "http://polyinf-engine:8000", 3),
                   ("smollm2", "cpu", "bfloat16", 2, "", 3)]


def _record(folder: Path, key: str, latest: bool = False, capture_dir: str = "", capture_start: int = 0):
    from ops.release.drift import DeploymentRecord

    rec = DeploymentRecord(endpoint=Deployment.parse(key).endpoint, variant_id="v1", traffic_profile={},
                           model_weights_hash="h", model="smollm2", deployed_at=0.0, capture_dir=capture_dir,
                           partition_key=key, capture_start=capture_start)
    rec.save(record_file(folder, key))  # what the deploy step writes: each deployment's record, and the latest
    if latest:
        rec.save(folder / "current.json")


def test_the_sensor_registers_each_deployment_it_sees(tmp_path):
    _record(tmp_path, "qwen|cuda|http://qwen:8000")
    _record(tmp_path, "smollm2|cuda|http://polyinf-engine:8000", latest=True)
    drift = DriftConfig(deployment_record=str(tmp_path / "current.json"),
                        deployments=["/models/llama|cuda|http://llama:8000", "not a key"])
    with dg.instance_for_test() as instance:
        with dg.build_sensor_context(instance=instance, resources={"drift": drift}) as ctx:
            result = deployments_sensor(ctx)
        assert isinstance(result, dg.SensorResult)
        (request,) = result.dynamic_partitions_requests
        assert request.partitions_def_name == "deployments"
        assert list(request.partition_keys) == ["/models/llama|cuda|http://llama:8000",
                                                "smollm2|cuda|http://polyinf-engine:8000", "qwen|cuda|http://qwen:8000"]
        instance.add_dynamic_partitions("deployments", list(request.partition_keys))
        with dg.build_sensor_context(instance=instance, resources={"drift": drift}) as ctx:
            again = deployments_sensor(ctx)
        assert isinstance(again, dg.SkipReason) and "all registered" in again.skip_message


def test_the_schedule_retunes_each_deployment_on_its_own_capture(tmp_path):
    """Two deployments on record, each capturing its own traffic: each nightly run reads its own capture since
    its own build, not the latest deployment's."""
    from engine.serving.capture import CaptureWriter
    from engine.serving.trace_record import TraceRecord
    from pipelines.sensors import nightly

    keys = {"a": "smollm2|cpu|http://a:8000", "b": "qwen|cuda|http://b:8000"}
    for name, n in (("a", 30), ("b", 50)):
        w = CaptureWriter(tmp_path / name)
        for i in range(n):
            w.write(TraceRecord(arrival_s=float(i), input_tokens=10 + i, output_tokens=4, source="capture"))
        w.close()
        _record(tmp_path / "records", keys[name], latest=name == "b", capture_dir=str(tmp_path / name),
                capture_start=5)
    drift = DriftConfig(deployment_record=str(tmp_path / "records" / "current.json"), min_requests=10)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("deployments", [*keys.values(), "llama|cuda|http://c:8000"])
        when = datetime.datetime(2026, 12, 1, 3, 0, tzinfo=datetime.timezone.utc)
        with dg.build_schedule_context(instance=instance, scheduled_execution_time=when, resources={
                "drift": drift, "traffic": TrafficSource(trace=str(AZURE))}) as context:
            requests = {r.partition_key: r for r in nightly(context)}
    for name, n in (("a", 30), ("b", 50)):
        config = requests[keys[name]].run_config["resources"]["traffic"]["config"]
        assert (config["capture_dir"], config["capture_from"], config["capture_until"]) == (str(tmp_path / name), 5, n)
    assert not requests["llama|cuda|http://c:8000"].run_config  # nothing on record: the trace file


def test_outputs_go_to_s3_and_a_fresh_instance_reads_them_there(s3_server, tmp_path):
    """The traffic assets' outputs through the S3 IO manager: a later run in another Dagster instance (another
    pod's disk) loads traffic_traces from the bucket to build traffic_profile."""
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").create_bucket(Bucket="runs")
    io = Services(s3_bucket="runs", s3_prefix="t1", s3_endpoint_url=s3_server).io_manager()
    traffic = TrafficSource(trace=str(AZURE), max_requests=8)
    key = "smollm2|cpu|embedded"
    for i, assets in enumerate(([pipeline.traffic_traces], [pipeline.traffic_traces.to_source_asset(),
                                                            pipeline.traffic_profile])):
        (tmp_path / f"home{i}").mkdir()
        with dg.instance_for_test(temp_dir=str(tmp_path / f"home{i}")) as instance:
            instance.add_dynamic_partitions("deployments", [key])
            run = dg.materialize(assets, resources={"traffic": traffic, **io}, partition_key=key, instance=instance)
            assert run.success
    assert run.output_for_node("traffic_profile").requests == 8
    keys = [o["Key"] for o in boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").list_objects_v2(
        Bucket="runs")["Contents"]]
    assert sorted(keys) == [f"t1/io/traffic_profile/{key}", f"t1/io/traffic_traces/{key}"]
    assert not list(tmp_path.rglob("storage/traffic_*"))  # nothing on the instances' local storage


@pytest.mark.slow
def test_every_step_in_its_own_process_shares_only_real_services(postgres_server, postgres_url, s3_server, tmp_path,
                                                                  monkeypatch):
    """The code location's job (pipelines/definitions.py) with the multiprocess executor: each step a fresh
    process loading the definitions anew, as a pod would. What one step leaves for another can only be in moto's
    S3 (outputs, artifacts), on the Postgres board (the search, its queue and results) or behind the running
    engine's URL (the deployment); the settings the smallest end-to-end test uses (tests/pipelines/test_optimize.py)."""
    from dagster._core.definitions.reconstruct import ReconstructableRepository

    from assets.resources import EngineRunner as Runner
    from ops.search.board import Board
    from ops.search.board_store import with_password
    from ops.release.deploy import ServerProcess
    from ops.release.drift import DeploymentRecord

    password = postgres_server.password
    monkeypatch.delenv("PGPASSWORD")  # the board's password reaches the steps only through dg.EnvVar
    s3 = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    s3.create_bucket(Bucket="polyinf-runs")
    shared = tmp_path / "shared"  # the volume the engine and the code location mount
    # the engine Deployment, serving a form no build of this run is (3 sequences), so the deploy step must swap it
    engine = ServerProcess([*Runner().model_args(), "--max-num-seqs", "3"], "polyinf", shared / "capture")
    try:
        for k, v in {"POLYINF_BOARD": postgres_url, "POLYINF_BOARD_PASSWORD": password,
                     "POLYINF_S3_BUCKET": "polyinf-runs", "POLYINF_S3_ENDPOINT_URL": s3_server,
                     "POLYINF_ARTIFACTS": str(shared / "artifacts"), "POLYINF_CAPTURE_DIR": str(shared / "capture"),
                     "POLYINF_ENDPOINT_URL": engine.url, "POLYINF_ADMIN_TOKEN": engine.token,
                     "POLYINF_TRACE": str(AZURE)}.items():
            monkeypatch.setenv(k, v)
        serving_before = httpx.get(engine.url + "/admin/variant", headers={"Authorization": f"Bearer {engine.token}"}
                                   ).json()["active"]["variant_id"]
        key = deployment_key("smollm2", "cpu", engine.url)
        traffic = TrafficSource(trace=str(AZURE), max_requests=6, max_input=96, max_output=6, time_scale=0.02)
        run_config = {"resources": {
            "traffic": {"config": traffic.model_dump()},
            "runner": {"config": {"fast_layers": 2}},
            "source": {"config": {"board": postgres_url, "board_password": {"env": "POLYINF_BOARD_PASSWORD"},
                                  "candidates": 1, "precision": False, "slow_layers": 4, "judge_seconds": 12}}},
            "execution": {"config": {"multiprocess": {"max_concurrent": 2}}}}
        home = tmp_path / "dagster"
        home.mkdir()
        instance = dg.DagsterInstance.local_temp(tempdir=str(home))
        instance.add_dynamic_partitions("deployments", [key])
        job = ReconstructableRepository.for_module("pipelines.definitions", "defs", working_directory=str(ROOT)
                                                   ).get_reconstructable_job("reoptimize")
        with dg.execute_job(job, instance, run_config=run_config, tags={"dagster/partition": key}) as result:
            events = instance.all_logs(result.run_id)
            failures = [e.message for e in events if e.dagster_event and e.dagster_event.is_failure]
            assert result.success, failures

        def output(asset: str):
            (obj,) = s3.list_objects_v2(Bucket="polyinf-runs", Prefix=f"polyinf/io/{asset}/")["Contents"]
            return pickle.loads(s3.get_object(Bucket="polyinf-runs", Key=obj["Key"])["Body"].read())
        dep, build = output("deployed_endpoint"), output("engine_build")
        starts = [e for e in events if e.dagster_event and e.dagster_event.event_type_value == "STEP_START"]
        pids = [e.dagster_event.pid for e in starts]
        assert len(starts) >= 10 and len(set(pids)) == len(starts) and os.getpid() not in pids  # a process per step
        # the outputs are in the bucket, the artifacts beside them; none on the instance's or the shared disk
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket="polyinf-runs")["Contents"]]
        assets = {k.to_user_string() for a in dg.load_assets_from_modules([pipeline]) for k in a.keys}
        assert {k.split("/")[2] for k in keys if k.startswith("polyinf/io/")} == assets, keys
        assert f"polyinf/builds/{build.source_hash}.json" in keys
        assert not [p for p in home.rglob("*") if p.name in assets] and not list(shared.rglob("*.sqlite"))
        # the search, its queue and its results on the Postgres board
        board = Board(with_password(postgres_url, password))
        search = build.provenance["search"]
        assert board.counts(search).get("done", 0) >= 3 and build.provenance["board"] == postgres_url
        # the running engine was swapped (not a server on loopback started by the step) and the swap recorded
        active = httpx.get(engine.url + "/admin/variant", headers={"Authorization": f"Bearer {engine.token}"}
                           ).json()["active"]["variant_id"]
        assert dep.endpoint == engine.url and dep.status in ("deployed", "rolled back") and active == dep.build_id
        assert dep.previous_build == serving_before and (dep.status == "rolled back") == (active == serving_before)
        records = shared / "artifacts" / "deployments"
        record = DeploymentRecord.load(records / "current.json")
        assert record.partition_key == key and record.capture_dir == str(shared / "capture")
        assert DeploymentRecord.load(record_file(records, key)) == record
        # no secret in the run's event log
        text = "\n".join(str(e.message) + str(e.user_message) for e in events)
        assert password not in text and engine.token not in text
    finally:
        engine.stop()
