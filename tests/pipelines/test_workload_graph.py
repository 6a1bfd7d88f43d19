"""The workload graph (assets/workloads.py) through the code location's ``optimize_workload`` job: a workload
partition of the deployments' partitions materializes end to end, and an LLM key is refused with a clear error."""
from __future__ import annotations

import math

import dagster as dg
import httpx
import pytest

KEY = "patchtst|cpu|embedded"
VERDICTS = {"better", "worse", "no detectable difference", "censored"}


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    """The code location's resources read the process environment, which other tests in this worker may have set
    (an endpoint URL, an admin token): each run here builds them from an environment without those."""
    for name in ("POLYINF_ADMIN_TOKEN", "POLYINF_ENDPOINT_URL", "POLYINF_API_KEY"):
        monkeypatch.delenv(name, raising=False)


def _run(instance, key):
    from assets import workloads
    from pipelines.definitions import OPTIMIZE_WORKLOAD_JOB
    from pipelines.wiring import code_location_resources

    defs = dg.Definitions(assets=dg.load_assets_from_modules([workloads]),
                          asset_checks=dg.load_asset_checks_from_modules([workloads]),
                          jobs=[OPTIMIZE_WORKLOAD_JOB], resources=code_location_resources(environ={}))
    instance.add_dynamic_partitions("deployments", [key])
    return defs.resolve_job_def("optimize_workload").execute_in_process(
        instance=instance, partition_key=key, raise_on_error=False)


def _metadata(result, step: str) -> dict:
    (mat,) = result.asset_materializations_for_node(step)
    return {k: v.value for k, v in mat.metadata.items()}


def test_workload_partition_materializes_end_to_end():
    from assets.workloads import stop_workload_servers

    try:
        with dg.DagsterInstance.ephemeral() as instance:
            result = _run(instance, KEY)
            assert result.success
            tuning = _metadata(result, "workload_tuning")
            assert tuning["verdict"] in VERDICTS
            for k in ("ratio", "ratio_low", "ratio_high"):
                assert isinstance(tuning[k], float) and math.isfinite(tuning[k])
            assert tuning["ratio_low"] <= tuning["ratio"] <= tuning["ratio_high"]
            assert tuning["rounds"] == 3
            (check,) = result.get_asset_check_evaluations()
            assert check.check_name == "workload_gate" and check.passed
            assert check.metadata["mode"].value == "bit-exact"
            assert check.metadata["variant_id"].value == tuning["chosen_variant_id"]
            deployed = _metadata(result, "workload_deployment")
            assert deployed["variant_id"] == tuning["chosen_variant_id"]
            url = deployed["endpoint"]
        # the endpoint serves on after the run, with the chosen variant
        answer = httpx.post(f"{url}/v1/workloads/patchtst/infer", json={"size": 2, "seed": 3}, timeout=60)
        assert answer.status_code == 200 and answer.json()["variant_id"] == tuning["chosen_variant_id"]
    finally:
        stop_workload_servers()


@pytest.mark.parametrize("key", ["smollm2|cpu|embedded"])
def test_a_key_that_is_not_a_workload_fails_clearly(key):
    with dg.DagsterInstance.ephemeral() as instance:
        result = _run(instance, key)
        assert not result.success
        failure = result.failure_data_for_node("workload_traffic")
        assert "'smollm2' is not a workload" in failure.error.message
        assert "reoptimize" in failure.error.message


def test_the_llm_graph_refuses_a_workload_key():
    from assets.deployments import for_deployment
    from assets.resources import EngineRunner

    context = dg.build_asset_context(partition_key=KEY)
    with pytest.raises(dg.Failure, match="optimize_workload"):
        for_deployment(context, EngineRunner())


def test_the_nightly_llm_schedule_leaves_workload_keys_out(tmp_path):
    import datetime
    from pathlib import Path

    from assets.resources import TrafficSource
    from pipelines.sensors import DriftConfig, nightly

    trace = Path(__file__).resolve().parents[2] / "traces" / "AzureLLMInferenceTrace_conv.csv"
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("deployments", ["smollm2|cpu|embedded", KEY])
        when = datetime.datetime(2026, 12, 1, 3, 0, tzinfo=datetime.timezone.utc)
        with dg.build_schedule_context(instance=instance, scheduled_execution_time=when, resources={
                "drift": DriftConfig(deployment_record=str(tmp_path / "none.json")),
                "traffic": TrafficSource(trace=str(trace))}) as context:
            requests = nightly(context)
    assert [r.partition_key for r in requests] == ["smollm2|cpu|embedded"]
