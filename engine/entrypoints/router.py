"""Data-parallel replicas behind one endpoint: the router in the API process, one engine server per replica.

Each replica is a whole `polyinf serve` of the variant (with tp > 1, a tensor-parallel group of its own) in its
own process on loopback, on its own GPUs (``CUDA_VISIBLE_DEVICES``) or its share of the CPU's cores. The router
forwards the OpenAI routes to one replica per request:

- by load: the replica with the fewest requests in flight;
- by conversation: a request whose conversation (its first messages, or its prompt's first tokens) went to a
  replica before goes there again, where its prefix is cached, unless that replica has ``AFFINITY_SLACK`` more
  requests in flight than the least loaded one.

A replica that cannot be reached is marked down (its health is checked every second) and gets no new requests;
its requests in flight fail with a clear error (a stream ends with an error event), the others go on. A replica
whose process exited is started again and brought to the active variant before it takes requests. Admin
commands go to every replica: a swap that any replica refuses is rolled back on the ones that took it.

Replicas get their own admin token (in memory, through the pipe that starts them) and none of this process's
secrets; the router checks the clients' API key and admin token itself.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import secrets
import sys
import threading
import time
from collections import OrderedDict

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from engine.errors import ConfigError
from engine.entrypoints.openai_protocol import APIError
from engine.entrypoints.replicas import Replica, ReplicaSet, free_port
from engine.entrypoints.http_base import error_response, secure, variant_from_body
from engine.config.variant import VariantSpec

log = logging.getLogger("polyinf.router")

AFFINITY_SLACK = 4  # requests in flight a conversation's replica may have above the least loaded one
AFFINITY_ENTRIES = 50_000  # conversations remembered (least recently seen forgotten first)
KEY_CHARS, KEY_TOKENS = 2048, 256  # how much of a conversation identifies it


class _Families:
    """Prometheus families to expose (``generate_latest`` takes anything with ``collect``)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self):
        return self.families


def merged_metrics(texts: dict[int, str]) -> _Families:
    """Every replica's series, each with a ``replica`` label, one family per name."""
    families: dict[str, Metric] = {}
    for index, text in texts.items():
        for fam in text_string_to_metric_families(text):
            merged = families.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type, fam.unit))
            for s in fam.samples:
                merged.add_sample(s.name, {**s.labels, "replica": str(index)}, s.value, s.timestamp, s.exemplar)
    return _Families(list(families.values()))


def conversation_key(path: str, body: dict) -> str | None:
    """What identifies the conversation a request continues: a chat's first two messages (system prompt and
    first user turn), a completion's first characters or token ids."""
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        head = json.dumps(messages[:2], sort_keys=True, default=str)[:KEY_CHARS]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            head = prompt[:KEY_CHARS]
        elif isinstance(prompt, list):
            head = json.dumps(prompt[:KEY_TOKENS], default=str)
        else:
            return None
    return hashlib.sha256(head.encode()).hexdigest()


