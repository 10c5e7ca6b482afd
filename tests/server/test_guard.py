"""The request guard in front of the API, on a stand-in app: what it refuses, and that a refusal
reaches no route."""

from __future__ import annotations

import asyncio

import httpx

from server.engine_client import EngineError
from server.guard import Guard, GuardMiddleware


class Recorder:
    """An ASGI app that answers 200 and records the bodies it was given."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, scope, receive, send) -> None:
        message = await receive()
        self.bodies.append(message["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def post(app, path: str, body: bytes = b'{"prompt": "hi"}') -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1"
        ) as c:
            return await c.post(path, content=body)

    return asyncio.run(go())


def test_an_overloaded_server_refuses_generations_before_any_route_parses_them() -> None:
    inner, refusals = Recorder(), []

    def refuse():
        refusals.append(1)
        return EngineError(429, "the server is overloaded: 16 requests are waiting", retry_after=3)

    app = GuardMiddleware(inner, Guard(), refuse=refuse)
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = post(app, path, b"not even json")
        assert r.status_code == 429 and r.headers["retry-after"] == "3"
        assert r.json()["error"]["message"].startswith("the server is overloaded")
    assert inner.bodies == [] and len(refusals) == 2
    # Anything else is not a generation and still reaches the app.
    assert post(app, "/v1/other").status_code == 200 and inner.bodies == [b'{"prompt": "hi"}']


def test_a_server_that_can_take_requests_passes_the_body_through_whole() -> None:
    inner = Recorder()
    app = GuardMiddleware(inner, Guard(max_request_bytes=None), refuse=lambda: None)
    body = b'{"prompt": "' + b"x" * 100_000 + b'"}'
    assert post(app, "/v1/completions", body).status_code == 200
    assert inner.bodies == [body]


def test_a_503_refusal_has_no_retry_after() -> None:
    app = GuardMiddleware(
        Recorder(), Guard(), refuse=lambda: EngineError(503, "the server is shutting down")
    )
    r = post(app, "/v1/completions")
    assert r.status_code == 503 and "retry-after" not in r.headers


def test_only_the_exact_open_paths_are_answered_without_the_api_key() -> None:
    app = GuardMiddleware(Recorder(), Guard(api_keys=("sekret",)), refuse=lambda: None)
    for path in ("/health", "/metrics", "/ping", "/version"):
        assert post(app, path).status_code == 200, path
    for path in (
        "/healthz-admin",
        "/metricsfoo",
        "/ping/../v1/completions",
        "/version2",
        "/health/",
        "/v1/models",
    ):
        assert post(app, path).status_code == 401, path
