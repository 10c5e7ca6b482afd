"""The HTTP app: the checks every request passes, errors in their API's shape (Anthropic's under
/v1/messages, else OpenAI's), health, metrics and models, and each API family's routes over the one
request path they share (server/request_path.py).

Families: chat and text completions (chat_api), vLLM's token endpoints (tokenize_api), OpenAI's
Responses (responses_api) and Anthropic's Messages (messages_api). Every response says where its
prefill ran (x-ppd-route).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.chat_api import add_chat_routes
from server.engine_client import EngineClient, EngineError
from server.errors import RequestError, validation_error_message
from server.guard import Guard, GuardMiddleware
from server.messages_api import add_messages_routes
from server.request_path import RequestPath, ServedModel, error_response
from server.response_store import ResponseStore
from server.responses_api import add_responses_routes
from server.tokenize_api import add_token_routes

log = logging.getLogger("ppd.api")

try:
    VERSION = importlib.metadata.version("ppd-serve")
except importlib.metadata.PackageNotFoundError:  # run from a checkout that was not installed
    VERSION = "0+unknown"


@dataclass(frozen=True)
class HttpOptions:
    """What the app serves besides the API (vLLM's flags): /docs, CORS, X-Request-Id headers."""

    docs: bool = True
    cors: dict | None = None  # CORSMiddleware's arguments; None: no CORS headers
    request_id_headers: bool = False


class RequestIdHeader:
    """--enable-request-id-headers: every response carries X-Request-Id, the request's own or a
    new one."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = dict(scope["headers"]).get(b"x-request-id") or uuid.uuid4().hex.encode()

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid)]
            await send(message)

        await self.app(scope, receive, send_with_id)


def build_app(
    model: ServedModel,
    client: EngineClient,
    health: Callable[[], dict],
    lifespan=None,
    guard: Guard = Guard(),
    store: ResponseStore | None = None,
    http: HttpOptions = HttpOptions(),
) -> FastAPI:
    """The FastAPI app. health() returns the units' worker states for GET /health; store keeps the
    Responses API's stored responses (default: a fresh in-memory one)."""
    docs = {} if http.docs else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="ppd-serve", lifespan=lifespan, **docs)
    app.add_middleware(GuardMiddleware, guard=guard, refuse=client.refusal)
    if http.request_id_headers:
        app.add_middleware(RequestIdHeader)
    if http.cors is not None:  # outermost: a browser's preflight needs no API key
        app.add_middleware(CORSMiddleware, **http.cors)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_error_message(exc)
        return error_response(request.url.path, 400, message, param)

    @app.exception_handler(RequestError)
    async def _bad_request(request: Request, exc: RequestError) -> JSONResponse:
        return error_response(request.url.path, exc.status, exc.message, exc.param)

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: EngineError) -> JSONResponse:
        response = error_response(request.url.path, exc.status, exc.message)
        if exc.retry_after is not None:
            response.headers["retry-after"] = str(int(exc.retry_after))
        return response

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(request.url.path, exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        # A bug of ours, not the client's: logged with its traceback, answered in the API's shape.
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(
            request.url.path, 500, f"internal error ({type(exc).__name__}); the server logged it"
        )

    @app.get("/health")
    async def get_health() -> JSONResponse:
        units = health()
        problems = list(client.problems.values())  # a background task that carries requests is down
        ok = bool(units) and all(u["ready"] for u in units) and not problems
        # Overloaded is still healthy (200): a probe that restarted the server now would lose every
        # request.
        status = (
            "unavailable"
            if not ok
            else ("overloaded" if all(u.get("overloaded") for u in units) else "ok")
        )
        body = {
            "status": status,
            "api_server": {"index": client.api_server, "pid": os.getpid()},
            "units": units,
        }
        return JSONResponse(
            body | ({"problems": problems} if problems else {}), status_code=200 if ok else 503
        )

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(
            client.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """vLLM's (SageMaker's) liveness check: 200 once the units are ready, as /health."""
        units = health()
        return Response(
            status_code=200
            if units and all(u["ready"] for u in units) and not client.problems
            else 503
        )

    @app.get("/version")
    async def version() -> dict:
        return {"version": VERSION}

    def card(name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": model.created,
            "owned_by": "ppd-serve",
            "root": model.name,
            "parent": None,
            "max_model_len": model.max_model_len,
        }

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [card(name) for name in model.names]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str) -> dict:
        model.check_model(name)  # 404 in OpenAI's shape, naming what is served
        return card(name if name in model.names else model.name)

    path = RequestPath(model, client)
    add_chat_routes(app, path)
    add_token_routes(app, path)
    add_responses_routes(app, path, ResponseStore() if store is None else store)
    add_messages_routes(app, path)
    return app
