"""The optimization graph end to end, and a deployment that regresses being rolled back."""
from __future__ import annotations

import pytest

from pathlib import Path

import httpx

from engine.config.variant import VariantSpec
from ops.search.kernel_templates import KernelChoice

ROOT = Path(__file__).resolve().parents[2]
AZURE = ROOT / "traces" / "AzureLLMInferenceTrace_conv.csv"
TINY = ROOT / "tests" / "engine" / "tiny_moe"


def test_definitions_load():
    from pipelines.definitions import defs

    keys = {k.to_user_string() for k in defs.resolve_asset_graph().get_all_asset_keys()}
    assert keys == {"traffic_traces", "traffic_profile", "model_spec", "hardware_profile", "cost_model_plan",
                    "variant_candidates", "fast_bench_results", "slow_bench_results", "engine_build",
                    "deployed_endpoint",
                    # the non-LLM workloads' group (assets/workloads.py), its own job
                    "workload_traffic", "workload_tuning", "workload_deployment"}
    assert {k.name for k in defs.resolve_asset_graph().asset_check_keys} == {
        "engine_build_gates", "traffic_traces_expectations", "fast_bench_expectations", "slow_bench_expectations",
        "workload_gate"}
    assert {n.name for n in defs.resolve_job_def("optimize_workload").graph.node_defs} == {
        "workload_traffic", "workload_tuning", "workload_deployment", "workload_tuning_workload_gate"}
    assert not {n.name for n in defs.resolve_job_def("reoptimize").graph.node_defs} & {
        "workload_traffic", "workload_tuning", "workload_deployment", "workload_tuning_workload_gate"}
    assert {s.name for s in defs.sensors} == {"traffic_drift_sensor", "model_drift_sensor", "hardware_drift_sensor",
                                             "deployments_sensor"}
    assert [s.cron_schedule for s in defs.schedules] == ["0 3 * * *"]


@pytest.mark.slow
def test_materialize_the_whole_graph(tmp_path, capsys):
    from pipelines.wiring import run_optimize
    from assets.resources import stop_embedded_servers

    try:
        result = run_optimize("smollm2", str(AZURE), requests=6, max_input=96, max_output=6, time_scale=0.02,
                              candidates=3, artifacts=str(tmp_path / "artifacts"), dagster_home=str(tmp_path / "dh"),
                              speculation=False, precision=False,  # both candidates: tests/ops/test_tune.py
                              judge_seconds=12,  # a verdict of any kind (the judge's rules: tests/ops/test_judge.py)
                              watch_requests=8)  # the live verification's windows (its rules: tests/ops/test_deploy*)
        assert result.success
        # recorded in a persistent instance: another process's instance on that home (`dagster dev`) sees it
        import dagster as dg

        seen = dg.DagsterInstance.local_temp(tempdir=str(tmp_path / "dh"))
        event = seen.get_latest_materialization_event(dg.AssetKey("slow_bench_results"))
        assert event is not None and event.run_id == result.run_id
        assert "SLO attainment vs rate" in event.asset_materialization.metadata
        assert result.dagster_run.tags.get("dagster/partition") == "smollm2|cpu|embedded"  # one per deployment
        profile = result.output_for_node("traffic_profile")
        assert profile.requests == 6
        plan = result.output_for_node("cost_model_plan")
        assert len(plan.entries) >= 8 and plan.entries[0].prediction.capacity >= plan.entries[-1].prediction.capacity
        candidates = result.output_for_node("variant_candidates")
        assert len(candidates) == 4 and candidates[0].name.startswith("static-best")
        fast = result.output_for_node("fast_bench_results")
        assert [v.variant_id for v, _ in fast] == [v.variant_id for v in candidates]
        assert all(r.tier == "fast" and r.layers == 4 and r.output_tok_s > 0 for _, r in fast)
        slow = result.output_for_node("slow_bench_results")
        assert len(slow) == 2 and all(r.tier == "slow" and r.layers == 30 for _, r in slow)  # static-best + the best
        meta = result.asset_materializations_for_node("slow_bench_results")[0].metadata
        table = meta["results"].value  # a Dagster table the UI sorts, typed per column
        assert isinstance(table, dg.TableMetadataValue) and len(table.records) == 2
        assert {c.name: c.type for c in table.schema.columns}["capacity req/s"] == "float"
        for title, path in meta["plot files"].value.items():  # each plot embedded and written beside the build
            assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and str(tmp_path) in path
            assert meta[title].value.startswith(f"![{title}](data:image/png;base64,")
        build = result.output_for_node("engine_build")
        assert build.variant.variant_id in {v.variant_id for v, _ in slow} and build.reason
        assert (tmp_path / "artifacts" / "builds" / f"{build.source_hash}.json").is_file()
        checks = list(result.get_asset_check_evaluations())
        assert sorted((c.asset_check_key.name, c.passed) for c in checks) == [
            ("engine_build_gates", True), ("fast_bench_expectations", True), ("slow_bench_expectations", True),
            ("traffic_traces_expectations", True)]
        dep = result.output_for_node("deployed_endpoint")
        assert dep.status in ("deployed", "rolled back", "kept")
        from assets.resources import _SERVERS

        server = _SERVERS["smollm2"]
        active = httpx.get(dep.endpoint + "/admin/variant", headers={"Authorization": f"Bearer {server.token}"}
                           ).json()["active"]["variant_id"]
        assert active == dep.build_id  # the real server runs what the deployment says it runs
        if dep.status == "deployed":
            assert active == build.variant.variant_id
        from pipelines.cli.tuning_cmds import print_optimize_report

        capsys.readouterr()
        print_optimize_report(result)  # what `polyinf optimize` prints at the end
        out = capsys.readouterr().out
        assert out.startswith("SLO: TTFT <= ") and "derived" in out.splitlines()[0]
        assert sum(v.name[:32] in out for v in candidates) == len(candidates)  # every measured variant
        assert "capacity at SLO" in out and f"decision: {build.reason}" in out and "nan" not in out
        judged = build.judgement
        assert judged["verdict"] in ("better", "worse", "no detectable difference", "censored")
        assert judged["verdict"] in out
        assert ("kept static-best, nothing deployed" in out) == (build.variant.variant_id == slow[0][0].variant_id)
        assert out.count("plot, ") == 3 and "build: " in out
    finally:
        stop_embedded_servers()


