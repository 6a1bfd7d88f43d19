"""infra/: the Dagster parts validated with dagster-k8s's own config schemas; manifests consistent with the CLI."""
from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from dagster._config import process_config
from dagster_k8s import K8sRunLauncher
from dagster_k8s.job import USER_DEFINED_K8S_JOB_CONFIG_SCHEMA

INFRA = Path(__file__).resolve().parents[2] / "infra"


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def test_run_launcher_config_validates_against_dagster_k8s():
    instance = yaml.safe_load((INFRA / "helm" / "dagster-instance.yaml").read_text())
    launcher = instance["run_launcher"]
    assert (launcher["module"], launcher["class"]) == ("dagster_k8s", "K8sRunLauncher")
    result = process_config(K8sRunLauncher.config_type(), launcher["config"])
    assert result.success, result.errors
    bad = process_config(K8sRunLauncher.config_type(), {**launcher["config"], "job_namespacee": "x"})
    assert not bad.success  # the schema does reject what it does not know


def test_helm_values_match_the_instance_config():
    values = yaml.safe_load((INFRA / "helm" / "values.yaml").read_text())
    instance = yaml.safe_load((INFRA / "helm" / "dagster-instance.yaml").read_text())["run_launcher"]["config"]
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    helm = values["runLauncher"]["config"]["k8sRunLauncher"]
    fields = set(K8sRunLauncher.config_type())
    for key in helm:
        assert _snake(key) in fields, f"{key} is not a K8sRunLauncher field"
    assert helm["jobNamespace"] == instance["job_namespace"]
    assert [s["name"] for s in helm["envSecrets"]] == instance["env_secrets"]
    user = values["dagster-user-deployments"]["deployments"][0]
    assert user["dagsterApiGrpcArgs"] == ["-m", "pipelines.definitions"]


def test_gpu_op_tags_validate_and_are_on_the_steps_that_run_the_model_on_its_device():
    from assets.pipeline import (GPU_OP_TAGS, engine_build_gates, fast_bench_results, hardware_profile,
                                 slow_bench_results, variant_candidates)

    tags = yaml.safe_load((INFRA / "helm" / "gpu-op-tags.yaml").read_text())
    assert tags == GPU_OP_TAGS
    result = process_config(USER_DEFINED_K8S_JOB_CONFIG_SCHEMA, tags["dagster-k8s/config"])
    assert result.success, result.errors
    for asset in (hardware_profile, variant_candidates, fast_bench_results, slow_bench_results, engine_build_gates):
        tag = asset.op.tags["dagster-k8s/config"]  # Dagster keeps structured tags as JSON text
        assert (json.loads(tag) if isinstance(tag, str) else tag) == GPU_OP_TAGS["dagster-k8s/config"]


def test_engine_manifest_runs_a_valid_serve_command():
    from pipelines.cli import build_parser

    docs = list(yaml.safe_load_all((INFRA / "k8s" / "engine-deployment.yaml").read_text()))
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    cmd = container["command"]
    assert cmd[:2] == ["polyinf", "serve"]
    args = build_parser().parse_args(cmd[1:])
    assert args.port == 8000 and args.capture_dir == "/shared/capture" and args.device == "cuda"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    startup = container["startupProbe"]  # the weights load before the first answer: minutes, not seconds
    assert startup["httpGet"]["path"] == "/health" and startup["periodSeconds"] * startup["failureThreshold"] >= 600
    token = next(e for e in container["env"] if e["name"] == "POLYINF_ADMIN_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": "polyinf-secrets", "key": "POLYINF_ADMIN_TOKEN"}
    assert container["image"].endswith(":cuda")
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert args.capture_dir.startswith(mounts["shared"] + "/")  # on the volume the code location reads
    claim = next(d for d in docs if d["kind"] == "PersistentVolumeClaim")
    assert claim["metadata"]["name"] == "polyinf-shared" and claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert "dagster" in (INFRA / "Dockerfile").read_text() and "pipelines.definitions" in (INFRA / "Dockerfile").read_text()


