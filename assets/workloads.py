"""The non-LLM workloads' graph (issue 45): a workload deployment tuned and hot-swapped end to end.

A workload deployment is a partition of the same ``DEPLOYMENTS`` definition as the LLM deployments, keyed the same
way, ``model|device|endpoint``, where the model is the workload's name (``patchtst|cpu|embedded``,
``fno|cuda|http://polyinf-fno:8100``); so both kinds of deployment sit side by side in the UI's partition lists.

Which assets run for which key: the graphs are separate asset groups with a job each. ``optimize_workload``
(pipelines/definitions.py) selects only the "workloads" group; ``reoptimize`` (pipelines/sensors.py) selects every
other group. A job runs only its own selection, so picking the job picks the kind of deployment; a key of the other
kind still fails at its first step with a clear message (``_workload``, and ``for_deployment`` for the LLM
assets), instead of loading a model the key does not name.

- ``workload_traffic``: request sizes from a real trace's slice (ops/workloads/traffic.py).
- ``workload_tuning``: static-best, the candidates, the fast and the slow tier, the gate, and the decision
  (ops/workloads/tune.py), with its ratio, interval, rounds and verdict as metadata.
- ``workload_gate`` (blocking check): the chosen variant gated again, on fresh inputs, bit for bit (tolerance mode
  only for a precision variant chosen with ``allow_tolerance``).
- ``workload_deployment``: the chosen variant hot-swapped into a served endpoint (``POST /admin/variant``): the key's
  URL (admin token: the ``endpoint`` resource's), or, for ``embedded``, a ``polyinf serve-workload`` this process
  starts on a free loopback port (stopped when that process exits); verified by one request to ``/v1/workloads/{name}/infer`` answering with the
  chosen ``variant_id``.
"""

import atexit
import threading
import time

import dagster as dg
import httpx

from assets.deployments import DEPLOYMENTS, Deployment
from assets.resources import Endpoint
from ops.release.deploy import LoopbackServer

GROUP = "workloads"  # pipelines/sensors.py WORKLOAD_GROUP (the jobs select by it)
_LOCK = threading.Lock()
_SERVERS: dict[str, LoopbackServer] = {}  # embedded workload servers this process started, by partition key


def _workload(context) -> tuple[Deployment, object]:
    """The run's deployment and its Workload; a clear failure for a key whose model is not a workload."""
    from engine.workloads.workload import WORKLOADS, get_workload

    if not context.has_partition_key:
        raise dg.Failure("the workload assets are partitioned by deployment: give a partition key "
                         "model|device|endpoint whose model is a workload, e.g. patchtst|cpu|embedded")
    dep = Deployment.parse(context.partition_key)
    if dep.model not in WORKLOADS:
        raise dg.Failure(f"deployment {dep.key!r}: its model {dep.model!r} is not a workload (known: "
                         f"{', '.join(WORKLOADS)}); an LLM deployment is tuned by the 'reoptimize' job, not "
                         "'optimize_workload'")
    return dep, get_workload(dep.model)


class WorkloadTrafficConfig(dg.Config):
    """The slice of the trace whose request sizes the tuning replays."""

    trace: str = ""  # a trace file (capture, Mooncake or Azure); "": the Azure conversation trace
    requests: int = 24
    start: int = 0


class WorkloadTuneConfig(dg.Config):
    """How much a tuning measures: small by default, so a CPU run takes seconds (ops/workloads/tune.py's
    TuneConfig has the same fields; its defaults suit a thorough run)."""

    mix: int = 8
    repeats: int = 1
    rounds: int = 3
    gate_batches: list[int] = [1, 3]
    sweep: list[int] = [1, 4, 8]
    compile_candidates: bool = False  # compiled candidates compile each new shape: slow on a small CPU
    allow_tolerance: bool = False
    seed: int = 0


@dg.asset(partitions_def=DEPLOYMENTS, group_name=GROUP, kinds={"python"},
          description="Request sizes of the workload's traffic: a real trace's arrivals, prompt lengths mapped by "
                      "rank to the workload's size levels.")
def workload_traffic(context: dg.AssetExecutionContext, config: WorkloadTrafficConfig):
    from ops.workloads.traffic import DEFAULT_TRACE, size_trace

    _, workload = _workload(context)
    trace = size_trace(workload, config.requests, config.start, config.trace or DEFAULT_TRACE)
    mix = trace.mix()
    context.add_output_metadata({
        "workload": workload.name, "source": trace.source, "requests": len(trace.requests),
        "size_axis": workload.size_axis, "rate_rps": dg.FloatMetadataValue(float(min(trace.rate, 1e12))),
        "size_mix": dg.MarkdownMetadataValue("\n".join(f"- size {s}: {share:.0%}" for s, share in mix.items()))})
    return trace


@dg.asset(partitions_def=DEPLOYMENTS, group_name=GROUP, kinds={"pytorch"},
          description="Static-best, candidate variants through the fast and slow tiers and the gate; the chosen "
                      "variant (static-best unless a gated candidate is better by the judge's minimum gain).")
