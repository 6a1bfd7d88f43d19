"""What every HTTP app of the engine shares (the server over one engine, the router over replicas): errors in
OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``), the API key on the /v1 routes and the
admin token on /admin, both compared in constant time."""
from __future__ import annotations

import hmac
import json
import os

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import EngineError
from engine.entrypoints.openai_protocol import APIError
from engine.config.variant import VariantSpec


def error_response(status: int, message: str, type_: str = "invalid_request_error", param=None,
                   code=None) -> JSONResponse:
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": type_, "param": param, "code": code}})


def require_api_key(app: FastAPI, api_key: str | None) -> None:
    """With ``api_key``, the /v1 routes answer only requests bearing it (compared in constant time)."""
    if not api_key:
        return
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def _require_api_key(request: Request, call_next):
        if request.url.path.startswith("/v1") and not hmac.compare_digest(
                request.headers.get("authorization", "").encode(), expected):
            return error_response(401, "missing or wrong API key", "authentication_error",
                                  code="invalid_api_key")
        return await call_next(request)


def admin_authorizer(admin_token: str | None):
    """The check every /admin route runs first: the bearer token, in constant time; none configured: refused."""
    def authorize(request: Request) -> None:
        if not admin_token:
            raise APIError(403, "admin endpoints are disabled: no admin token is configured", "permission_error")
        header = request.headers.get("authorization", "")
        if not hmac.compare_digest(header.encode(), f"Bearer {admin_token}".encode()):
            raise APIError(401, "missing or wrong bearer token", "authentication_error")
    return authorize


def install_error_handlers(app: FastAPI) -> None:
    """Errors in OpenAI's shape, whatever raised them."""
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return error_response(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        if first.get("type") == "json_invalid":
            return error_response(400, "request body is not valid JSON", code="invalid_json")
        if first.get("type") == "extra_forbidden":
            return error_response(400, f"unknown field {loc!r}", param=loc, code="unknown_field")
        return error_response(400, f"{loc}: {first.get('msg', 'invalid request')}", param=loc or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, str(e.detail), kind)


async def variant_from_body(request: Request) -> VariantSpec:
    """The VariantSpec an admin POST carries; a 400 that says why when the body is not one."""
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError(400, "request body is not valid JSON", code="invalid_json") from None
    try:
        return VariantSpec.from_json(body)
    except EngineError as e:
        raise APIError(400, str(e)) from None


def secure(app: FastAPI, admin_token: str | None, api_key: str | None):
    """Errors in OpenAI's shape, the API key on /v1 and the admin token's check (returned, for the /admin routes).
    ``admin_token`` None: $POLYINF_ADMIN_TOKEN; ``api_key`` None: $POLYINF_API_KEY, else $VLLM_API_KEY; an empty
    one leaves the routes open (admin ones disabled)."""
    admin_token = admin_token or os.environ.get("POLYINF_ADMIN_TOKEN") or None
    if api_key is None:
        api_key = os.environ.get("POLYINF_API_KEY") or os.environ.get("VLLM_API_KEY") or None
    require_api_key(app, api_key)
    install_error_handlers(app)
    return admin_authorizer(admin_token)