def test_dockerfile_builds_cpu_or_cuda_torch_at_the_pinned_version():
    text = (INFRA / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
    assert args["TORCH_VARIANT"] == "cpu" and args["BASE"].startswith("python:3.11")
    assert text.index("ARG BASE") < text.index("FROM ${BASE}") < text.index("ARG TORCH_VARIANT")
    assert 'https://download.pytorch.org/whl/${TORCH_VARIANT}' in text
    assert "grep -E '^torch==' requirements.lock" in text  # the version the suite runs, whatever the variant
    lock = (INFRA.parent / "requirements.lock").read_text()
    assert re.search(r"^torch==\S+$", lock, re.M)
    assert "--build-arg TORCH_VARIANT=cu" in text  # the CUDA build, as infra/README.md gives it


def test_every_pod_reaches_the_same_services():
    """The code location (sensors, schedule) and the run and step pods get the same service settings and the
    shared volume; the settings make a valid wiring.Services with every service on."""
    from pipelines.wiring import Services

    values = yaml.safe_load((INFRA / "helm" / "values.yaml").read_text())
    user = values["dagster-user-deployments"]["deployments"][0]
    launcher = values["runLauncher"]["config"]["k8sRunLauncher"]
    instance = yaml.safe_load((INFRA / "helm" / "dagster-instance.yaml").read_text())["run_launcher"]["config"]
    code_env = {e["name"]: e["value"] for e in user["env"]}
    run_env = dict(v.split("=", 1) for v in launcher["envVars"])
    assert code_env == run_env == dict(v.split("=", 1) for v in instance["env_vars"])
    assert user["volumes"] == launcher["volumes"] == instance["volumes"]
    assert user["volumeMounts"] == launcher["volumeMounts"] == instance["volume_mounts"]
    services = Services.from_env(code_env)
    engine = next(d for d in yaml.safe_load_all((INFRA / "k8s" / "engine-deployment.yaml").read_text())
                  if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["command"]
    assert code_env["POLYINF_DTYPE"] == engine[engine.index("--dtype") + 1]  # tuned in the dtype it serves in
    assert services.board.startswith("postgresql://") and services.s3_bucket and services.deployments
    shared = user["volumeMounts"][0]["mountPath"]
    assert code_env["POLYINF_CAPTURE_DIR"].startswith(shared) and code_env["POLYINF_ARTIFACTS"].startswith(shared)
    assert not [k for k in code_env if any(m in k for m in ("PASSWORD", "SECRET", "TOKEN", "KEY"))]  # secrets: envSecrets
    assert user["image"]["tag"] == "cuda"  # the GPU steps' pods run the code location's image
    guide = (INFRA / "README.md").read_text()
    for name in [*code_env, "POLYINF_BOARD_PASSWORD", "POLYINF_ADMIN_TOKEN", "AWS_ACCESS_KEY_ID"]:
        assert name in guide or name == "POLYINF_EXECUTOR", f"infra/README.md does not say what {name} is"


def test_k8s_job_executor_is_used_on_kubernetes():
    import subprocess
    import sys

    values = yaml.safe_load((INFRA / "helm" / "values.yaml").read_text())
    env = values["dagster-user-deployments"]["deployments"][0]["env"]
    assert {"name": "POLYINF_EXECUTOR", "value": "k8s"} in env
    code = ("from pipelines.definitions import defs; "
            "print(defs.resolve_job_def('reoptimize').executor_def.name)")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                         env={**__import__("os").environ, "POLYINF_EXECUTOR": "k8s"})
    assert out.stdout.strip().splitlines()[-1] == "k8s", out.stderr
    local = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert local.stdout.strip().splitlines()[-1] != "k8s"


def test_grafana_dashboard_reads_series_the_server_exports():
    """Every metric the dashboard queries is one the server's registry exports (counters with their _total,
    histograms with their _bucket), each filtered on vLLM's model_name label."""
    from prometheus_client import generate_latest

    from engine.serving.metrics import EngineMetrics

    m = EngineMetrics("m")
    m.set_variant("abc", "static-best")
    m.request_success.labels(finished_reason="stop").inc()
    m.spec_accepted_per_pos.labels(position="0").inc()
    for h in (m.ttft, m.itl, m.e2e):
        h.observe(0.1)
    exported = {line.split("{")[0].split(" ")[0] for line in generate_latest(m.registry).decode().splitlines()
                if line and not line.startswith("#")}
    dash = json.loads((INFRA / "grafana" / "polyinf-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 12
    for expr in exprs:
        names = re.findall(r"((?:vllm|polyinf):[a-z0-9_]+)\{", expr)
        assert names and set(names) <= exported, (expr, set(names) - exported)
        assert expr.count('model_name="$model_name"') == len(names), expr
    assert dash["templating"]["list"][0]["name"] == "model_name"
