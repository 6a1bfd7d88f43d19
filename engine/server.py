"""OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn, imported only here).

Endpoints: /v1/models, /v1/completions, /v1/chat/completions (``stream: true`` as server-sent
events ending with ``[DONE]``), /health, /metrics (Prometheus), and admin endpoints under
/admin (active variant, apply, rollback) behind a bearer token. Errors have OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import os
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.async_engine import AsyncEngine
from engine.errors import EngineError, RequestError, VariantError
from engine.llm_engine import RequestOutput
from engine.sampling_params import SamplingParams
from engine.variant import VariantSpec


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def _error(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None) -> JSONResponse:
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": type_, "param": param, "code": code}})


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = Field(default=None)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    ignore_eos: bool = False
    user: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer"]
    content: str
    name: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    # accepted for compatibility with OpenAI clients; decoding is not constrained to the format
    response_format: dict[str, Any] | None = None


def build_app(aengine: AsyncEngine, model_name: str, admin_token: str | None = None) -> FastAPI:
    app = FastAPI(title="polyinf", description=__doc__)
    engine = aengine.engine
    admin_token = admin_token or os.environ.get("POLYINF_ADMIN_TOKEN") or None

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return _error(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        if first.get("type") == "json_invalid":
            return _error(400, "request body is not valid JSON", code="invalid_json")
        if first.get("type") == "extra_forbidden":
            return _error(400, f"unknown field {loc!r}", param=loc, code="unknown_field")
        return _error(400, f"{loc}: {first.get('msg', 'invalid request')}", param=loc or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException):
        return _error(e.status_code, str(e.detail), "not_found_error" if e.status_code == 404 else "invalid_request_error")

    def _check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")

    def _params(req: _Sampling, max_tokens: int | None) -> SamplingParams:
        if req.n != 1:
            raise APIError(400, "only n=1 is supported", param="n")
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        try:
            return SamplingParams(max_tokens=16 if max_tokens is None else max_tokens, temperature=req.temperature,
                                  top_p=req.top_p, top_k=req.top_k, seed=req.seed, stop=stop,
                                  stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos)
        except RequestError as e:
            raise APIError(400, str(e)) from None

    def _submit(ids: list[int], params: SamplingParams, text: str | None, rid: str):
        try:
            return aengine.submit(ids, params, prompt_text=text, request_id=rid)
        except RequestError as e:
            raise APIError(400, str(e), code="context_length_exceeded" if "context" in str(e) else None) from None

    def _prompt_ids(prompt) -> tuple[list[int], str | None]:
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if engine.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
            return engine.encode_prompt(prompt), prompt
        return list(prompt), None

    async def _collect(rid: str, queue: asyncio.Queue, request: Request) -> RequestOutput:
        """The request's final output; a client that went away has its request aborted (not run to the end)."""
        try:
            checked = time.monotonic()
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    item = None
                if time.monotonic() - checked >= 1.0:  # tokens may arrive faster than the timeout: check by the clock
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        aengine.abort(rid)
                        raise APIError(499, "the client closed the request", "invalid_request_error")
                if item is None:
                    continue
                if isinstance(item, RequestError):
                    raise APIError(400, str(item))
                if isinstance(item, BaseException):
                    raise APIError(500, f"engine error: {item}", "server_error")
                if item.finished:
                    return item
        except asyncio.CancelledError:
            aengine.abort(rid)
            raise

    async def _stream(rid: str, queue: asyncio.Queue, request: Request, make_chunk, first_chunk=None,
                      usage_fn=None):
        sent_text, sent_ids = "", 0
        try:
            if first_chunk is not None:
                yield f"data: {json.dumps(first_chunk)}\n\n"
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        aengine.abort(rid)
                        return
                    continue
                if isinstance(item, BaseException):
                    yield f"data: {json.dumps({'error': {'message': str(item), 'type': 'server_error'}})}\n\n"
                    return
                if engine.tokenizer is None:
                    # no text to stream: each chunk carries the new token ids (as vLLM does without a tokenizer)
                    new_ids, sent_ids = item.token_ids[sent_ids:], len(item.token_ids)
                    if new_ids or item.finished:
                        body = make_chunk("", item.finish_reason if item.finished else None)
                        for choice in body.get("choices", []):
                            choice["token_ids"] = new_ids
                        yield f"data: {json.dumps(body)}\n\n"
                    if item.finished:
                        if usage_fn is not None:
                            yield f"data: {json.dumps(usage_fn(item))}\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    continue
                text = item.text if item.finished else engine.tokenizer.decode(item.token_ids)
                if not item.finished and text.endswith("\ufffd"):
                    continue  # a multi-byte character is still incomplete
                # text already sent cannot be taken back (a stop string cut at the end): send nothing then
                delta = text[len(sent_text):] if text.startswith(sent_text) else ""
                sent_text += delta
                if delta or item.finished:
                    yield f"data: {json.dumps(make_chunk(delta, item.finish_reason if item.finished else None))}\n\n"
                if item.finished:
                    if usage_fn is not None:
                        yield f"data: {json.dumps(usage_fn(item))}\n\n"
                    yield "data: [DONE]\n\n"
                    return
        except asyncio.CancelledError:
            aengine.abort(rid)
            raise

    def _usage(out: RequestOutput) -> dict:
        return {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(out.token_ids),
                "total_tokens": len(out.prompt_token_ids) + len(out.token_ids)}

    @app.get("/health")
    async def health():
        if aengine.error is not None and not aengine._thread.is_alive():
            return _error(503, f"engine loop stopped: {aengine.error}", "server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(aengine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(aengine.start_time),
                                            "owned_by": "polyinf", "max_model_len": engine.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        _check_model(req.model)
        if req.echo:
            raise APIError(400, "echo is not supported: the response holds the completion only", param="echo")
        params = _params(req, req.max_tokens)
        ids, text = _prompt_ids(req.prompt)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        rid, queue = _submit(ids, params, text, cid)  # the capture records the response's id

        def chunk(delta, finish):
            return {"id": cid, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}]}

        if req.stream:
            usage = None
            if (req.stream_options or {}).get("include_usage"):
                usage = lambda o: {**chunk("", None), "choices": [], "usage": _usage(o)}  # noqa: E731
            return StreamingResponse(_stream(rid, queue, request, chunk, usage_fn=usage),
                                     media_type="text/event-stream")
        out = await _collect(rid, queue, request)
        return {**chunk(out.text, out.finish_reason), "usage": _usage(out)}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        _check_model(req.model)
        params = _params(req, req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens)
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer or chat template", param="messages")
        if not req.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        try:
            ids = engine.tokenizer.apply_chat_template([m.model_dump(exclude_none=True) for m in req.messages])
        except EngineError as e:
            raise APIError(400, str(e), param="messages") from None
        except Exception as e:  # the model's template refused the conversation (jinja2's raise_exception)
            raise APIError(400, f"the chat template refused the messages: {type(e).__name__}: {e}",
                           param="messages") from None
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        rid, queue = _submit(ids, params, None, cid)

        def chunk(delta, finish):
            return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                    "choices": [{"index": 0, "delta": {"content": delta} if delta else {}, "logprobs": None,
                                 "finish_reason": finish}]}

        if req.stream:
            first = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}]}
            usage = None
            if (req.stream_options or {}).get("include_usage"):
                usage = lambda o: {**chunk("", None), "choices": [], "usage": _usage(o)}  # noqa: E731
            return StreamingResponse(_stream(rid, queue, request, chunk, first_chunk=first, usage_fn=usage),
                                     media_type="text/event-stream")
        out = await _collect(rid, queue, request)
        return {"id": cid, "object": "chat.completion", "created": created, "model": model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                             "logprobs": None, "finish_reason": out.finish_reason}],
                "usage": _usage(out)}

    # ---- admin ----------------------------------------------------------------------------------
    def _authorize(request: Request) -> None:
        if not admin_token:
            raise APIError(403, "admin endpoints are disabled: no admin token is configured", "permission_error")
        header = request.headers.get("authorization", "")
        if not hmac.compare_digest(header.encode(), f"Bearer {admin_token}".encode()):  # constant time
            raise APIError(401, "missing or wrong bearer token", "authentication_error")

    @app.get("/admin/variant")
    def get_variant(request: Request):
        _authorize(request)
        prev = engine.previous_variant
        return {"active": engine.variant.to_json(), "previous": prev.to_json() if prev else None,
                "notes": engine.notes[-10:]}

    @app.post("/admin/variant")
    async def apply_variant(request: Request):
        _authorize(request)
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise APIError(400, "request body is not valid JSON", code="invalid_json") from None
        try:
            spec = VariantSpec.from_json(body)
        except EngineError as e:
            raise APIError(400, str(e)) from None
        try:
            report = await asyncio.to_thread(engine.swap_variant, spec)  # prepared while serving
        except (VariantError, EngineError) as e:
            raise APIError(422, f"variant refused, previous variant stays active: {e}", code="variant_refused") from None
        return {"variant_id": report.variant_id, "scopes": report.scopes, "seconds": report.seconds}

    @app.post("/admin/rollback")
    async def rollback(request: Request):
        _authorize(request)
        try:
            report = await asyncio.to_thread(engine.rollback)
        except (VariantError, EngineError) as e:
            raise APIError(422, str(e), code="rollback_refused") from None
        return {"variant_id": report.variant_id, "scopes": report.scopes, "seconds": report.seconds}

    return app
