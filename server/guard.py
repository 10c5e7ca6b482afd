"""What the server checks of every request before a route sees it: the Host header, the API key, the
body size, and whether the server can take a new generation at all.

Plain ASGI, so a refused request costs no parsing: a body over the limit is answered 413 while it
arrives, and under overload a generation request is answered 429 before its JSON is parsed or its
prompt tokenized.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

_json = msgspec.json.Encoder()

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
OPEN_PATHS = frozenset(
    ("/health", "/metrics", "/ping", "/version")
)  # exactly these need no API key, as in vLLM
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")


@dataclass(frozen=True)
class Guard:
    """What the server checks of every request before a route sees it."""

    max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES  # None: no limit
    api_keys: tuple[str, ...] = ()  # any one of them authenticates (none: no authentication)
    allowed_hosts: tuple[str, ...] | None = (
        None  # Host header names accepted (None: any), against DNS rebinding
    )


class GuardMiddleware:
    """Host check (400), API key (401), then the body read in full up to the size limit (413) before
    any parsing, then, for a generation, refuse() (429 or 503 when it returns an error: overloaded,
    starting, shutting down).

    Pure ASGI: the body is buffered here (FastAPI would buffer it anyway) and replayed to the app;
    after it, the app's receive() goes to the client again, so disconnects are still seen. The body
    is read before refusing so that the connection stays usable for the client's retry.
    """

    def __init__(self, app, guard: Guard, refuse: Callable[[], Any] | None = None) -> None:
        self.app, self.guard, self.refuse = app, guard, refuse
        self.allowed = (
            None
            if guard.allowed_hosts is None
            else {h.lower().strip("[]") for h in guard.allowed_hosts}
        )

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope["path"]
        if (
            self.allowed is not None
            and (host := headers.get("host")) is not None
            and _host_name(host) not in self.allowed
        ):
            return await _send_error(
                send,
                path,
                400,
                f"Host header {host!r} is not one this server answers to; "
                f"connect to {', '.join(sorted(self.allowed))} or start the "
                "server with --allowed-hosts",
            )
        if self.guard.api_keys and scope["path"] not in OPEN_PATHS:
            given = headers.get("authorization", "")
            token = (
                given[7:].strip()
                if given[:7].lower() == "bearer "
                else headers.get("x-api-key", "").strip()
            )
            # every key compared, so the time taken does not say which one came close
            matches = [hmac.compare_digest(token.encode(), k.encode()) for k in self.guard.api_keys]
            if not any(matches):
                what = "a wrong API key was given" if token else "no API key was given"
                return await _send_error(
                    send,
                    path,
                    401,
                    f"{what}: send the server's key as 'Authorization: Bearer KEY' "
                    "or 'x-api-key: KEY' (the key the server was started with, "
                    "--api-key, PPD_API_KEY or VLLM_API_KEY)",
                    extra_headers=[(b"www-authenticate", b"Bearer")],
                )
        limit = self.guard.max_request_bytes
        if scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        length = headers.get("content-length")
        if length is not None and limit is not None:
            if not length.isdigit():
                return await _send_error(
                    send, path, 400, f"Content-Length {length!r} is not a number of bytes"
                )
            if int(length) > limit:
                return await _send_error(send, path, 413, _too_large(int(length), limit))
        body, more = [], True
        size = 0
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left while sending
            body.append(message.get("body", b""))
            size += len(body[-1])
            more = message.get("more_body", False)
            if limit is not None and size > limit:
                return await _send_error(send, path, 413, _too_large(size, limit, at_least=more))
        if (
            self.refuse is not None
            and scope["method"] == "POST"
            and scope["path"].rstrip("/") in GENERATE_PATHS
            and (refused := self.refuse()) is not None
        ):
            retry = (
                []
                if refused.retry_after is None
                else [(b"retry-after", str(int(refused.retry_after)).encode())]
            )
            return await _send_error(
                send, path, refused.status, refused.message, extra_headers=retry
            )
        replay = [{"type": "http.request", "body": b"".join(body), "more_body": False}]

        async def replayed():
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)


def _host_name(host: str) -> str:
    """The name of a Host header, without its port: "[::1]:8000" -> "::1", "localhost:8000" ->
    "localhost"."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _too_large(size: int, limit: int, at_least: bool = False) -> str:
    return (
        f"the request body is {'more than ' if at_least else ''}{size} bytes; this server takes at "
        f"most {limit} "
        "(--max-request-bytes): shorten the request"
    )


async def _send_error(
    send, path: str, status: int, message: str, extra_headers: list[tuple[bytes, bytes]] = ()
) -> None:
    from server.errors import error_body_for

    body = _json.encode(error_body_for(path, message, status))
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *extra_headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
