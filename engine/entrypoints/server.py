"""OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn, imported only here).

Endpoints: /v1/models, /v1/completions, /v1/chat/completions (``stream: true`` as server-sent
events ending with ``[DONE]``), /tokenize and /detokenize (vLLM's), /health, /metrics (Prometheus), and
admin endpoints under /admin (active variant, apply, rollback) behind a bearer token. Errors have OpenAI's
shape: ``{"error": {"message", "type", "param", "code"}}``.

Fields a client sends that the server does not know are ignored and logged once per name (as vLLM does:
ordinary clients send ``user``, ``metadata`` and the like); a field it knows but cannot honour is refused
with a 400 that says so, never ignored. ``response_format`` json_object and json_schema constrain decoding to
the schema (engine/worker/structured.py, through llguidance); another type, or a schema it cannot compile, is a 400.
Penalties (presence, frequency, repetition), ``logit_bias``, ``n``, ``logprobs`` / ``top_logprobs`` (streamed
too: each chunk with its new tokens' log-probabilities, the ``n`` choices under their indices) and content-part
message arrays are honoured.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import sys
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from engine.serving.async_engine import AsyncEngine
from engine.entrypoints.openai_protocol import (
    MAX_N, APIError, ChatMessage, ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, SamplingFields,
    message_text,
)
from engine.errors import EngineError, RequestError, VariantError
from engine.entrypoints.http_base import error_response, secure, variant_from_body
from engine.core.llm_engine import RequestOutput
from engine.config.sampling_params import SamplingParams
from engine.worker.structured import schema_text

log = logging.getLogger("polyinf.server")


def build_app(aengine: AsyncEngine, model_name: str, admin_token: str | None = None,
              api_key: str | None = None) -> FastAPI:
    """``api_key`` (None: $POLYINF_API_KEY, else $VLLM_API_KEY): the bearer token the /v1 routes require, as
    vLLM's --api-key; none (or an empty one) leaves them open."""
    app = FastAPI(title="polyinf", description=__doc__)
    engine = aengine.engine
    _authorize = secure(app, admin_token, api_key)

    def _check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")

    ignored: set[str] = set()

    def _ignore_unknown(req: BaseModel) -> None:
        """Fields no model of the request knows: ignored, each name logged once per server."""
        extra = set(req.model_extra or ()) | {f"messages.{k}" for m in getattr(req, "messages", None) or ()
                                               for k in (m.model_extra or ())}
        new = sorted(extra - ignored)
        if new:
            ignored.update(new)
            log.warning("ignoring request fields this server does not know: %s", ", ".join(n[:60] for n in new))

    def _params(req: SamplingFields, max_tokens: int | None, logprobs: int | None = None,
                json_schema: str | None = None) -> SamplingParams:
        _ignore_unknown(req)
        if not 1 <= req.n <= MAX_N:
            raise APIError(400, f"n must be in 1..{MAX_N}, got {req.n}", param="n")
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        try:
            bias = tuple((int(t), float(b)) for t, b in (req.logit_bias or {}).items())
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids", param="logit_bias") from None
        try:
            return SamplingParams(max_tokens=16 if max_tokens is None else max_tokens, temperature=req.temperature,
                                  top_p=req.top_p, top_k=req.top_k, seed=req.seed, stop=stop,
                                  stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                                  presence_penalty=req.presence_penalty or 0.0,
                                  frequency_penalty=req.frequency_penalty or 0.0,
                                  repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                                  logit_bias=bias, logprobs=logprobs, json_schema=json_schema)
        except RequestError as e:
            raise APIError(400, str(e)) from None

    def _submit(ids: list[int], params: SamplingParams, text: str | None, rid: str):
        try:
            return aengine.submit(ids, params, prompt_text=text, request_id=rid)
        except RequestError as e:
            raise APIError(400, str(e), code="context_length_exceeded" if "context" in str(e) else None,
                           param=e.param) from None

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

    async def _stream(subs: list[tuple], request: Request, make_chunk, first_chunk=None, usage_fn=None,
                      logprobs_fn=None):
        """Server-sent events for the ``n`` requests of one response: each choice's new text (or, without a
        tokenizer, its new token ids) under its index as its tokens arrive, with the new tokens' log-probabilities
        (``logprobs_fn``) where asked; the usage of all choices at the end (``usage_fn``), then ``[DONE]``."""
        merged: asyncio.Queue = asyncio.Queue()

        async def forward(i: int, queue: asyncio.Queue) -> None:
            while True:
                item = await queue.get()
                await merged.put((i, item))
                if isinstance(item, BaseException) or item.finished:
                    return

        tasks = [asyncio.ensure_future(forward(i, q)) for i, (_, q) in enumerate(subs)]
        sent_text, sent_ids, sent_lp = [""] * len(subs), [0] * len(subs), [0] * len(subs)
        finished: dict[int, RequestOutput] = {}
        try:
            if first_chunk is not None:
                for i in range(len(subs)):
                    yield f"data: {json.dumps(first_chunk(i))}\n\n"
            while len(finished) < len(subs):
                try:
                    i, item = await asyncio.wait_for(merged.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return  # the finally clause aborts what is still running
                    continue
                if isinstance(item, BaseException):
                    yield f"data: {json.dumps({'error': {'message': str(item), 'type': 'server_error'}})}\n\n"
                    return
                finish = item.finish_reason if item.finished else None
                if engine.tokenizer is None:
                    # no text to stream: each chunk carries the new token ids (as vLLM does without a tokenizer)
                    new_ids, sent_ids[i] = item.token_ids[sent_ids[i]:], len(item.token_ids)
                    body = make_chunk("", finish, i) if new_ids or item.finished else None
                    if body is not None:
                        for choice in body.get("choices", []):
                            choice["token_ids"] = new_ids
                else:
                    text = item.text if item.finished else engine.tokenizer.decode(item.token_ids)
                    body = None
                    if item.finished or not text.endswith("\ufffd"):  # else a multi-byte character is incomplete
                        # text already sent cannot be taken back (a stop string cut at the end): send nothing then
                        delta = text[len(sent_text[i]):] if text.startswith(sent_text[i]) else ""
                        sent_text[i] += delta
                        body = make_chunk(delta, finish, i) if delta or item.finished else None
                if body is not None:
                    if logprobs_fn is not None and item.logprobs is not None:
                        new_lp, sent_lp[i] = item.logprobs[sent_lp[i]:], len(item.logprobs)
                        for choice in body.get("choices", []):
                            choice["logprobs"] = logprobs_fn(new_lp)
                    yield f"data: {json.dumps(body)}\n\n"
                if item.finished:
                    finished[i] = item
            if usage_fn is not None:
                yield f"data: {json.dumps(usage_fn([finished[i] for i in range(len(subs))]))}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # a client that went away, or an error: what is still running is aborted
            for t in tasks:
                t.cancel()
            for j, (rid, _) in enumerate(subs):
                if j not in finished:
                    aengine.abort(rid)

    @app.get("/health")
    async def health():
        if aengine.error is not None and not aengine._thread.is_alive():
            return error_response(503, f"engine loop stopped: {aengine.error}", "server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(aengine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(aengine.start_time),
                                            "owned_by": "polyinf", "max_model_len": engine.max_model_len}]}

    def _submit_n(ids: list[int], params: SamplingParams, text: str | None, cid: str, n: int) -> list[tuple]:
        """``n`` requests for the same prompt (the prefix cache shares its blocks): the first under the response's
        id (what the capture records), with a seed, choice i draws with seed + i."""
        subs = []
        try:
            for i in range(n):
                p = params if i == 0 or params.seed is None else dataclasses.replace(
                    params, seed=(params.seed + i) % 2**64)
                subs.append(_submit(ids, p, text, cid if i == 0 else f"{cid}-{i}"))
        except BaseException:
            for rid, _ in subs:
                aengine.abort(rid)
            raise
        return subs

    async def _collect_all(subs: list[tuple], request: Request) -> list[RequestOutput]:
        tasks = [asyncio.ensure_future(_collect(rid, q, request)) for rid, q in subs]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            for rid, _ in subs:
                aengine.abort(rid)
            raise

    def _token_text(t: int) -> str:
        return engine.tokenizer.decode([t]) if engine.tokenizer is not None else f"token_id:{t}"

    def _completion_logprobs(entries: list) -> dict:
        """The completions API's logprobs object (the legacy layout) for ``RequestOutput.logprobs`` entries."""
        tokens = [_token_text(t) for t, _, _ in entries]
        offsets = list(itertools.accumulate((len(x) for x in tokens), initial=0))[:-1]
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [{_token_text(t): v for t, v in top} for _, _, top in entries],
                "text_offset": offsets}

    def _chat_logprobs(entries: list) -> dict:
        def entry(t: int, lp: float) -> dict:
            text = _token_text(t)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(u, v) for u, v in top]}
                            for t, lp, top in entries]}

    def _usage_all(outs: list[RequestOutput]) -> dict:
        completion = sum(len(o.token_ids) for o in outs)
        prompt = len(outs[0].prompt_token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        _check_model(req.model)
        if req.echo:
            raise APIError(400, "echo is not supported: the response holds the completion only", param="echo")
        params = _params(req, req.max_tokens, req.logprobs)
        ids, text = _prompt_ids(req.prompt)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        subs = _submit_n(ids, params, text, cid, req.n)  # the capture records the response's id

        def chunk(delta, finish, index=0):
            return {"id": cid, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"index": index, "text": delta, "logprobs": None, "finish_reason": finish}]}

        if req.stream:
            usage = None
            if (req.stream_options or {}).get("include_usage"):
                usage = lambda outs: {**chunk("", None), "choices": [], "usage": _usage_all(outs)}  # noqa: E731
            return StreamingResponse(_stream(subs, request, chunk, usage_fn=usage,
                                             logprobs_fn=_completion_logprobs if req.logprobs is not None else None),
                                     media_type="text/event-stream")
        outs = await _collect_all(subs, request)
        return {"id": cid, "object": "text_completion", "created": created, "model": model_name,
                "choices": [{"index": i, "text": o.text,
                             "logprobs": _completion_logprobs(o.logprobs) if o.logprobs is not None else None,
                             "finish_reason": o.finish_reason} for i, o in enumerate(outs)],
                "usage": _usage_all(outs)}

    def _chat_ids(messages: list[ChatMessage]) -> list[int]:
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer or chat template", param="messages")
        if not messages:
            raise APIError(400, "messages must not be empty", param="messages")
        try:
            return engine.tokenizer.apply_chat_template([message_text(m) for m in messages])
        except EngineError as e:
            raise APIError(400, str(e), param="messages") from None
        except APIError:
            raise
        except Exception as e:  # the model's template refused the conversation (jinja2's raise_exception)
            raise APIError(400, f"the chat template refused the messages: {type(e).__name__}: {e}",
                           param="messages") from None

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        _check_model(req.model)
        try:
            schema = schema_text(req.response_format)  # decoding constrained to it (engine/worker/structured.py)
        except RequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        ids = _chat_ids(req.messages)
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if limit is None:  # as OpenAI and vLLM: until the end of the answer or of the context
            limit = max(1, engine.max_model_len - len(ids))
        params = _params(req, limit, (req.top_logprobs or 0) if req.logprobs else None, schema)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        subs = _submit_n(ids, params, None, cid, req.n)

        def chunk(delta, finish, index=0):
            return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                    "choices": [{"index": index, "delta": {"content": delta} if delta else {}, "logprobs": None,
                                 "finish_reason": finish}]}

        if req.stream:
            def first(index):
                return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                        "choices": [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}]}
            usage = None
            if (req.stream_options or {}).get("include_usage"):
                usage = lambda outs: {**chunk("", None), "choices": [], "usage": _usage_all(outs)}  # noqa: E731
            return StreamingResponse(_stream(subs, request, chunk, first_chunk=first, usage_fn=usage,
                                             logprobs_fn=_chat_logprobs if req.logprobs else None),
                                     media_type="text/event-stream")
        outs = await _collect_all(subs, request)
        return {"id": cid, "object": "chat.completion", "created": created, "model": model_name,
                "choices": [{"index": i, "message": {"role": "assistant", "content": o.text},
                             "logprobs": _chat_logprobs(o.logprobs) if o.logprobs is not None else None,
                             "finish_reason": o.finish_reason} for i, o in enumerate(outs)],
                "usage": _usage_all(outs)}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        if req.model is not None:
            _check_model(req.model)
        _ignore_unknown(req)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "send either prompt or messages", param="prompt")
        if req.messages is not None:
            ids = _chat_ids(req.messages)
        elif engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", param="prompt")
        else:
            ids = engine.tokenizer.encode(req.prompt)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        if req.model is not None:
            _check_model(req.model)
        _ignore_unknown(req)
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", param="tokens")
        vocab = engine.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in req.tokens):
            raise APIError(400, f"token ids must be in 0..{vocab - 1}", param="tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    # ---- admin ----------------------------------------------------------------------------------
    @app.get("/admin/variant")
    async def get_variant(request: Request):
        _authorize(request)
        prev = engine.previous_variant
        ranks = await asyncio.to_thread(aengine.rank_variants)  # a tensor-parallel group: every rank's
        return {"active": engine.variant.to_json(), "previous": prev.to_json() if prev else None,
                "notes": engine.notes[-10:], "ranks": ranks}

    @app.post("/admin/variant")
    async def apply_variant(request: Request):
        _authorize(request)
        spec = await variant_from_body(request)
        try:
            report = await asyncio.to_thread(aengine.swap_variant, spec)  # prepared while serving
        except (VariantError, EngineError) as e:
            raise APIError(422, f"variant refused, previous variant stays active: {e}", code="variant_refused") from None
        return {"variant_id": report.variant_id, "scopes": report.scopes, "seconds": report.seconds,
                "notes": list(report.notes)}

    @app.post("/admin/rollback")
    async def rollback(request: Request):
        _authorize(request)
        try:
            report = await asyncio.to_thread(aengine.rollback)
        except (VariantError, EngineError) as e:
            raise APIError(422, str(e), code="rollback_refused") from None
        return {"variant_id": report.variant_id, "scopes": report.scopes, "seconds": report.seconds,
                "notes": list(report.notes)}

    return app


def serve(config, name: str, host: str = "127.0.0.1", port: int = 8000, admin_token: str | None = None,
          api_key: str | None = None, capture_dir: str | None = None, capture_prompts: bool = False,
          log_level: str = "warning") -> None:
    """Loads the engine and serves it until stopped. A variant with tp > 1: this process is rank 0 and the API in
    front; it starts the other ranks (engine/model/parallel.py's RankGroup), each loading its own shard."""
    import uvicorn

    from engine.serving.capture import CaptureWriter
    from engine.core.llm_engine import LLMEngine
    from engine.serving.metrics import EngineMetrics

    tp, ranks = config.initial_variant().tp, None
    if tp > 1:
        from engine.loader.model_source import load_config
        from engine.model.parallel import rank_device, shard_config
        from engine.serving.rank_group import RankGroup

        shard_config(load_config(config.source), tp)  # an indivisible model fails here, before any process starts
        ranks = RankGroup(tp, config)
        config = dataclasses.replace(config, device=rank_device(config.device, 0))
    capture = None
    try:
        engine = LLMEngine(config)
        capture = CaptureWriter(capture_dir, keep_prompt_text=capture_prompts) if capture_dir else None
        aengine = AsyncEngine(engine, EngineMetrics(name), capture, ranks)
        app = build_app(aengine, name, admin_token=admin_token, api_key=api_key)
        print(f"polyinf: serving {name!r} on http://{host}:{port} (variant {engine.variant.variant_id}"
              + (f", tensor parallel over {tp} ranks" if tp > 1 else "") + ")", file=sys.stderr, flush=True)
        try:
            # keep idle connections longer than clients do (httpx, and so the openai client, drop theirs after 5 s):
            # with equal timeouts a client can send on a connection the server is closing, and lose the request
            uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_keep_alive=65)
        finally:
            aengine.shutdown()
    finally:
        if capture is not None:
            capture.close()
        if ranks is not None:
            ranks.close()
