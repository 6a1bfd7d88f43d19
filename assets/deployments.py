"""Deployments as partitions: one code location tunes several, each run for the one its partition key names.

A key is ``model|device|endpoint`` (``smollm2|cpu|embedded``, ``/models/llama|cuda|http://polyinf-engine:8000``).
A run reads its deployment from the key, not from the code location's resources: ``for_deployment`` gives the
run's engine runner (the key's model and device) and endpoint (the key's URL, or the embedded server), with the
rest of their settings (dtype, fast-tier layers, admin token, watch window) from the resources.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import dagster as dg

# One partition per deployment: served model x hardware x endpoint.
DEPLOYMENTS = dg.DynamicPartitionsDefinition(name="deployments")

EMBEDDED = "embedded"  # the endpoint part of a key for a server the run starts on loopback
DEVICES = re.compile(r"^(cpu|cuda(:\d+)?)$")


def _clean(x: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.:@/-]", "_", x)


def deployment_key(model: str, device: str, endpoint: str) -> str:
    """A partition key for a deployment, e.g. 'smollm2|cpu|embedded'."""
    return "|".join(_clean(x) for x in (model, device, endpoint or EMBEDDED))


@dataclass(frozen=True)
class Deployment:
    """What a partition key names. ``endpoint`` is "" for the embedded server."""

    model: str
    device: str
    endpoint: str = ""

    def __post_init__(self):
        if not self.model:
            raise ValueError("deployment: no model")
        if not DEVICES.match(self.device):
            raise ValueError(f"deployment {self.key}: device {self.device!r} is not cpu, cuda or cuda:N")
        if self.endpoint and not re.match(r"^https?://[^/|]+", self.endpoint):
            raise ValueError(f"deployment {self.key}: endpoint {self.endpoint!r} is not an http(s) URL "
                             f"(or {EMBEDDED!r} for a server the run starts)")

    @property
    def key(self) -> str:
        return deployment_key(self.model, self.device, self.endpoint)

    @classmethod
    def parse(cls, key: str) -> "Deployment":
        parts = key.split("|")
        if len(parts) != 3 or not all(parts):
            raise ValueError(f"deployment key {key!r} is not model|device|endpoint "
                             f"(e.g. smollm2|cpu|{EMBEDDED} or /models/llama|cuda|http://polyinf-engine:8000)")
        model, device, endpoint = parts
        return cls(model, device, "" if endpoint == EMBEDDED else endpoint)


def record_file(folder: Path, key: str) -> Path:
    """Where the deployment ``key``'s record lives in ``folder`` (beside the latest deployment's current.json):
    a file name readable by eye and unique by the key's hash (keys hold '|', '/' and ':')."""
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "_", key).strip("_")[:80]
    return Path(folder) / f"{readable}-{hashlib.sha256(key.encode()).hexdigest()[:10]}.json"


def for_deployment(context, runner, endpoint=None):
    """The run's engine runner (and endpoint) for the deployment its partition key names: the resources'
    copies with the key's model, device and endpoint URL. Unpartitioned (a test's direct call), as given."""
    if not context.has_partition_key:
        return runner if endpoint is None else (runner, endpoint)
    dep = Deployment.parse(context.partition_key)
    from engine.workloads.workload import WORKLOADS

    if dep.model in WORKLOADS:
        raise dg.Failure(f"deployment {dep.key!r} is a workload's ({dep.model!r}), not an LLM's: the "
                         "'optimize_workload' job tunes it, not 'reoptimize'")
    runner = runner.model_copy(update={"model": dep.model, "device": dep.device})
    if endpoint is None:
        return runner
    return runner, endpoint.model_copy(update={"url": dep.endpoint})
