"""The Dagster code location: assets, checks and resources of the continuous-compilation graph."""
from __future__ import annotations

import os

import dagster as dg

from assets import pipeline
from pipelines.resources import ArtifactStore, Endpoint, EngineRunner, TrafficSource, VariantSource, env_secret
from pipelines.sensors import OPTIMIZE_JOB, DriftConfig, model_drift_sensor, nightly, traffic_drift_sensor

DEFAULT_TRACE = os.environ.get("POLYINF_TRACE", "../shared/traces/AzureLLMInferenceTrace_conv.csv")


def _executor():
    """On Kubernetes (POLYINF_EXECUTOR=k8s, set by infra/helm/values.yaml) every step runs in its own pod,
    so the benchmark steps' op tags can put them on GPU nodes; embedded, the default executor."""
    if os.environ.get("POLYINF_EXECUTOR") == "k8s":
        from dagster_k8s import k8s_job_executor

        return k8s_job_executor
    return None


defs = dg.Definitions(
    assets=dg.load_assets_from_modules([pipeline]),
    asset_checks=dg.load_asset_checks_from_modules([pipeline]),
    jobs=[OPTIMIZE_JOB],
    executor=_executor(),
    schedules=[nightly],
    sensors=[traffic_drift_sensor, model_drift_sensor],
    resources={"runner": EngineRunner(), "traffic": TrafficSource(trace=DEFAULT_TRACE),
               "source": VariantSource(llm_api_key=env_secret("OPENAI_API_KEY")), "artifacts": ArtifactStore(),
               "endpoint": Endpoint(admin_token=env_secret("POLYINF_ADMIN_TOKEN")), "drift": DriftConfig()},
)