# a generated norm kernel: on a CPU it runs in Triton's interpreter, far slower than the torch reference
SLOW_NORM = KernelChoice("rms_norm", "norm_two_pass", (("BLOCK_D", 8),))


@pytest.mark.slow
def test_a_regressing_deployment_is_rolled_back():
    """Verified on the decision's own metric: SLO attainment of a window of traffic before and one after."""
    from ops.release.deploy import ServerProcess, deploy

    server = ServerProcess(["--model", str(TINY), "--synthetic", "--num-kv-blocks", "256"], "tiny")
    try:
        auth = {"Authorization": f"Bearer {server.token}"}
        before = httpx.get(server.url + "/admin/variant", headers=auth).json()["active"]
        slow = VariantSpec(**{k: before[k] for k in ("max_num_seqs", "max_num_batched_tokens", "block_size",
                                                     "enable_prefix_caching")},
                           kernels={"rms_norm": "generated:slow_norm.rms_norm"},
                           kernel_params={"rms_norm": dict(SLOW_NORM.tiles)},
                           generated_source={"slow_norm": SLOW_NORM.source()})
        # on the decision's own metric: SLO attainment of two windows of traffic, before and after the swap
        from engine.serving.trace_record import TraceRecord
        from ops.measure.tiers import SLO
        from ops.release.deploy import LiveWindows

        def window(k):
            recs = [TraceRecord(arrival_s=0.25 * i, input_tokens=12, output_tokens=8, source="t") for i in range(10)]
            return recs, [[1 + (i + k + j) % 200 for j in range(12)] for i in range(10)]
        slo = SLO(ttft_s=1.0, tpot_s=0.05)
        dep = deploy(server.url, server.token, "tiny", slow,
                     live=LiveWindows(window(0), window(1), rate=4.0, slo=slo, max_output=8, max_lag_s=1.0))
        assert dep.status == "rolled back" and "significantly worse" in dep.reason, dep.reason
        assert dep.live_before["attainment"] >= 0.9 and dep.live_after["attainment"] < 0.5
        assert dep.live_after["check"]["high"] < 0 and "live SLO attainment" in dep.reason
        assert httpx.get(server.url + "/admin/variant", headers=auth).json()["active"]["variant_id"] == \
            before["variant_id"]
        fine = VariantSpec(**{**{k: before[k] for k in ("block_size", "enable_prefix_caching")},
                              "max_num_seqs": before["max_num_seqs"], "max_num_batched_tokens": 256})
        dep = deploy(server.url, server.token, "tiny", fine,
                     live=LiveWindows(window(2), window(3), rate=4.0, slo=slo, max_output=8, max_lag_s=1.0))
        assert dep.status == "deployed" and "not significantly worse" in dep.reason, dep.reason
        assert httpx.get(server.url + "/admin/variant", headers=auth).json()["active"]["variant_id"] == \
            fine.variant_id
    finally:
        server.stop()