def workload_tuning(context: dg.AssetExecutionContext, config: WorkloadTuneConfig, workload_traffic):
    from ops.workloads.tune import TuneConfig, tune_workload

    dep, workload = _workload(context)
    cfg = TuneConfig(requests=len(workload_traffic.requests), mix=config.mix, repeats=config.repeats,
                     rounds=config.rounds, gate_batches=tuple(config.gate_batches), sweep=tuple(config.sweep),
                     compile_candidates=config.compile_candidates, allow_tolerance=config.allow_tolerance,
                     seed=config.seed)
    tuning = tune_workload(workload.name, dep.device, cfg, trace=workload_traffic)
    cmp = tuning.exact or tuning.tolerance
    ratio = cmp.ratio if cmp else None
    arms = "\n".join(f"| {a.variant.name} | `{a.variant.variant_id}` | {a.fast:.1f} | "
                     f"{a.gate.line() if a.gate else a.error or a.refused} |" for a in [tuning.static, *tuning.arms])
    context.add_output_metadata({
        "verdict": dg.TextMetadataValue(tuning.verdict), "reason": dg.TextMetadataValue(tuning.reason),
        "chosen_variant_id": tuning.chosen.variant_id, "chosen": tuning.chosen.describe(),
        "static_best_variant_id": tuning.static.variant.variant_id,
        "compared_variant_id": cmp.arm.variant.variant_id if cmp else "",
        "ratio": dg.FloatMetadataValue(float(ratio.ratio) if ratio else float("nan")),
        "ratio_low": dg.FloatMetadataValue(float(ratio.low) if ratio else float("nan")),
        "ratio_high": dg.FloatMetadataValue(float(ratio.high) if ratio else float("nan")),
        "rounds": dg.IntMetadataValue(int(ratio.n) if ratio else 0),
        "candidates": len(tuning.arms), "trace": tuning.trace, "seconds": dg.FloatMetadataValue(tuning.seconds),
        "arms": dg.MarkdownMetadataValue("| variant | id | fast tier req/s | gate |\n|---|---|---|---|\n" + arms)})
    return tuning


@dg.asset_check(asset=workload_tuning, blocking=True, partitions_def=DEPLOYMENTS,
                description="The chosen variant gated again on fresh inputs across batch sizes: bit for bit (a "
                            "precision variant chosen with allow_tolerance: tolerance mode).")
def workload_gate(context: dg.AssetCheckExecutionContext, workload_tuning) -> dg.AssetCheckResult:
    from checks.workload_gate import gate_workload

    dep, workload = _workload(context)
    chosen = workload_tuning.chosen
    result = gate_workload(workload, chosen, workload.build(dep.device), dep.device, batch_sizes=(1, 3, 8), rounds=1)
    return dg.AssetCheckResult(passed=result.passed, metadata={
        "mode": result.mode, "variant_id": chosen.variant_id, "checked": result.checked,
        "max_abs": float(result.max_abs), "seed": result.seed, "line": result.line()})


def _workload_server(name: str, device: str, startup_s: float = 180.0):
    """A ``polyinf serve-workload`` on loopback, started and stopped by us (its admin token: a fresh one)."""
    return LoopbackServer(["serve-workload", name, "--device", device], f"polyinf serve-workload {name}", startup_s)


def stop_workload_servers() -> None:
    with _LOCK:
        for server in _SERVERS.values():
            server.stop()
        _SERVERS.clear()


# an embedded server lives as long as the process that started it (a run's process, the webserver's, a test's)
atexit.register(stop_workload_servers)


def _connect(dep: Deployment, name: str, endpoint: Endpoint) -> tuple[str, str]:
    if dep.endpoint:
        if not endpoint.admin_token:
            raise dg.Failure(f"endpoint {dep.endpoint}: no admin token (set POLYINF_ADMIN_TOKEN, the server's "
                             "secret, where the code location and its steps run)")
        return dep.endpoint.rstrip("/"), endpoint.admin_token
    with _LOCK:
        server = _SERVERS.get(dep.key)
        if server is None or server.proc.poll() is not None:
            server = _SERVERS[dep.key] = _workload_server(name, dep.device)
    return server.url, server.token


@dg.asset(partitions_def=DEPLOYMENTS, group_name=GROUP, kinds={"fastapi"},
          description="The chosen variant hot-swapped into the deployment's served endpoint (POST /admin/variant), "
                      "verified by a request answered with its variant_id.")
def workload_deployment(context: dg.AssetExecutionContext, endpoint: Endpoint, workload_tuning) -> dict:
    dep, workload = _workload(context)
    chosen = workload_tuning.chosen
    url, token = _connect(dep, workload.name, endpoint)
    auth = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=url, timeout=120) as http:
        before = http.get("/admin/variant", headers=auth)
        before.raise_for_status()
        body = {**chosen.to_json(), **({"gate": "tolerance"} if chosen.needs_tolerance else {})}
        swap = http.post("/admin/variant", headers=auth, json=body)
        if swap.status_code != 200:
            raise dg.Failure(f"{url} refused variant {chosen.variant_id}: {swap.status_code} {swap.text[:500]}")
        answer = http.post(f"/v1/workloads/{workload.name}/infer",
                           json={"size": workload.default_size, "seed": 1})
        answer.raise_for_status()
    served = answer.json()["variant_id"]
    if served != chosen.variant_id:
        raise dg.Failure(f"{url} answered with variant {served}, not the chosen {chosen.variant_id}")
    previous = before.json()["active"]["variant_id"] if before.json().get("active") else ""
    record = {"endpoint": url, "workload": workload.name, "device": dep.device, "variant_id": served,
              "previous_variant_id": previous, "variant": chosen.to_json(), "verdict": workload_tuning.verdict,
              "deployed_at": time.time()}
    context.add_output_metadata({"endpoint": dg.UrlMetadataValue(url), "variant_id": served,
                                 "previous_variant_id": previous, "chosen": chosen.describe(),
                                 "verified_by": f"POST /v1/workloads/{workload.name}/infer answered {served}"})
    return record
