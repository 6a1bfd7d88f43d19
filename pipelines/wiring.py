"""The one wiring of resources: ``definitions.py`` and the CLI's ``optimize`` both build them here."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import dagster as dg

from assets import pipeline
from assets.deployments import Deployment
from assets.resources import ArtifactStore, Endpoint, EngineRunner, TrafficSource, VariantSource, env_secret
from pipelines.sensors import DriftConfig

DEFAULT_TRACE = str(Path(__file__).resolve().parents[1] / "traces" / "AzureLLMInferenceTrace_conv.csv")


@dataclass(frozen=True)
class Services:
    """The services runs share past one machine, each off (the embedded default) unless given. On Kubernetes
    every step runs in its own pod, so whatever one step leaves for another must be in one of these: the board
    (Postgres), the steps' outputs and the artifacts (S3), the engine (its Service's admin API), the capture
    and the deployment record (a volume the engine and the code location share). ``from_env`` reads them from
    the variables infra/helm/values.yaml sets; secrets are never here (they come through dg.EnvVar)."""

    board: str = ""  # a postgresql:// URL without a password (POLYINF_BOARD_PASSWORD); "": SQLite beside the artifacts
    s3_bucket: str = ""  # outputs through dagster-aws's S3 pickle IO manager, and artifacts; "": local files
    s3_prefix: str = "polyinf"
    s3_endpoint_url: str = ""  # an S3-compatible server (MinIO, moto); "": AWS
    s3_region: str = "us-east-1"
    capture_dir: str = ""  # where the engine Deployment captures its traffic (the shared volume)
    deployments: tuple[str, ...] = ()  # partition keys this code location tunes (pipelines/sensors.py registers them)

    def __post_init__(self):
        from ops.search.board_store import POSTGRES_SCHEMES, is_url, masked

        if self.board and is_url(self.board):
            scheme = self.board.partition("://")[0].lower()
            if scheme not in POSTGRES_SCHEMES:
                raise ValueError(f"POLYINF_BOARD {masked(self.board)}: not a postgresql:// URL (or a SQLite path)")
            if masked(self.board) != self.board:
                raise ValueError(f"POLYINF_BOARD {masked(self.board)} holds a password, which would show in run "
                                 "config and the UI: give it through POLYINF_BOARD_PASSWORD (a secret) instead")
        if self.s3_bucket and not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", self.s3_bucket):
            raise ValueError(f"POLYINF_S3_BUCKET {self.s3_bucket!r} is not an S3 bucket name (3-63 characters: "
                             "lower-case letters, digits, dots and hyphens)")
        if self.s3_prefix.startswith("/") or self.s3_prefix.endswith("/") or not self.s3_prefix:
            raise ValueError(f"POLYINF_S3_PREFIX {self.s3_prefix!r}: give a key prefix without leading or trailing /")
        if self.s3_endpoint_url and not re.match(r"^https?://[^/]+", self.s3_endpoint_url):
            raise ValueError(f"POLYINF_S3_ENDPOINT_URL {self.s3_endpoint_url!r} is not an http(s) URL")
        for key in self.deployments:
            Deployment.parse(key)

    @classmethod
    def from_env(cls, environ=None) -> "Services":
        env = os.environ if environ is None else environ
        return cls(board=env.get("POLYINF_BOARD", ""), s3_bucket=env.get("POLYINF_S3_BUCKET", ""),
                   s3_prefix=env.get("POLYINF_S3_PREFIX", "polyinf"),
                   s3_endpoint_url=env.get("POLYINF_S3_ENDPOINT_URL", ""),
                   s3_region=env.get("AWS_REGION", env.get("AWS_DEFAULT_REGION", "us-east-1")),
                   capture_dir=env.get("POLYINF_CAPTURE_DIR", ""),
                   deployments=tuple(k.strip() for k in env.get("POLYINF_DEPLOYMENTS", "").split(",") if k.strip()))

    def io_manager(self) -> dict:
        """``{"io_manager": ...}``: outputs pickled to S3 when a bucket is set, so a step's inputs never come
        from another step's disk; {} leaves Dagster's default (pickles under the instance's storage folder)."""
        if not self.s3_bucket:
            return {}
        from dagster_aws.s3 import S3PickleIOManager, S3Resource

        s3 = S3Resource(endpoint_url=self.s3_endpoint_url or None, region_name=self.s3_region,
                        aws_access_key_id=env_secret("AWS_ACCESS_KEY_ID") or None,
                        aws_secret_access_key=env_secret("AWS_SECRET_ACCESS_KEY") or None,
                        aws_session_token=env_secret("AWS_SESSION_TOKEN") or None)
        return {"io_manager": S3PickleIOManager(s3_resource=s3, s3_bucket=self.s3_bucket,
                                                s3_prefix=f"{self.s3_prefix}/io")}


def resources(model: str = "smollm2", trace: str | None = None, requests: int = 16, max_input: int = 64,
              max_output: int = 8, time_scale: float = 1.0, candidates: int = 4, device: str = "cpu",
              dtype: str = "float32", fast_layers: int = 4, artifacts: str = ".polyinf/artifacts",
              endpoint_url: str = "", llm_base_url: str = "", llm_model: str = "polyinf",
              speculation: bool = False, precision: bool = True, services: Services = Services(),
              judge_seconds: float = 0.0, judge_top: int = 0, allow_latency_trade: bool = False,
              watch_requests: int = 24) -> dict:
    """Every resource the graph uses. Secrets (the endpoint's admin token, the LLM key, the board's password,
    S3 credentials) come from the environment through dg.EnvVar; the trace defaults to $POLYINF_TRACE, else
    the shipped Azure slice. ``services``: the shared services, off by default (one machine). ``watch_requests``:
    the requests in each window a deployment is verified on (``Endpoint.watch_requests``)."""
    record = str(Path(artifacts) / "deployments" / "current.json")
    return {
        "runner": EngineRunner(model=model, device=device, dtype=dtype, fast_layers=fast_layers),
        "traffic": TrafficSource(trace=trace or os.environ.get("POLYINF_TRACE", DEFAULT_TRACE),
                                 max_requests=requests, max_input=max_input, max_output=max_output,
                                 time_scale=time_scale),
        "source": VariantSource(candidates=candidates, board=services.board or str(Path(artifacts) / "board.sqlite"),
                                board_password=env_secret("POLYINF_BOARD_PASSWORD"),
                                llm_base_url=llm_base_url, llm_model=llm_model,
                                llm_api_key=env_secret("OPENAI_API_KEY"), speculation=speculation,
                                precision=precision, judge_seconds=judge_seconds, judge_top=judge_top,
                                allow_latency_trade=allow_latency_trade),
        "artifacts": ArtifactStore(root=artifacts, s3_bucket=services.s3_bucket, s3_prefix=services.s3_prefix,
                                   s3_endpoint_url=services.s3_endpoint_url, s3_region=services.s3_region,
                                   aws_access_key_id=env_secret("AWS_ACCESS_KEY_ID"),
                                   aws_secret_access_key=env_secret("AWS_SECRET_ACCESS_KEY")),
        # with a URL the token must be set: dg.EnvVar fails the run naming the variable if it is not
        "endpoint": Endpoint(url=endpoint_url, capture_dir=services.capture_dir, deployment_record=record,
                             watch_requests=watch_requests,
                             admin_token=dg.EnvVar("POLYINF_ADMIN_TOKEN") if endpoint_url
                             else env_secret("POLYINF_ADMIN_TOKEN")),
        "drift": DriftConfig(deployment_record=record, deployments=list(services.deployments)),
        **services.io_manager(),
    }


def code_location_resources(environ=None) -> dict:
    """The code location's resources (pipelines/definitions.py): the shared services, the artifacts' root, the
    default endpoint and the dtype the engine serves in, from the environment (infra/helm/values.yaml sets
    them); each run's partition key then names the model, device and endpoint it tunes."""
    env = os.environ if environ is None else environ
    return resources(artifacts=env.get("POLYINF_ARTIFACTS", ".polyinf/artifacts"),
                     endpoint_url=env.get("POLYINF_ENDPOINT_URL", ""), dtype=env.get("POLYINF_DTYPE", "float32"),
                     services=Services.from_env(env))


def dagster_home_for(artifacts: str, given: str | None = None) -> str:
    """The Dagster instance folder `optimize` records into: ``given``, else $DAGSTER_HOME, else ``dagster``
    beside the artifacts folder."""
    return str(Path(given or os.environ.get("DAGSTER_HOME") or Path(artifacts).parent / "dagster").resolve())


def run_optimize(model: str, trace: str, requests: int, max_input: int, max_output: int, time_scale: float,
                 candidates: int, device: str = "cpu", dtype: str = "float32", fast_layers: int = 4,
                 artifacts: str = ".polyinf/artifacts", endpoint_url: str = "", admin_token: str = "",
                 llm_base_url: str = "", llm_model: str = "polyinf", log_level: str = "DEBUG",
                 dagster_home: str | None = None, speculation: bool = False, precision: bool = True,
                 judge_seconds: float = 0.0, judge_top: int = 0, allow_latency_trade: bool = False,
                 watch_requests: int = 24):
    """Materializes the whole graph in-process for one deployment partition; returns the Dagster result.
    ``log_level``: the console's event log (the CLI's default is INFO: the steps, not every input loaded).
    The run is recorded in a persistent Dagster instance: ``dagster_home``, else $DAGSTER_HOME, else
    ``dagster`` beside the artifacts folder (``.polyinf/dagster``), so that `dagster dev` started with that
    DAGSTER_HOME shows its runs, materializations, metadata and plots afterwards."""
    if admin_token:
        os.environ["POLYINF_ADMIN_TOKEN"] = admin_token  # resources read it through dg.EnvVar
    res = resources(model, trace, requests, max_input, max_output, time_scale, candidates, device, dtype, fast_layers,
                    artifacts, endpoint_url, llm_base_url, llm_model, speculation, precision,
                    judge_seconds=judge_seconds, judge_top=judge_top, allow_latency_trade=allow_latency_trade,
                    watch_requests=watch_requests)
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
