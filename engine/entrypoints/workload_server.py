"""HTTP endpoint over one non-LLM workload (FastAPI + uvicorn, imported only in the entrypoints that serve).

The model is built once; a variant swap changes its forward callable between two batches (``WorkloadRunner.
install``), never the module or its weights.

- ``POST /v1/workloads/{name}/infer``: one request, as engine/entrypoints/workload_protocol.py documents it
  (explicit ``inputs``, or ``size`` and ``seed`` for inputs drawn by the workload's generator). Requests that
  arrive together share forward passes as the workload's batch policy allows. The answer: ``{"id", "workload",
  "variant_id", "outputs": {"shape", "data"}, "latency_ms", "batch_size"}``.
- ``GET /v1/workloads[?size=N]``: the served workload, its size axis and range, and the inputs a request of size N
  sends (default: the workload's middle size).
- ``GET /health``, ``GET /metrics`` (Prometheus: requests by status, latency, batch sizes, queue depth).
- ``/admin`` behind the bearer token: ``GET /admin/variant``, ``POST /admin/variant`` (a WorkloadVariant JSON;
  one that changes precision needs ``"gate": "tolerance"``), ``POST /admin/rollback``.

Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad request, 404 for
another workload's name, 413 for a body over the limit, 503 when the queue is full.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
import uuid

import torch
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.entrypoints.http_base import error_response, secure
from engine.entrypoints.openai_protocol import APIError
from engine.entrypoints.workload_batcher import NoPrevious, QueueFull, WorkloadBatcher
from engine.entrypoints.workload_protocol import (
    Generated, check_size, clip, input_specs, output_json, parse_request, short, variant_from_json,
)
from engine.workloads.static_best import static_best
from engine.workloads.variants import WorkloadRunner, WorkloadVariant, build_runner, deterministic_cublas
from engine.workloads.workload import WorkloadRequest, get_workload

MAX_BODY_BYTES = 64 * 1024**2  # an explicit request's JSON: a 512 x 512 FNO grid of 10 steps is about 50 MB
MAX_ADMIN_BODY_BYTES = 64 * 1024
MAX_QUEUE = 256


class WorkloadMetrics:
    """This server's Prometheus metrics, in a registry of its own (several apps may share a process)."""

    def __init__(self, workload: str) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("polyinf_workload_requests", "inference requests answered, by HTTP status",
                                ["workload", "status"], registry=self.registry)
        self.latency = Histogram("polyinf_workload_request_latency_seconds",
                                 "seconds from a request's arrival to its answer (answered requests)",
                                 ["workload"], registry=self.registry,
                                 buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        self.batch = Histogram("polyinf_workload_batch_size", "requests per forward pass", ["workload"],
                               registry=self.registry, buckets=(1, 2, 4, 8, 16, 32, 64, 128))
        self.queued = Gauge("polyinf_workload_queue_depth", "requests waiting for a forward pass", ["workload"],
                            registry=self.registry)
        self.workload = workload

    def answered(self, status: int) -> None:
        self.requests.labels(self.workload, str(status)).inc()


async def read_json(request: Request, limit: int):
    """The body parsed as JSON (NaN and Infinity refused), read up to ``limit`` bytes: a 413 beyond it."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body ({int(declared)} bytes) is over this server's limit of {limit} bytes",
                       code="body_too_large")
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise APIError(413, f"the request body is over this server's limit of {limit} bytes",
                           code="body_too_large")
        chunks.append(chunk)
    return await asyncio.to_thread(_loads, b"".join(chunks))


class _NonFinite(ValueError):
    pass


def _refuse_constant(name: str):
    raise _NonFinite(name)


def _loads(raw: bytes):
    try:
        return json.loads(raw, parse_constant=_refuse_constant)
    except _NonFinite as e:
        raise APIError(400, f"the body holds {e}: JSON numbers must be finite", code="non_finite") from None
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise APIError(400, "request body is not valid JSON", code="invalid_json") from None


def build_workload_app(runner: WorkloadRunner, admin_token: str | None = None, api_key: str | None = None,
                       max_queue: int = MAX_QUEUE, max_body_bytes: int = MAX_BODY_BYTES,
                       max_wait_s: float = 0.002) -> FastAPI:
    """The app over ``runner`` (its module already built on its device). ``api_key`` / ``admin_token`` as the
    LLM server's (http_base.secure); ``max_wait_s``: how long a batch not yet full waits for more requests."""
    workload = runner.workload
    specs = input_specs(workload)
    metrics = WorkloadMetrics(workload.name)
    batcher = WorkloadBatcher(runner, max_queue=max_queue, max_wait_s=max_wait_s,
                              on_batch=lambda n: metrics.batch.labels(workload.name).observe(n),
                              warmup=lambda: workload.make_inputs([workload.min_size], 0, runner.device))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        try:
            yield
        finally:
            await asyncio.to_thread(batcher.shutdown)

    app = FastAPI(title=f"polyinf workload {workload.name}", description=__doc__, lifespan=lifespan)
    app.state.runner, app.state.batcher, app.state.metrics = runner, batcher, metrics
    authorize = secure(app, admin_token, api_key)

    @app.middleware("http")
    async def _count(request: Request, call_next):
        response = await call_next(request)
        if request.method == "POST" and request.url.path.endswith("/infer"):
            metrics.answered(response.status_code)
        return response

    def _check_name(name: str) -> None:
        if name != workload.name:
            raise APIError(404, f"the workload {short(name, 40)!r} is not served here; this server serves "
                                f"{workload.name!r}", "not_found_error", param="name", code="workload_not_found")

    def _prepare(body) -> WorkloadRequest:
        req = parse_request(workload, specs, body)
        if isinstance(req, Generated):
            req = workload.make_inputs([req.size], req.seed)[0]
        return WorkloadRequest(req.size, {k: v.to(runner.device) for k, v in req.tensors.items()})

    @app.post("/v1/workloads/{name}/infer")
    async def infer(name: str, request: Request):
        t0 = time.perf_counter()
        _check_name(name)
        if not batcher.can_submit():  # before reading a body that would only wait
            raise APIError(503, "the server is at capacity: too many requests queued; retry later", "server_error",
                           code="queue_full")
        req = await asyncio.to_thread(_prepare, await read_json(request, max_body_bytes))
        try:
            future = batcher.submit(req)
        except QueueFull:
            raise APIError(503, "the server is at capacity: too many requests queued; retry later", "server_error",
                           code="queue_full") from None
        metrics.queued.labels(workload.name).set(batcher.queued)
        try:
            served = await future
        except ValueError as e:
            raise APIError(400, f"{workload.name} refused the request: {clip(e)}", code="model_refused") from None
        except Exception as e:  # noqa: BLE001 - the server stays up; the client learns what failed
            raise APIError(500, f"inference failed: {type(e).__name__}: {clip(e)}", "server_error") from None
        outputs = await asyncio.to_thread(output_json, served.output)
        latency = time.perf_counter() - t0
        metrics.latency.labels(workload.name).observe(latency)
        payload = {"id": f"wl-{uuid.uuid4().hex}", "workload": workload.name, "variant_id": served.variant_id,
                   "outputs": outputs, "latency_ms": round(latency * 1e3, 3), "batch_size": served.batch_size}
        return Response(await asyncio.to_thread(json.dumps, payload), media_type="application/json")

    @app.get("/v1/workloads")
    async def describe(size: int | None = None):
        n = workload.default_size if size is None else check_size(workload, size)
        return {"object": "list", "data": [{
            "name": workload.name, "field": workload.field, "size_axis": workload.size_axis,
            "min_size": workload.min_size, "max_size": workload.max_size, "size_levels": list(workload.size_levels),
            "batch_policy": {"max_batch": workload.batch.max_batch, "grouping": workload.batch.grouping},
            "variant_id": runner.variant.variant_id, "device": str(runner.device),
            "size": n, "inputs": {s.name: s.describe(n) for s in specs},
            "infer": f"/v1/workloads/{workload.name}/infer"}]}

    @app.get("/health")
    async def health():
        if not batcher.alive:
            return error_response(503, "the batch worker stopped", "server_error")
        return {"status": "ok", "workload": workload.name, "variant_id": runner.variant.variant_id}

    @app.get("/metrics")
    async def prometheus():
        metrics.queued.labels(workload.name).set(batcher.queued)
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ---- admin ----------------------------------------------------------------------------------
    def _variant_answer() -> dict:
        prev = batcher.previous
        return {"workload": workload.name, "device": str(runner.device), "active": runner.variant.to_json(),
                "previous": prev.to_json() if prev else None}

    @app.get("/admin/variant")
    async def get_variant(request: Request):
        authorize(request)
        return _variant_answer()

    @app.post("/admin/variant")
    async def apply_variant(request: Request):
        authorize(request)
        variant, gate = variant_from_json(await read_json(request, MAX_ADMIN_BODY_BYTES))
        try:
            await batcher.swap(variant)
        except ValueError as e:
            raise APIError(400, f"variant refused on {runner.device}, the previous variant stays active: "
                                f"{clip(e)}", param="variant", code="variant_refused") from None
        return {**_variant_answer(), "gate": gate}

    @app.post("/admin/rollback")
    async def rollback(request: Request):
        authorize(request)
        try:
            await batcher.swap(None)
        except NoPrevious as e:
            raise APIError(409, str(e), code="rollback_refused") from None
        except ValueError as e:
            raise APIError(400, f"rollback refused, the active variant stays: {clip(e)}",
                           code="rollback_refused") from None
        return _variant_answer()

    return app


def serve_workload(name: str, host: str = "127.0.0.1", port: int = 8000, device: str = "cpu",
                   variant: WorkloadVariant | None = None, admin_token: str | None = None,
                   api_key: str | None = None, log_level: str = "warning", max_queue: int = MAX_QUEUE,
                   max_body_bytes: int = MAX_BODY_BYTES) -> None:
    """Builds ``name``'s model on ``device`` once and serves it until stopped, with ``variant`` (default: the
    workload's static-best on the device)."""
    import uvicorn

    deterministic_cublas()  # before the model's first CUDA matmul: a deterministic variant swapped in later too
    workload = get_workload(name)
    variant = variant or static_best(workload, device)
    runner = build_runner(workload, variant, workload.build(torch.device(device)), device)
    app = build_workload_app(runner, admin_token=admin_token, api_key=api_key, max_queue=max_queue,
                             max_body_bytes=max_body_bytes)
    print(f"polyinf: serving workload {name!r} on http://{host}:{port} (variant {variant.variant_id}: "
          f"{variant.describe()}, {device})", file=sys.stderr, flush=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_keep_alive=65)
