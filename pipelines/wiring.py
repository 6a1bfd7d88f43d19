"""The one wiring of resources: ``definitions.py`` and the CLI's ``optimize`` both build them here."""
from __future__ import annotations

import os
from pathlib import Path

import dagster as dg

from assets import pipeline
from assets.resources import ArtifactStore, Endpoint, EngineRunner, TrafficSource, VariantSource, env_secret
from pipelines.sensors import DriftConfig

DEFAULT_TRACE = str(Path(__file__).resolve().parents[1] / "traces" / "AzureLLMInferenceTrace_conv.csv")


def resources(model: str = "smollm2", trace: str | None = None, requests: int = 16, max_input: int = 128,
              max_output: int = 16, time_scale: float = 0.02, candidates: int = 4, device: str = "cpu",
              dtype: str = "float32", fast_layers: int = 4, artifacts: str = ".polyinf/artifacts",
              endpoint_url: str = "", llm_base_url: str = "", llm_model: str = "polyinf",
              speculation: bool = False, precision: bool = True) -> dict:
    """Every resource the graph uses. Secrets (the endpoint's admin token, the LLM key) come from the
    environment through dg.EnvVar; the trace defaults to $POLYINF_TRACE, else the shipped Azure slice."""
    return {
        "runner": EngineRunner(model=model, device=device, dtype=dtype, fast_layers=fast_layers),
        "traffic": TrafficSource(trace=trace or os.environ.get("POLYINF_TRACE", DEFAULT_TRACE),
                                 max_requests=requests, max_input=max_input, max_output=max_output,
                                 time_scale=time_scale),
        "source": VariantSource(candidates=candidates, board=str(Path(artifacts) / "board.sqlite"),
                                llm_base_url=llm_base_url, llm_model=llm_model,
                                llm_api_key=env_secret("OPENAI_API_KEY"), speculation=speculation,
                                precision=precision),
        "artifacts": ArtifactStore(root=artifacts),
        "endpoint": Endpoint(url=endpoint_url, admin_token=env_secret("POLYINF_ADMIN_TOKEN")),
        "drift": DriftConfig(),
    }


def dagster_home_for(artifacts: str, given: str | None = None) -> str:
    """The Dagster instance folder `optimize` records into: ``given``, else $DAGSTER_HOME, else ``dagster``
    beside the artifacts folder."""
    return str(Path(given or os.environ.get("DAGSTER_HOME") or Path(artifacts).parent / "dagster").resolve())


def run_optimize(model: str, trace: str, requests: int, max_input: int, max_output: int, time_scale: float,
                 candidates: int, device: str = "cpu", dtype: str = "float32", fast_layers: int = 4,
                 artifacts: str = ".polyinf/artifacts", endpoint_url: str = "", admin_token: str = "",
                 llm_base_url: str = "", llm_model: str = "polyinf", log_level: str = "DEBUG",
                 dagster_home: str | None = None, speculation: bool = False, precision: bool = True):
    """Materializes the whole graph in-process for one deployment partition; returns the Dagster result.
    ``log_level``: the console's event log (the CLI's default is INFO: the steps, not every input loaded).
    The run is recorded in a persistent Dagster instance: ``dagster_home``, else $DAGSTER_HOME, else
    ``dagster`` beside the artifacts folder (``.polyinf/dagster``), so that `dagster dev` started with that
    DAGSTER_HOME shows its runs, materializations, metadata and plots afterwards."""
    if admin_token:
        os.environ["POLYINF_ADMIN_TOKEN"] = admin_token  # resources read it through dg.EnvVar
    res = resources(model, trace, requests, max_input, max_output, time_scale, candidates, device, dtype, fast_layers,
                    artifacts, endpoint_url, llm_base_url, llm_model, speculation, precision)
    res.pop("drift")  # the sensors' configuration; no asset uses it
    definitions = [*dg.load_assets_from_modules([pipeline]), *dg.load_asset_checks_from_modules([pipeline])]
    home = Path(dagster_home_for(artifacts, dagster_home))
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "dagster.yaml").exists():
        (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\nnux:\n  enabled: false\n")
    instance = dg.DagsterInstance.local_temp(tempdir=str(home))
    key = pipeline.deployment_key(model, device, endpoint_url)
    if not instance.has_dynamic_partition(pipeline.DEPLOYMENTS.name, key):
        instance.add_dynamic_partitions(pipeline.DEPLOYMENTS.name, [key])
    return dg.materialize(definitions, resources=res, raise_on_error=False, instance=instance, partition_key=key,
                          run_config={"loggers": {"console": {"config": {"log_level": log_level}}}})