class Router:
    """Picks the replica for each request (load, then conversation affinity) and forwards it."""

    def __init__(self, replicas: ReplicaSet) -> None:
        self.set = replicas
        self.affinity: OrderedDict[str, int] = OrderedDict()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=64))
        self.registry = CollectorRegistry()
        self.up = Gauge("polyinf:replica_up", "1 while the replica takes requests.", ["replica"],
                        registry=self.registry)
        self.inflight = Gauge("polyinf:replica_requests_in_flight", "Requests the router has in flight on the "
                              "replica.", ["replica"], registry=self.registry)

    @property
    def replicas(self) -> list[Replica]:
        return self.set.replicas

    def pick(self, key: str | None, exclude: set[int] = frozenset()) -> Replica:
        live = [r for r in self.replicas if r.up and r.index not in exclude]
        if not live:
            raise APIError(503, "no engine replica is up; try again shortly", "server_error", code="no_replica")
        least = min(live, key=lambda r: (r.inflight, r.served))
        chosen = least
        if key is not None:
            held = self.affinity.get(key)
            home = next((r for r in live if r.index == held), None)
            if home is not None and home.inflight <= least.inflight + AFFINITY_SLACK:
                chosen = home
            self.affinity[key] = chosen.index
            self.affinity.move_to_end(key)
            while len(self.affinity) > AFFINITY_ENTRIES:
                self.affinity.popitem(last=False)
        return chosen

    async def forward(self, path: str, body: bytes) -> Response:
        try:
            parsed = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise APIError(400, "request body is not valid JSON", code="invalid_json") from None
        key = conversation_key(path, parsed) if isinstance(parsed, dict) else None
        tried: set[int] = set()
        while True:
            r = self.pick(key, tried)
            r.inflight += 1
            try:
                resp = await self.client.send(self.client.build_request(
                    "POST", r.url + path, content=body, headers={"content-type": "application/json"}), stream=True)
                break
            except (httpx.ConnectError, httpx.ConnectTimeout):  # nothing reached it: another replica takes it
                r.inflight -= 1
                r.up = False
                tried.add(r.index)
            except httpx.HTTPError as e:
                r.inflight -= 1
                r.failed += 1
                r.up = False
                raise APIError(502, f"engine replica {r.index} failed before answering: {type(e).__name__}",
                               "server_error", code="replica_failed") from None
        r.served += 1
        if resp.headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(self._relay(r, resp), status_code=resp.status_code,
                                     media_type="text/event-stream")
        try:
            content = await resp.aread()
        except httpx.HTTPError as e:
            r.failed += 1
            r.up = False
            raise APIError(502, f"engine replica {r.index} stopped while serving the request: {type(e).__name__}",
                           "server_error", code="replica_failed") from None
        finally:
            await resp.aclose()
            r.inflight -= 1
        return Response(content, status_code=resp.status_code, media_type=resp.headers.get("content-type"))

    async def _relay(self, r: Replica, resp: httpx.Response):
        tail, failure = b"", ""
        try:
            try:
                async for chunk in resp.aiter_raw():
                    tail = (tail + chunk)[-64:]
                    yield chunk
                if resp.status_code == 200 and b"[DONE]" not in tail and b"\"error\"" not in tail:  # cut short
                    failure = "the stream ended early"
            except httpx.HTTPError as e:
                failure = type(e).__name__
            if failure:
                r.failed += 1
                r.up = False
                error = {"error": {"message": f"engine replica {r.index} stopped while serving the request: "
                                              f"{failure}", "type": "server_error", "code": "replica_failed"}}
                yield f"\n\ndata: {json.dumps(error)}\n\n".encode()
        finally:
            await resp.aclose()
            r.inflight -= 1

    async def get(self, path: str) -> Response:
        r = self.pick(None)
        try:
            resp = await self.client.get(r.url + path)
        except httpx.HTTPError as e:
            r.up = False
            raise APIError(502, f"engine replica {r.index} failed: {type(e).__name__}", "server_error") from None
        return Response(resp.content, status_code=resp.status_code, media_type=resp.headers.get("content-type"))

    async def metrics(self) -> str:
        async def one(r: Replica):
            try:
                return r.index, (await self.client.get(r.url + "/metrics", timeout=5)).text
            except httpx.HTTPError:
                return r.index, None
        texts = dict(await asyncio.gather(*(one(r) for r in self.replicas if r.up)))
        for r in self.replicas:
            self.up.labels(replica=str(r.index)).set(1 if r.up else 0)
            self.inflight.labels(replica=str(r.index)).set(r.inflight)
        merged = merged_metrics({i: t for i, t in texts.items() if t is not None})
        return (generate_latest(self.registry) + generate_latest(merged)).decode()

    async def admin_all(self, method: str, path: str, body: dict | None = None) -> list[tuple[Replica, httpx.Response]]:
        live = [r for r in self.replicas if r.up]
        if not live:
            raise APIError(503, "no engine replica is up", "server_error", code="no_replica")

        async def one(r: Replica):
            return r, await self.client.request(method, r.url + path, json=body, headers=r.admin(), timeout=None)
        return list(await asyncio.gather(*(one(r) for r in live)))

    async def watch(self) -> None:
        while True:
            await asyncio.gather(*(asyncio.to_thread(self.set.check, r) for r in self.replicas))
            await asyncio.sleep(1.0)


