"""The Dagster code location: assets, checks and resources of the continuous-compilation graph."""
from __future__ import annotations

import os

import dagster as dg

from assets import pipeline
from pipelines.resources import ArtifactStore, Endpoint, EngineRunner, TrafficSource, VariantSource
from pipelines.sensors import OPTIMIZE_JOB, DriftConfig, model_drift_sensor, nightly, traffic_drift_sensor

DEFAULT_TRACE = os.environ.get("POLYINF_TRACE", "../shared/traces/AzureLLMInferenceTrace_conv.csv")

defs = dg.Definitions(
    assets=dg.load_assets_from_modules([pipeline]),
    asset_checks=dg.load_asset_checks_from_modules([pipeline]),
    jobs=[OPTIMIZE_JOB],
    schedules=[nightly],
    sensors=[traffic_drift_sensor, model_drift_sensor],
    resources={"runner": EngineRunner(), "traffic": TrafficSource(trace=DEFAULT_TRACE), "source": VariantSource(),
               "artifacts": ArtifactStore(), "endpoint": Endpoint(), "drift": DriftConfig()},
)
