"""Dagster resources: the outside systems the assets use, each behind a small interface."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import dagster as dg

_LOCK = threading.Lock()
_LOADED: dict[tuple, object] = {}  # weights loaded once per process, shared by every engine the run builds
_SERVERS: dict[str, object] = {}  # embedded endpoints started by this process


def env_secret(name: str):
    """A secret for a resource field: ``dg.EnvVar(name)`` when the variable is set, so its value never enters
    run config, logs or the UI (they show the variable's name); "" when it is not (what needs it stays off)."""
    return dg.EnvVar(name) if os.environ.get(name) else ""


class EngineRunner(dg.ConfigurableResource):
    """Builds engines of a model with the weights loaded once; the fast tier uses the first few layers."""

    model: str = "smollm2"
    device: str = "cpu"
    dtype: str = "float32"
    fast_layers: int = 4
    num_kv_blocks: int = 512
    # devices a parallel layout may span; 0: the GPUs there are with a cuda device, else 1 (no layouts searched)
    layout_devices: int = 0

    def devices(self) -> int:
        if self.layout_devices > 0:
            return self.layout_devices
        if not self.device.startswith("cuda"):
            return 1
        import torch

        return max(1, torch.cuda.device_count())

    def config(self, layers: int | None = None, variant=None):
        from engine import EngineConfig, resolve

        return EngineConfig(source=resolve(self.model), device=self.device, dtype=self.dtype, layers=layers,
                            num_kv_blocks=self.num_kv_blocks, variant=variant, load_tokenizer=layers is None)

    def engine(self, layers: int | None = None, variant=None):
        from engine.core.llm_engine import LLMEngine, LoadedModel

        key = (self.model, self.device, self.dtype, layers)
        with _LOCK:
            loaded = _LOADED.get(key)
            if loaded is None:
                loaded = _LOADED[key] = LoadedModel.load(self.config(layers))
        return LLMEngine(self.config(layers, variant), loaded)

    def model_args(self) -> list[str]:
        return ["--model", self.model, "--device", self.device, "--dtype", self.dtype,
                "--num-kv-blocks", str(self.num_kv_blocks)]


class TrafficSource(dg.ConfigurableResource):
    """Where traffic comes from, and the slice the run uses: a trace file (capture, Mooncake or Azure), or,
    when ``capture_dir`` is set, what a deployment captured between two positions of its capture (the drift
    sensors and the nightly schedule set these through the run's config: the traffic since the last build)."""

    trace: str
    capture_dir: str = ""  # an endpoint's capture directory, read instead of ``trace``
    capture_from: int = 0  # capture positions [capture_from, capture_until) (see ops.release.drift.read_capture)
    capture_until: int | None = None  # None: up to the newest record
    max_requests: int = 16  # a trace file's first records; a capture's newest (the slow tier's slice)
    max_input: int = 64  # clip prompt lengths to what the machine can replay in time
    max_output: int = 8
    time_scale: float = 1.0  # the trace's own arrival times: its rate is the traffic's observed rate
    lenient: bool = False  # count and skip malformed rows instead of failing on the first

    def records(self) -> list:
        """The TraceRecords the run tunes on, arrival-sorted."""
        if not self.capture_dir:
            from ops.traffic.traces import load_trace

            return load_trace(self.trace, lenient=self.lenient)[: self.max_requests]
        return list(self.capture().records[-self.max_requests:])

    def capture(self):
        """The ops.release.drift.CaptureSlice of the configured range of ``capture_dir``."""
        from ops.release.drift import read_capture

        return read_capture(self.capture_dir, self.capture_from, self.capture_until, lenient=self.lenient)

    def describe(self, records: list) -> dict:
        """Which traffic ``records`` are, for asset metadata: source, how many, the time window."""
        window = f"{records[0].arrival_s:.1f} s .. {records[-1].arrival_s:.1f} s" if records else "no records"
        if not self.capture_dir:
            return {"source": self.trace, "source kind": "trace file", "requests": len(records), "window": window}
        until = "newest" if self.capture_until is None else self.capture_until
        return {"source": self.capture_dir, "source kind": "capture", "requests": len(records),
                "capture positions": f"[{self.capture_from}, {until})", "window": window}

    def trace_file(self) -> str:
        """A trace file for the benchmark workers (which load a file by path): the trace itself, or the capture's
        range written beside the capture, named by its content, in arrival order: the slow tier replays its first
        ``max_requests``, the judge's windows and its held-out part come from the rest (ops/judge/paired.py)."""
        if not self.capture_dir:
            return self.trace
        import hashlib
        import json

        recs = list(self.capture().records)  # in arrival order: the slow tier replays the first, the judge the rest
        text = "".join(json.dumps(r.to_json(), separators=(",", ":")) + "\n" for r in recs)
        path = Path(self.capture_dir) / "slices" / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.jsonl"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(text)
            tmp.replace(path)
        return str(path)


class VariantSource(dg.ConfigurableResource):
    """Where candidates come from: agents on the message board (cost-model seeding, traffic rules, local
    search, and an LLM agent when ``llm_base_url`` is set), measured by workers draining the queue."""

    board: str = ".polyinf/board.sqlite"  # a SQLite file, or a postgresql:// URL every step's process reaches
    board_password: str = ""  # env_secret("POLYINF_BOARD_PASSWORD"): the Postgres board's, kept out of the URL
    candidates: int = 4  # proposals measured on the fast tier besides the baseline
    # best fast-tier variants replayed on the slow tier beside static-best: one keeps the main job within minutes
    # on a 2-core CPU, where a slow-tier variant (replay and rate probes of the full model) takes one to two
    slow_top: int = 1
    slow_layers: int = 0  # the slow tier's depth; 0: the whole model (fewer: a cheap run that checks the wiring)
    # static-best with prompt-lookup speculation on the slow tier too, where the replay is real text; off by
    # default: the embedded replay's outputs (16 tokens) leave it little to gain for another slow-tier variant's time
    speculation: bool = False
    # static-best with quantized weights (int8, or FP8 on a GPU with FP8 tensor cores) on the slow tier too; the
    # gates on the build judge its quality before it ships (figures: bench/RESULTS.md, "CPU: weight precision")
    precision: bool = True
    llm_base_url: str = ""
    llm_model: str = "polyinf"
    llm_api_key: str = ""  # env_secret("OPENAI_API_KEY")
    # the judge (ops/paired.JudgeConfig): its time budget (0: the device's default, 140 s on a CPU, 600 s on a
    # GPU), the candidates it replays against static-best, and whether latency at the traffic's own rate may be
    # traded for capacity (the report then names the trade)
    judge_seconds: float = 0.0
    judge_top: int = 0  # 0: the device's default (1 on a CPU, 2 on a GPU)
    allow_latency_trade: bool = False

    def judge_config(self, device: str):
        from ops.judge.paired import JudgeConfig

        base = JudgeConfig.for_cpu() if device == "cpu" else JudgeConfig()
        kw = {"allow_trade": self.allow_latency_trade}
        if self.judge_seconds > 0:
            kw["seconds"] = self.judge_seconds
        if self.judge_top > 0:
            kw["top"] = self.judge_top
        import dataclasses

        return dataclasses.replace(base, **kw)

    def board_url(self) -> str:
        """What the board is opened with: ``board`` with ``board_password`` put into a Postgres URL (the URL
        the resource shows names none). Never log it: the board's ``where`` is the masked form."""
        from ops.search.board_store import with_password

        return with_password(self.board, self.board_password)

    def agents(self, board):
        """The default agents (ops.search.tune.default_agents), with the LLM agent when ``llm_base_url`` is set."""
        from ops.search.llm_agent import LLMAgent
        from ops.search.tune import default_agents

        llm = None
        if self.llm_base_url:
            llm = LLMAgent(base_url=self.llm_base_url, model=self.llm_model, api_key=self.llm_api_key or "none",
                           board=board)
        return default_agents(llm)

    def search(self, context, runner: "EngineRunner", traffic: "TrafficSource", hardware=None, cost_plan=None):
        """The run's search on the board (one per Dagster run, so every asset step finds the same one)."""
        from ops.search.tune import Search

        # one timed replay at the trace's rate per variant; the judge measures the capacities it compares
        cfg = search_config(runner, traffic, slow_repeats=1, capacity_probes=0, slow_layers=self.slow_layers or None)
        return Search.start(cfg, self.board_url(), f"run-{context.run.run_id}", hardware=hardware, cost_plan=cost_plan,
                            log=context.log.info)


def search_config(runner: EngineRunner, traffic: TrafficSource, **tiers):
    """What a search measures, from the model and traffic resources; ``tiers``: SearchConfig's tier and SLO
    fields (slow_layers, slow_repeats, slo_ttft_s, ...). The CLI's ``tune`` and the assets both build it here."""
    from ops.search.config import SearchConfig

    return SearchConfig(model=runner.model, trace=traffic.trace_file(), device=runner.device, dtype=runner.dtype,
                        requests=traffic.max_requests, max_input=traffic.max_input, max_output=traffic.max_output,
                        time_scale=traffic.time_scale, fast_layers=runner.fast_layers,
                        num_kv_blocks=runner.num_kv_blocks, lenient=traffic.lenient,
                        layout_devices=runner.devices(), **tiers)


class ArtifactStore(dg.ConfigurableResource):
    """Build artifacts (variant JSON, reports): the local filesystem by default, S3 (boto3) when a bucket is set.

    Credentials come through dg.EnvVar (``env_secret("AWS_ACCESS_KEY_ID")``...), never from code; left empty,
    boto3's own chain (the pod's IAM role, a profile) supplies them.
    """

    root: str = ".polyinf/artifacts"
    s3_bucket: str = ""
    s3_prefix: str = "polyinf"
    s3_endpoint_url: str = ""  # an S3-compatible server; empty: AWS
    s3_region: str = "us-east-1"
    aws_access_key_id: str = ""  # env_secret("AWS_ACCESS_KEY_ID")
    aws_secret_access_key: str = ""  # env_secret("AWS_SECRET_ACCESS_KEY")

    def _s3(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.s3_endpoint_url or None, region_name=self.s3_region,
                            aws_access_key_id=self.aws_access_key_id or None,
                            aws_secret_access_key=self.aws_secret_access_key or None)

    def put(self, key: str, text: str | bytes) -> str:
        """Stores ``text`` (or bytes, e.g. a PNG) under ``key``; returns where it went (a path or an s3:// URL)."""
        body = text.encode() if isinstance(text, str) else text
        if self.s3_bucket:
            name = f"{self.s3_prefix}/{key}"
            self._s3().put_object(Bucket=self.s3_bucket, Key=name, Body=body)
            return f"s3://{self.s3_bucket}/{name}"
        path = Path(self.root) / key
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_bytes(body)
        tmp.replace(path)
        return str(path)

    def get(self, key: str) -> str:
        if self.s3_bucket:
            obj = self._s3().get_object(Bucket=self.s3_bucket, Key=f"{self.s3_prefix}/{key}")
            return obj["Body"].read().decode()
        return (Path(self.root) / key).read_text()


class Endpoint(dg.ConfigurableResource):
    """The serving endpoint to deploy to: an existing one (``url``: on Kubernetes the engine Deployment's Service,
    whose admin API swaps the running engine's variant; the admin token through dg.EnvVar), or, embedded, a
    `polyinf serve` this process starts on loopback. A run's partition key names its endpoint
    (assets/deployments.py), so one code location deploys to several."""

    url: str = ""
    admin_token: str = ""  # dg.EnvVar("POLYINF_ADMIN_TOKEN")
    # where an existing endpoint captures its traffic, read by the drift sensors: a volume the engine and the
    # code location both mount (on Kubernetes, the shared PersistentVolumeClaim)
    capture_dir: str = ""
    # where the deployed build is recorded for the sensors; empty: deployments/current.json under the artifacts' root
    deployment_record: str = ""
    served_model_name: str = "polyinf"
    # requests in each of the two windows of held-out traffic a deployment is verified on (before and after)
    watch_requests: int = 24
    # rounds of such windows at most: a round whose load generator lagged behind its schedule is void, and the next
    # replays the serving form and the build again on fresh windows
    watch_rounds: int = 2

    def connect(self, runner: EngineRunner, capture_dir: str | None = None) -> tuple[str, str]:
        if self.url:
            if not self.admin_token:
                raise dg.Failure(f"endpoint {self.url}: no admin token (set POLYINF_ADMIN_TOKEN, the engine's "
                                 "secret, where the code location and its steps run)")
            return self.url, self.admin_token
        from ops.release.deploy import ServerProcess

        with _LOCK:
            server = _SERVERS.get(runner.model)
            if server is None or server.proc.poll() is not None:
                server = _SERVERS[runner.model] = ServerProcess(
                    runner.model_args(), self.served_model_name, Path(capture_dir) if capture_dir else None)
        return server.url, server.token


def stop_embedded_servers() -> None:
    with _LOCK:
        for server in _SERVERS.values():
            server.stop()
        _SERVERS.clear()
