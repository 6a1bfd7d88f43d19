"""The continuous-compilation graph: thin assets over ops/ and checks/."""

import base64
import json
import warnings

import dagster as dg

from assets.deployments import DEPLOYMENTS, deployment_key, for_deployment, record_file  # noqa: F401 (callers' names)
from assets.resources import ArtifactStore, Endpoint, EngineRunner, TrafficSource, VariantSource
from ops.search.board_store import masked


# The checks' partitions are a Dagster preview feature that this graph relies on; its warning at import time
# tells a user nothing they can act on.
warnings.filterwarnings("ignore", category=dg.PreviewWarning, message=".*partitions_def on an AssetCheckSpec")


# dagster-k8s/config for the steps that run the model on the deployment's device (the hardware probe, the SLO
# measured when the search starts, the two benchmark tiers, the gates): on Kubernetes their pods land on GPU
# nodes (the same as infra/helm/gpu-op-tags.yaml; a test keeps the two equal and validates them).
GPU_OP_TAGS = {"dagster-k8s/config": {
    "container_config": {"resources": {"limits": {"nvidia.com/gpu": "1"},
                                       "requests": {"nvidia.com/gpu": "1", "cpu": "8", "memory": "64Gi"}}},
    "pod_spec_config": {"node_selector": {"nvidia.com/gpu.present": "true"},
                        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
}}


def _table(rows: list[dict]) -> dg.MetadataValue:
    """Rows as a Dagster table (the UI sorts and filters it): the union of the rows' columns in first-seen
    order, each typed by its values (int, float, bool, else text)."""
    if not rows:
        return dg.MetadataValue.md("(none)")
    cols = list(dict.fromkeys(c for r in rows for c in r))

    def kind(c: str) -> str:
        vals = [r[c] for r in rows if r.get(c) is not None]
        if vals and all(isinstance(v, bool) for v in vals):
            return "bool"
        if vals and all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
            return "int"
        if vals and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            return "float"
        return "string"
    types = {c: kind(c) for c in cols}

    def cell(c: str, v):
        if v is None:
            return None
        return float(v) if types[c] == "float" else v if types[c] in ("int", "bool") else str(v)
    return dg.MetadataValue.table(
        records=[dg.TableRecord({c: cell(c, r.get(c)) for c in cols}) for r in rows],
        schema=dg.TableSchema(columns=[dg.TableColumn(c, types[c]) for c in cols]))


def _plots(context, artifacts: ArtifactStore, search, results: list, cost: dict, judged=None) -> dict:
    """The slow tier's figures as PNGs: written to the artifacts (beside the build) and embedded in the
    asset's metadata as images; returns the metadata entries (the CLI prints the paths)."""
    from assets.plots import attainment_vs_rate, predicted_vs_measured, throughput_vs_tpot

    pngs = {
        "throughput vs TPOT": throughput_vs_tpot([(v.name, r.output_tok_s, 1e3 * r.tpot_p50) for v, r in results],
                                                 1e3 * search.cfg.slo_tpot_s),
        "SLO attainment vs rate": attainment_vs_rate([
            (v.name, [[p.rate, p.attainment] for p in (judged.capacity(v.variant_id).probes
                                                        if judged and judged.capacity(v.variant_id) else [])
                      if p.verdict != "void"]) for v, r in results]),
        "cost model vs measured": predicted_vs_measured([(p["name"], p["calibrated"], p["measured"])
                                                         for p in cost.get("points", [])]),
    }
    paths = {title: artifacts.put(f"plots/{search.id}/{title.replace(' ', '_')}.png", png)
             for title, png in pngs.items()}
    context.log.info("plots: " + ", ".join(paths.values()))
    return plot_metadata(pngs, paths)


def plot_metadata(pngs: dict[str, bytes], paths: dict[str, str]) -> dict:
    """Each PNG as a metadata entry the Dagster UI renders as an image (markdown with a data URI: the asset's
    page shows it under '[Show Markdown]'), and where the files are."""
    out = {title: dg.MetadataValue.md(f"![{title}](data:image/png;base64,{base64.b64encode(png).decode()})")
           for title, png in pngs.items()}
    out["plot files"] = dg.MetadataValue.json(paths)
    return out


@dg.asset(partitions_def=DEPLOYMENTS, group_name="traffic", kinds={"python"},
          description="The traffic this optimization run tunes for: a trace file's slice, or the records the "
                      "deployment captured since its last build (set through the run's config by the sensors).")
def traffic_traces(context: dg.AssetExecutionContext, traffic: TrafficSource) -> list:
    records = traffic.records()
    source = traffic.describe(records)
    if not records:
        raise dg.Failure(f"no traffic to tune on in {source['source kind']} {source['source']}", metadata=source)
    context.add_output_metadata({
        **source,
        "preview": _table([{"arrival_s": round(r.arrival_s, 3), "input": r.input_tokens,
                               "output": r.output_tokens, "prefix blocks": len(r.prefix_block_hashes)}
                              for r in records[:10]]),
    })
    return records


@dg.asset(partitions_def=DEPLOYMENTS, group_name="traffic", kinds={"python"},
          description="Arrival rate, burstiness, length percentiles and prefix reuse of the traffic.")
def traffic_profile(context: dg.AssetExecutionContext, traffic_traces: list, traffic: TrafficSource):
    from ops.traffic.traces import profile

    prof = profile(traffic_traces)
    context.add_output_metadata({**{k: dg.MetadataValue.float(float(v)) for k, v in prof.to_json().items()
                                    if isinstance(v, (int, float))},
                                 **{k: v for k, v in traffic.describe(traffic_traces).items() if k != "requests"}})
    return prof


@dg.asset(partitions_def=DEPLOYMENTS, group_name="plan", kinds={"pytorch"},
          description="The served model's shape, bytes per token and weights hash.")
def model_spec(context: dg.AssetExecutionContext, runner: EngineRunner):
    runner = for_deployment(context, runner)
    from engine import resolve
    from ops.measure.model_spec import model_spec as spec_of

    spec = spec_of(resolve(runner.model), runner.dtype)
    context.add_output_metadata({k: v for k, v in spec.to_json().items() if isinstance(v, (int, str))})
    return spec


@dg.asset(partitions_def=DEPLOYMENTS, group_name="plan", kinds={"pytorch"}, op_tags=GPU_OP_TAGS,
          description="Measured memory bandwidth, matmul FLOP/s and launch overhead of this machine.")
def hardware_profile(context: dg.AssetExecutionContext, runner: EngineRunner):
    runner = for_deployment(context, runner)
    from ops.measure.hardware import probe

    hw = probe(runner.device)
    context.add_output_metadata({"device": hw.device, "memory bandwidth GB/s": hw.memory_bandwidth / 1e9,
                                 "launch overhead us": hw.launch_overhead_s * 1e6,
                                 **{f"matmul {k} GFLOP/s": v / 1e9 for k, v in hw.matmul_flops.items()}})
    return hw


@dg.asset(partitions_def=DEPLOYMENTS, group_name="plan", kinds={"python"},
          description="Knob variants and parallel layouts ranked by the cost model (a simulated batching of "
                      "the trace slice with roofline step times) for this model, machine and traffic.")
def cost_model_plan(context: dg.AssetExecutionContext, model_spec, hardware_profile, traffic_profile,
                    traffic_traces: list, traffic: TrafficSource, runner: EngineRunner):
    runner = for_deployment(context, runner)
    from engine.config.variant import VariantSpec
    from ops.predict.cost_model import plan

    base = VariantSpec(name="baseline (default)")  # the engine's default configuration: the static baseline
    p = plan(model_spec, hardware_profile, traffic_profile, base, records=traffic_traces[: traffic.max_requests],
             time_scale=traffic.time_scale, max_input=traffic.max_input, max_output=traffic.max_output,
             num_kv_blocks=runner.num_kv_blocks)
    context.add_output_metadata({"candidates ranked": len(p.entries), "top": _table([
        {"variant": e.variant.name, "id": e.variant.variant_id, "pred tok/s": round(e.prediction.output_tok_s, 1),
         "pred goodput": round(e.prediction.goodput, 2), "pred TTFT ms": round(1e3 * e.prediction.ttft_s),
         "pred TPOT ms": round(1e3 * e.prediction.tpot_s, 1)} for e in p.entries[:10]]),
        "knob ranges": dg.MetadataValue.json(p.ranges),
        "parallel layouts": _table([{"tp": d["tp"], "dp": d["dp"], "fits": d["fits"], "why": d["rationale"]}
                                       for d in p.layouts])})
    return p


@dg.asset(partitions_def=DEPLOYMENTS, group_name="plan", kinds={"postgres", "sqlite"}, op_tags=GPU_OP_TAGS,
          description="Agents read the board and propose; their proposals wait in the experiment queue. Starting "
                      "the search measures static-best's unloaded latency on the device (the derived SLO).")
def variant_candidates(context: dg.AssetExecutionContext, cost_model_plan, hardware_profile, source: VariantSource,
                       runner: EngineRunner, traffic: TrafficSource) -> list:
    runner = for_deployment(context, runner)
    search = source.search(context, runner, traffic, hardware_profile, cost_model_plan)
    for agent in source.agents(search.board):
        room = source.candidates + 1 - search.n_experiments()
        if room > 0:
            search.propose(agent, room)
    exps = search.board.experiments(search.id)
    variants = [search.baseline] + [v for v in (_variant_of(e) for e in exps)
                                    if v.variant_id != search.baseline.variant_id]
    context.log.info(f"{len(variants)} variants to measure (static-best first): "
                     + "; ".join(f"{v.name} ({v.variant_id})" for v in variants))
    context.add_output_metadata({"board": masked(source.board), "search": search.id, "variants": _table([
        {"name": json.loads(e["variant"])["name"], "id": e["variant_id"], "proposer": e["proposer"],
         "why": e["rationale"]} for e in exps])})
    return variants


def _variant_of(row: dict):
    """The VariantSpec of an experiment row on the board."""
    from engine.config.variant import VariantSpec

    return VariantSpec.from_json(json.loads(row["variant"]))


@dg.asset(partitions_def=DEPLOYMENTS, group_name="measure", kinds={"pytorch"},
          description="Fast tier: step times of the traffic's shape mix on a few layers, one hot-swapped engine "
                      "draining the queue.",
          op_tags={"polyinf/tier": "fast", **GPU_OP_TAGS})
def fast_bench_results(context: dg.AssetExecutionContext, variant_candidates: list, hardware_profile,
                       source: VariantSource, runner: EngineRunner, traffic: TrafficSource) -> list:
    runner = for_deployment(context, runner)
    from ops.search.config import FAST

    search = source.search(context, runner, traffic, hardware_profile)
    context.log.info(f"fast tier: {search.board.pending(search.id, FAST)} variants queued, "
                     f"{runner.fast_layers} layers each")
    stats = search.measure_fast()
    results = search.benches(FAST, variant_candidates)
    context.log.info(f"fast tier: {stats.evaluated} measured, {stats.failed} failed in {stats.seconds:.0f} s")
    context.add_output_metadata({"measured": stats.evaluated, "failed": stats.failed, "results": _table([
        {"variant": v.name, "decode tok/s": round(r.output_tok_s, 1), "spread": round(r.spread, 1),
         **{k: round(t, 2) for k, t in r.step_times_ms.items()}} for v, r in results][:12])})
    return results


@dg.asset(partitions_def=DEPLOYMENTS, group_name="measure", kinds={"pytorch"},
          description="Slow tier: the trace slice replayed through the full model for the baseline and the best "
                      "fast-tier variants; then the judge: static-best and the simulator's best candidates replayed "
                      "in lockstep on fresh windows of the trace, capacities with 95% intervals, the verdict and "
                      "its out-of-sample confirmation.",
          op_tags={"polyinf/tier": "slow", **GPU_OP_TAGS})
def slow_bench_results(context: dg.AssetExecutionContext, fast_bench_results: list, hardware_profile,
                       source: VariantSource, runner: EngineRunner, traffic: TrafficSource,
                       artifacts: ArtifactStore) -> list:
    runner = for_deployment(context, runner)
    from ops.search.config import SLOW

    search = source.search(context, runner, traffic, hardware_profile)
    chosen = search.queue_slow(source.slow_top, source.speculation, source.precision)
    extra = [v.name for v in chosen[source.slow_top + 1:]]
    context.log.info(f"slow tier: {len(chosen)} variants queued (static-best, the fast tier's best"
                     f"{''.join(', ' + n for n in extra)}), the full "
                     f"model; SLO {search.cfg.slo.describe()} ({search.cfg.slo_source})")
    stats = search.measure(SLOW)
    context.log.info(f"slow tier: {stats.evaluated} measured, {stats.failed} failed in {stats.seconds:.0f} s")
    results = search.benches(SLOW, chosen)
    cost = search.cost_model_error(search.known_calibration() or search.calibration())
    # the judge: static-best and the simulator's best candidates replayed in lockstep on fresh windows of the
    # trace, each capacity with its interval, the decision and its out-of-sample confirmation (ops/judge/paired.py)
    judged = search.judgement() or search.judge(source.judge_config(runner.device))
    for line in judged.lines():
        context.log.info(line)

    def cap_cell(v) -> dict:
        c = judged.capacity(v.variant_id)
        comp = judged.comparison(v.variant_id)
        if c is None:
            return {"capacity req/s": None, "capacity low": None, "capacity high": None, "judged": "not compared"}
        return {"capacity req/s": round(c.estimate, 3), "capacity low": round(c.low, 3),
                "capacity high": None if c.high == float("inf") else round(c.high, 3),
                "judged": (c.censored and f"censored {c.censored}") or (comp.verdict if comp else "baseline"),
                "probes": len(c.probes), "requests": c.requests}
    context.add_output_metadata({
        "SLO": f"{search.cfg.slo.describe()} ({search.cfg.slo_source})",
        "results": _table([{"variant": v.name, **cap_cell(v),
                            "predicted req/s": round(r.capacity_predicted, 3),
                            "saturation req/s": round(r.saturation, 3), "attainment": round(r.attainment, 2),
                            "output tok/s": round(r.output_tok_s, 1), "spread": round(r.spread, 1),
                            "TTFT p50/p99 ms": f"{1e3 * r.ttft_p50:.0f}/{1e3 * r.ttft_p99:.0f}",
                            "TPOT p50/p99 ms": f"{1e3 * r.tpot_p50:.1f}/{1e3 * r.tpot_p99:.1f}",
                            "speculation accepted": (f"{r.spec_acceptance:.0%}, {r.spec_accepted_length:.2f} tokens "
                                                     "per draft" if r.spec_accepted_length else "-")}
                           for v, r in results]),
        "judgement": dg.MetadataValue.md("```\n" + "\n".join(judged.lines()) + "\n```"),
        **judgement_metadata(judged),
        **_plots(context, artifacts, search, results, cost, judged),
        "cost model MAPE": dg.MetadataValue.float(float(cost["mape_calibrated"])),
        "Spearman fast vs slow": dg.MetadataValue.float(float(cost["spearman_fast_tier"])),
    })
    return results


def judgement_metadata(j) -> dict:
    """The judgement's figures as numeric metadata, which the Dagster UI plots across runs: the capacity ratio
    and its bounds (of the choice, or of the closest candidate when static-best was kept), each arm's capacity
    and bounds, static-best's, the out-of-sample difference, the simulator's error, and the verdict."""
    import math

    def num(x) -> dg.MetadataValue:
        return dg.MetadataValue.float(float(x))
    out = {"verdict": dg.MetadataValue.text(j.verdict), "chosen": dg.MetadataValue.text(j.chosen),
           "kept static-best": dg.MetadataValue.bool(j.kept)}
    shown = j.comparison(j.chosen) if not j.kept else max(j.comparisons, key=lambda c: c.low, default=None)
    if shown is not None:
        out.update({"capacity ratio": num(shown.ratio), "capacity ratio low": num(shown.low),
                    "capacity ratio high": num(shown.high)})
    for vid, role in ((j.baseline, "static-best"), (shown.variant_id if shown else None, "candidate")):
        c = j.capacity(vid) if vid else None
        if c is not None:
            out.update({f"{role} capacity": num(c.estimate), f"{role} capacity low": num(c.low),
                        f"{role} capacity high": num(c.high), f"{role} saturation": num(c.saturation)})
    if j.confirmation:
        out.update({"held-out attainment difference": num(j.confirmation.diff),
                    "held-out difference low": num(j.confirmation.low)})
    out["simulator capacity error"] = num(j.simulator_error)
    out["simulator capacity error on the judge's probes"] = num(j.simulator_probe_error)
    # a figure that was not measured (no bound, no candidate) is left out, never shown as nan
    return {k: v for k, v in out.items() if not isinstance(v.value, float) or math.isfinite(v.value)}


@dg.asset(partitions_def=DEPLOYMENTS, group_name="ship", kinds={"json"},
          description="The chosen variant, why, and its measurements; gated by the quality checks.")
def engine_build(context: dg.AssetExecutionContext, slow_bench_results: list, traffic_profile, model_spec,
                 hardware_profile, artifacts: ArtifactStore, source: VariantSource, runner: EngineRunner,
                 traffic: TrafficSource):
    from ops.judge.rule import Judgement
    from ops.search.optimize import EngineBuild

    runner = for_deployment(context, runner)

    search = source.search(context, runner, traffic, hardware_profile)  # the measured profile, not a new probe
    choice, decision = search.decide(jcfg=source.judge_config(runner.device))  # the judge's, one place
    if choice is None:
        raise dg.Failure(decision["reason"])
    judged = Judgement.from_json(decision["judgement"])
    build = EngineBuild(variant=choice.variant, source_hash=choice.variant.variant_id,
                        bench=choice.result.to_json(), baseline_bench=choice.baseline.to_json(), reason=choice.reason,
                        traffic_profile=traffic_profile.to_json(), model_weights_hash=model_spec.weights_hash,
                        judgement=decision["judgement"],
                        provenance={"run_id": context.run.run_id, "variant_source": "agents on the board",
                                    "board": masked(source.board), "search": search.id,
                                    "decision_message": decision.get("message_id"),
                                    "slo_source": search.cfg.slo_source, "slo": search.cfg.slo.describe(),
                                    "result_ids": decision.get("refs", [])})
    path = artifacts.put(f"builds/{build.source_hash}.json", json.dumps(build.to_json(), indent=2))
    context.log.info(f"decision: {choice.reason}")
    context.log.info(judged.headline())
    context.add_output_metadata({"chosen variant": choice.variant.variant_id, "name": choice.variant.name,
                                 "capacity": judged.headline(), **judgement_metadata(judged),
                                 "why": dg.MetadataValue.md(choice.reason), "artifact": path})
    return build


def _expectation_result(outcome) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(passed=outcome.passed, metadata={
        "expectations evaluated": outcome.evaluated,
        "failures": dg.MetadataValue.md("\n".join(f"- {f}" for f in outcome.failures) or "none")})


@dg.asset_check(asset=traffic_traces, blocking=True, partitions_def=DEPLOYMENTS,
                description="Great Expectations: trace schema and ranges.")
def traffic_traces_expectations(traffic_traces: list) -> dg.AssetCheckResult:
    from checks.expectations import expect_traces

    return _expectation_result(expect_traces(traffic_traces))


@dg.asset_check(asset=fast_bench_results, blocking=True, partitions_def=DEPLOYMENTS,
                description="Great Expectations: complete, finite results.")
def fast_bench_expectations(fast_bench_results: list) -> dg.AssetCheckResult:
    from checks.expectations import expect_bench_results

    return _expectation_result(expect_bench_results([r for _, r in fast_bench_results]))


@dg.asset_check(asset=slow_bench_results, blocking=True, partitions_def=DEPLOYMENTS,
                description="Great Expectations: complete, finite results.")
def slow_bench_expectations(slow_bench_results: list) -> dg.AssetCheckResult:
    from checks.expectations import expect_bench_results

    return _expectation_result(expect_bench_results([r for _, r in slow_bench_results]))


@dg.asset_check(asset=engine_build, blocking=True, partitions_def=DEPLOYMENTS, op_tags=GPU_OP_TAGS,
                description="Quality and KV-cache contamination gates.")
def engine_build_gates(context: dg.AssetCheckExecutionContext, engine_build,
                       runner: EngineRunner) -> dg.AssetCheckResult:
    from checks.gates import gate_variant

    runner = for_deployment(context, runner)

    if engine_build.bench.get("variant_id") == engine_build.baseline_bench.get("variant_id"):
        # nothing beat static-best: the build is the form already serving, not a candidate to gate
        context.log.info("gates: not run (the build is static-best: nothing new to gate)")
        return dg.AssetCheckResult(passed=True, metadata={
            "verdict": "not run", "why": "the build is static-best (nothing beat it): nothing new to gate"})
    context.log.info(f"gates: quality and KV-cache contamination of {engine_build.variant.name} against static-best")
    report = gate_variant(runner.engine(), engine_build.variant, max_tokens=8)
    engine_build.attach_quality(report)
    context.log.info(f"gates: {report.verdict} in {report.seconds:.0f} s")
    return dg.AssetCheckResult(passed=report.verdict == "pass", metadata={
        "verdict": report.verdict, "report": dg.MetadataValue.md(f"```\n{report.summary()}\n```"),
        "seconds": report.seconds})


@dg.asset(partitions_def=DEPLOYMENTS, group_name="ship", kinds={"fastapi"},
          description="The build hot-swapped into the serving endpoint, watched, and rolled back on regression.")
def deployed_endpoint(context: dg.AssetExecutionContext, engine_build, runner: EngineRunner, endpoint: Endpoint,
                      artifacts: ArtifactStore, traffic: TrafficSource):
    import time
    from pathlib import Path

    from ops.measure.tiers import SLO, own_rate
    from ops.release.deploy import LiveWindows, deploy
    from ops.release.drift import DeploymentRecord, capture_position, hardware_identity
    from ops.judge.rule import Judgement
    from ops.judge.paired import live_windows

    runner, endpoint = for_deployment(context, runner, endpoint)
    url, token = endpoint.connect(runner, capture_dir=str(Path(artifacts.root) / "capture"))
    # verified on the decision's own metric: SLO attainment of two windows of the traffic's held-out part at the
    # traffic's own rate, one before the swap and one after it, beside what the simulator predicted there
    base = engine_build.baseline_bench
    slo = SLO(base["slo_ttft_s"], base["slo_tpot_s"], base.get("slo_ttft_per_token_s", 0.0))
    (before, after), *spare = live_windows(traffic.trace_file(), runner.model, traffic.max_requests,
                                           endpoint.watch_requests, traffic.max_input, traffic.lenient,
                                           rounds=endpoint.watch_rounds)
    rate = own_rate(traffic.records()) / traffic.time_scale if traffic.time_scale > 0 else own_rate(before[0])
    arms = Judgement.from_json(engine_build.judgement).arms if engine_build.judgement else {}
    pred = [arms.get(vid, {}).get("attainment_1x", float("nan"))
            for vid in (base["variant_id"], engine_build.variant.variant_id)]
    live = LiveWindows(before, after, rate, slo, traffic.max_output, predicted_before=pred[0], predicted_after=pred[1],
                       spare=spare)
    dep = deploy(url, token, endpoint.served_model_name, engine_build.variant, live)
    if dep.status in ("deployed", "kept"):  # what the drift sensors compare live traffic, model and hardware against
        capture_dir = endpoint.capture_dir or str(Path(artifacts.root) / "capture")
        record = DeploymentRecord(endpoint=url, variant_id=dep.build_id, traffic_profile=engine_build.traffic_profile,
                                  partition_key=context.partition_key,
                                  model_weights_hash=engine_build.model_weights_hash, model=runner.model,
                                  deployed_at=time.time(), capture_dir=capture_dir,
                                  capture_start=capture_position(capture_dir),
                                  hardware=hardware_identity(runner.device).to_json())
        latest = Path(endpoint.deployment_record or Path(artifacts.root) / "deployments" / "current.json")
        record.save(latest)  # the latest deployment, which the drift sensors watch
        record.save(record_file(latest.parent, context.partition_key))  # this deployment's, for the schedule
    context.log.info(f"deployment: {dep.status} at {url}: {dep.reason}")
    context.add_output_metadata({"endpoint": url, "status": dep.status, "serving": dep.build_id,
                                 "previous": str(dep.previous_build), "why": dg.MetadataValue.md(dep.reason)})
    return dep
