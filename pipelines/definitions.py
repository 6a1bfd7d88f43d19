"""The Dagster code location: assets, checks, jobs, schedules, sensors and the resources of the
continuous-compilation graph (pipelines/wiring.py builds them, as it does for the CLI)."""
from __future__ import annotations

import os

import dagster as dg

from assets import pipeline, workloads
from pipelines.sensors import (OPTIMIZE_JOB, WORKLOAD_GROUP, deployments_sensor, hardware_drift_sensor,
                               model_drift_sensor, nightly, traffic_drift_sensor)
from pipelines.wiring import code_location_resources


def _executor():
    """On Kubernetes (POLYINF_EXECUTOR=k8s, set by infra/helm/values.yaml) every step runs in its own pod,
    so the benchmark steps' op tags can put them on GPU nodes; embedded, the default executor."""
    if os.environ.get("POLYINF_EXECUTOR") == "k8s":
        from dagster_k8s import k8s_job_executor

        return k8s_job_executor
    return None


# a workload deployment (model = a workload's name, same DEPLOYMENTS partitions): assets/workloads.py's group,
# run by this job alone; "reoptimize" selects every other group (pipelines/sensors.py)
OPTIMIZE_WORKLOAD_JOB = dg.define_asset_job(
    "optimize_workload", selection=dg.AssetSelection.groups(WORKLOAD_GROUP),
    description="Tune one workload deployment (a non-LLM model) and hot-swap its chosen variant into its endpoint.")

defs = dg.Definitions(
    assets=dg.load_assets_from_modules([pipeline, workloads]),
    asset_checks=dg.load_asset_checks_from_modules([pipeline, workloads]),
    jobs=[OPTIMIZE_JOB, OPTIMIZE_WORKLOAD_JOB], executor=_executor(), schedules=[nightly],
    sensors=[traffic_drift_sensor, model_drift_sensor, hardware_drift_sensor, deployments_sensor],
    resources=code_location_resources(),
)