def build_router_app(replicas: ReplicaSet, model_name: str, admin_token: str | None = None,
                     api_key: str | None = None) -> FastAPI:
    """The OpenAI routes, /health, /metrics and /admin of one endpoint over ``replicas``. ``api_key`` None:
    $POLYINF_API_KEY, else $VLLM_API_KEY; an empty one: the routes stay open."""
    router = Router(replicas)
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        watch = asyncio.ensure_future(router.watch())
        try:
            yield
        finally:
            watch.cancel()
            await router.client.aclose()

    app = FastAPI(title="polyinf router", description=__doc__, lifespan=lifespan)
    authorize = secure(app, admin_token, api_key)
    app.state.router = router

    def forwarder(path: str):
        async def route(request: Request):
            return await router.forward(path, await request.body())
        return route

    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        app.add_api_route(path, forwarder(path), methods=["POST"])

    @app.get("/v1/models")
    async def models():
        return await router.get("/v1/models")

    @app.get("/health")
    async def health():
        up = [r.index for r in router.replicas if r.up]
        body = {"status": "ok" if up else "down", "replicas": [
            {"replica": r.index, "up": r.up, "pid": r.process.pid if r.process else None, "in_flight": r.inflight,
             "served": r.served, "failed": r.failed, "restarts": r.restarts} for r in router.replicas]}
        return JSONResponse(body, status_code=200 if up else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(await router.metrics(), media_type=CONTENT_TYPE_LATEST)

    dp = len(replicas.replicas)

    def as_served(active: dict | None) -> dict | None:
        """A replica's variant as this endpoint serves it: with ``dp`` replicas."""
        if active is None:
            return None
        fields = {k: v for k, v in active.items() if k != "variant_id"}  # the id is recomputed for dp
        return VariantSpec.from_json({**fields, "dp": dp}).to_json()

    @app.get("/admin/variant")
    async def get_variant(request: Request):
        authorize(request)
        got = await router.admin_all("GET", "/admin/variant")
        first = got[0][1].json()
        return {**first, "active": as_served(first["active"]), "previous": as_served(first["previous"]),
                "replicas": [{"replica": r.index, "variant_id": resp.json()["active"]["variant_id"]}
                             for r, resp in got]}

    @app.post("/admin/variant")
    async def apply_variant(request: Request):
        authorize(request)
        spec = await variant_from_body(request)
        if spec.dp != dp:
            raise APIError(422, f"variant {spec.variant_id} has dp {spec.dp}; this endpoint runs {dp} replicas: "
                                "changing that needs a restart", code="variant_refused")
        body = dataclasses.replace(spec, dp=1).to_json()  # what each replica runs
        got = await router.admin_all("POST", "/admin/variant", body)
        refused = [(r, resp) for r, resp in got if resp.status_code != 200]
        if refused:
            took = [r for r, resp in got if resp.status_code == 200]
            await asyncio.gather(*(router.client.post(r.url + "/admin/rollback", headers=r.admin(), timeout=None)
                                   for r in took))
            r, resp = refused[0]
            try:
                message = resp.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = resp.text[:300]
            undone = f" (rolled back on replicas {[x.index for x in took]})" if took else ""
            return error_response(resp.status_code if resp.status_code < 500 else 502,
                                  f"replica {r.index}: {message}{undone}", code="variant_refused")
        replicas.active_variant = body
        return {**got[0][1].json(), "variant_id": spec.variant_id, "replicas": len(got)}

    @app.post("/admin/rollback")
    async def rollback(request: Request):
        authorize(request)
        got = await router.admin_all("POST", "/admin/rollback")
        bad = [(r, resp) for r, resp in got if resp.status_code != 200]
        if bad:
            r, resp = bad[0]
            return error_response(422, f"replica {r.index}: {resp.text[:300]}", code="rollback_refused")
        active = (await router.admin_all("GET", "/admin/variant"))[0][1].json()["active"]
        replicas.active_variant = active
        return {**got[0][1].json(), "variant_id": as_served(active)["variant_id"], "replicas": len(got)}

    return app


def serve_replicas(config, name: str, host: str = "127.0.0.1", port: int = 8000, admin_token: str | None = None,
                   api_key: str | None = None, capture_dir: str | None = None, capture_prompts: bool = False,
                   log_level: str = "warning") -> None:
    """Starts the variant's ``dp`` replicas and serves them behind the router until stopped."""
    import uvicorn

    variant = config.initial_variant()
    t0 = time.time()
    replicas = ReplicaSet.start(config, variant.dp, name, capture_dir, capture_prompts)
    try:
        app = build_router_app(replicas, name, admin_token, api_key)
        print(f"polyinf: serving {name!r} on http://{host}:{port} over {variant.dp} replicas"
              + (f" of {variant.tp} tensor-parallel ranks" if variant.tp > 1 else "")
              + f" (variant {variant.variant_id}; started in {time.time() - t0:.1f} s)", file=sys.stderr, flush=True)
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_keep_alive=65)
    finally:
        replicas.stop()


class ServedLayout:
    """A variant served in its parallel layout on loopback, for the slow tier to replay against: one server (its
    tp ranks) or ``dp`` replicas behind a router running in a thread of this process. ``start_s``: from starting
    the processes to serving, what a restart-scope swap to this layout costs."""

    def __init__(self, config, name: str = "polyinf", startup_s: float = 600.0) -> None:
        self.config, self.name, self.startup_s = config, name, startup_s
        self.url, self.start_s = "", 0.0
        self.replicas: ReplicaSet | None = None
        self._server = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "ServedLayout":
        import uvicorn

        t0 = time.time()
        dp = self.config.initial_variant().dp
        self.replicas = ReplicaSet.start(self.config, dp, self.name, startup_s=self.startup_s, restart=False)
        try:
            if dp == 1:
                self.url = self.replicas.replicas[0].url
            else:
                port = free_port()
                app = build_router_app(self.replicas, self.name, admin_token=secrets.token_hex(16), api_key="")
                self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                                             timeout_keep_alive=65))
                self._thread = threading.Thread(target=self._server.run, daemon=True, name="layout-router")
                self._thread.start()
                self.url = f"http://127.0.0.1:{port}"
                while not self._server.started:
                    if not self._thread.is_alive():
                        raise ConfigError("the router did not start")
                    time.sleep(0.05)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.start_s = time.time() - t0
        return self

    def __exit__(self, *exc) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=30)
        if self.replicas is not None:
            self.replicas.stop()
