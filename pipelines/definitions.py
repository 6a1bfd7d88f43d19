"""The Dagster code location: assets, checks, jobs, schedules, sensors and the resources of the
continuous-compilation graph (pipelines/wiring.py builds them, as it does for the CLI)."""
from __future__ import annotations

import os

import dagster as dg

from assets import pipeline
from pipelines.sensors import (OPTIMIZE_JOB, deployments_sensor, hardware_drift_sensor, model_drift_sensor, nightly,
                               traffic_drift_sensor)
from pipelines.wiring import code_location_resources


def _executor():
    """On Kubernetes (POLYINF_EXECUTOR=k8s, set by infra/helm/values.yaml) every step runs in its own pod,
    so the benchmark steps' op tags can put them on GPU nodes; embedded, the default executor."""
    if os.environ.get("POLYINF_EXECUTOR") == "k8s":
        from dagster_k8s import k8s_job_executor

        return k8s_job_executor
    return None


defs = dg.Definitions(
    assets=dg.load_assets_from_modules([pipeline]), asset_checks=dg.load_asset_checks_from_modules([pipeline]),
    jobs=[OPTIMIZE_JOB], executor=_executor(), schedules=[nightly],
    sensors=[traffic_drift_sensor, model_drift_sensor, hardware_drift_sensor, deployments_sensor],
    resources=code_location_resources(),
)
