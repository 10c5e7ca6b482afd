"""A minimal OpenAI-compatible streaming server with exact, self-measured timing, for testing `ppd
bench`.

    python -m bench.stub_server --port 8001 --ttft-ms 20 --itl-ms 2

POST /v1/chat/completions and /v1/completions stream one token per chunk: the first token
ttft-ms after the request arrived, then one every itl-ms up to max_tokens, then a usage chunk
(if asked) and [DONE]. A chat stream opens at once with an empty role chunk (as ppd's and vLLM's
do), which carries no token. Answers are deterministic: token i is the text " w{i}" and the id
1000+i; ids are streamed when `return_token_ids` is set. The header `x-ppd-route` is the --route
flag; `cached_tokens` is every prompt token but the last user message's (chat, counting words as
tokens; 0 for completions).

It is plain HTTP/1.1 on asyncio's protocol API rather than a web framework, for two reasons: it
stays cheap (docs/benchmarks.md#measurements-behind-the-code), and it takes a request's arrival time
when its last bytes are read from the socket, so what a client measures beyond the stub's own
(logged) time to the first token is the client's overhead plus the loopback, not the stub's HTTP
stack.

For tests:
- a body field `"stub": {"ttft_ms": .., "itl_ms": .., "token_ids": false}` overrides the timing of
  that request, or plays a server that ignores `return_token_ids`;
- the last user message (chat) or a text prompt may contain `[stub:http400]` (a 400 with an OpenAI
  error body), `[stub:http429=S]` (a 429 with `Retry-After: S`, logged; `[stub:http429=S,N]`: only
  the first N times that message comes, then an answer), `[stub:sse-error]` (one token, then an
  error event), `[stub:sleep=S]` (S more seconds before the first token);
- GET /stub/log: per request (the last 10,000), the body, `arrived` (its perf_counter time) and
  `first_token_s`, the stub's measured time from arrival to writing the first token (its timer
  lateness included), so that a client's TTFT minus it bounds the client's overhead from above;
- GET /stub/stats: requests in flight now and at most; POST /stub/reset clears the log and the
  maximum.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import subprocess
import sys
import time
import traceback
from collections import Counter, deque
from time import perf_counter
from typing import Any

import msgspec

_encode = msgspec.json.Encoder().encode
MARKER = re.compile(r"\[stub:(http400|sse-error|sleep=([0-9.]+)|http429=([0-9.]+)(?:,(\d+))?)\]")
LOG_LIMIT = 10_000  # requests kept in /stub/log
REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    429: "Too Many Requests",
    501: "Not Implemented",
}


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection: parses requests (Content-Length bodies) and runs one at a
    time."""

    def __init__(self, stub: Stub) -> None:
        self.stub = stub
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.task: asyncio.Task | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # asyncio sets TCP_NODELAY on TCP transports

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.task is not None:
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        arrived = perf_counter()
        self.buffer += data
        if self.task is None:
            self.next_request(arrived)

    def next_request(self, arrived: float) -> None:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        lines = self.buffer[:end].decode("latin-1").split("\r\n")
        method, target = lines[0].split(" ")[:2]
        headers = {
            k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])
        }
        if "chunked" in headers.get("transfer-encoding", ""):
            self.respond(501, {"error": {"message": "the stub reads Content-Length bodies only"}})
            self.transport.close()
            return
        size = int(headers.get("content-length", 0))
        if len(self.buffer) < end + 4 + size:
            return
        body, self.buffer = self.buffer[end + 4 : end + 4 + size], self.buffer[end + 4 + size :]
        handle = self.stub.handle(self, method, target.split("?")[0], body, arrived)
        self.task = asyncio.get_running_loop().create_task(handle)
        self.task.add_done_callback(self.request_done)

    def request_done(self, task: asyncio.Task) -> None:
        self.task = None
        if (
            not task.cancelled() and task.exception() is not None
        ):  # a stub bug or a body it cannot read
            traceback.print_exception(task.exception())
            if self.transport is not None:
                self.transport.close()
        elif self.transport is not None and self.buffer:
            self.next_request(perf_counter())

    def write(self, data: bytes) -> None:
        if self.transport is None:
            raise ConnectionResetError("the client went away")
        self.transport.write(data)

    def respond(self, status: int, obj: Any, headers: bytes = b"") -> None:
        body = _encode(obj)
        self.write(
            b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s"
            % (status, REASONS[status].encode(), len(body), headers, body)
        )

    def start_stream(self, route: str) -> None:
        self.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
            b"x-ppd-route: %s\r\nTransfer-Encoding: chunked\r\n\r\n" % route.encode()
        )

    def event(self, payload: bytes) -> None:
        """One SSE event as one HTTP chunk."""
        self.write(b"%x\r\ndata: %s\n\n\r\n" % (len(payload) + 8, payload))

    def end_stream(self) -> None:
        self.write(b"0\r\n\r\n")


class Stub:
    """The server's state: default timing, the request log, in-flight counts."""

    def __init__(self, ttft_ms: float, itl_ms: float, route: str) -> None:
        self.ttft_ms, self.itl_ms, self.route = ttft_ms, itl_ms, route
        self.log: deque[dict] = deque(maxlen=LOG_LIMIT)
        self.in_flight = self.max_in_flight = 0
        self.refused: Counter[str] = Counter()  # per message, the 429s [stub:http429=S,N] gave it

    async def handle(
        self, conn: Connection, method: str, path: str, body: bytes, arrived: float
    ) -> None:
        if method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
            try:
                request = msgspec.json.decode(body)
            except msgspec.DecodeError as exc:
                conn.respond(
                    400, {"error": {"message": f"invalid JSON: {exc}", "type": "BadRequestError"}}
                )
                return
            await self.complete(conn, path == "/v1/chat/completions", request, arrived)
        elif method == "GET" and path == "/health":
            conn.respond(200, {"status": "ok"})
        elif method == "GET" and path == "/v1/models":
            conn.respond(200, {"object": "list", "data": [{"id": "stub", "object": "model"}]})
        elif method == "GET" and path == "/stub/log":
            conn.respond(200, list(self.log))
        elif method == "GET" and path == "/stub/stats":
            conn.respond(
                200,
                {
                    "in_flight": self.in_flight,
                    "max_in_flight": self.max_in_flight,
                    "requests": len(self.log),
                },
            )
        elif method == "POST" and path == "/stub/reset":
            self.log.clear()
            self.refused.clear()
            self.max_in_flight = self.in_flight
            conn.respond(200, {"ok": True})
        else:
            conn.respond(
                404, {"error": {"message": f"no route {method} {path}", "type": "NotFoundError"}}
            )

    async def complete(self, conn: Connection, chat: bool, body: dict, arrived: float) -> None:
        if chat:
            messages = body.get("messages", [])
            last_user = next(
                (m.get("content") for m in reversed(messages) if m.get("role") == "user"), ""
            )
            prompt_tokens = sum(len(str(m.get("content", "")).split()) for m in messages)
            new_tokens = len(str(last_user).split())
        else:
            prompt = body.get("prompt", [])
            last_user = prompt if isinstance(prompt, str) else ""
            prompt_tokens = new_tokens = (
                len(prompt.split()) if isinstance(prompt, str) else len(prompt)
            )
        marker = MARKER.search(last_user) if isinstance(last_user, str) else None
        if marker and marker.group(1) == "http400":
            conn.respond(
                400,
                {
                    "error": {
                        "message": "stub: bad request as asked",
                        "type": "BadRequestError",
                        "param": None,
                        "code": 400,
                    }
                },
            )
            return
        if (
            marker
            and marker.group(3)
            and (marker.group(4) is None or self.refused[last_user] < int(marker.group(4)))
        ):
            self.refused[last_user] += 1
            self.log.append(
                {"path": "/v1/completions", "body": body, "arrived": arrived, "first_token_s": None}
            )
            conn.respond(
                429,
                {
                    "error": {
                        "message": "stub: overloaded as asked",
                        "type": "RateLimitError",
                        "param": None,
                        "code": 429,
                    }
                },
                b"Retry-After: %s\r\n" % marker.group(3).encode(),
            )
            return
        timing = body.get("stub") or {}
        sleep = float(marker.group(2)) if marker and marker.group(2) else 0.0
        ttft = timing.get("ttft_ms", self.ttft_ms) / 1000 + sleep
        itl = timing.get("itl_ms", self.itl_ms) / 1000
        max_tokens = int(body.get("max_tokens") or 16)
        with_ids = bool(body.get("return_token_ids")) and timing.get("token_ids", True)
        entry: dict[str, Any] = {
            "path": "/v1/chat/completions" if chat else "/v1/completions",
            "body": body,
            "arrived": arrived,
            "first_token_s": None,
        }
        self.log.append(entry)
        head = _encode(
            {
                "id": f"stub-{len(self.log)}",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()),
                "model": body.get("model", "stub"),
            }
        )[:-1]

        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        counted = True
        try:
            conn.start_stream(self.route)
            if chat:
                conn.event(
                    head + b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
                    b'"logprobs":null,"finish_reason":null}]}'
                )
            for i in range(max_tokens):
                # Absolute targets: the stub's lateness does not accumulate over the stream.
                delay = arrived + ttft + i * itl - perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                part: dict[str, Any] = {
                    "index": 0,
                    "logprobs": None,
                    "finish_reason": "length" if i == max_tokens - 1 else None,
                }
                if chat:
                    part["delta"] = {"content": f" w{i}"}
                else:
                    part["text"] = f" w{i}"
                if with_ids:
                    part["token_ids"] = [1000 + i]
                if (
                    i == 0
                ):  # before the write: a client may read the bytes before the write call returns
                    entry["first_token_s"] = perf_counter() - arrived
                conn.event(head + b',"choices":[' + _encode(part) + b"]}")
                if marker and marker.group(1) == "sse-error":
                    conn.event(
                        _encode(
                            {
                                "error": {
                                    "message": "stub: stream error as asked",
                                    "type": "InternalServerError",
                                    "param": None,
                                    "code": 500,
                                }
                            }
                        )
                    )
                    break
            else:
                if (body.get("stream_options") or {}).get("include_usage"):
                    usage = {
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": max_tokens,
                        "total_tokens": prompt_tokens + max_tokens,
                        "prompt_tokens_details": {"cached_tokens": prompt_tokens - new_tokens},
                    }
                    conn.event(head + b',"choices":[],"usage":' + _encode(usage) + b"}")
            # Counted out before [DONE]: a closed-loop client sends its next request as soon as it
            # reads it.
            self.in_flight -= 1
            counted = False
            conn.event(b"[DONE]")
            conn.end_stream()
        except ConnectionError:
            pass  # the client went away (e.g. its timeout)
        finally:
            if counted:
                self.in_flight -= 1


async def serve(host: str, port: int, ttft_ms: float, itl_ms: float, route: str) -> None:
    """Serve until cancelled; prints `listening on http://HOST:PORT` once bound (port 0: a free
    one)."""
    stub = Stub(ttft_ms, itl_ms, route)
    server = await asyncio.get_running_loop().create_server(
        lambda: Connection(stub), host, port, backlog=1024
    )
    print(f"listening on http://{host}:{server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


class StubProcess:
    """The stub in a subprocess (its own event loop and GIL); `url`, `stop()`, usable as a context
    manager."""

    def __init__(
        self,
        port: int = 0,
        ttft_ms: float = 20.0,
        itl_ms: float = 2.0,
        route: str = "decode",
        host: str = "127.0.0.1",
    ) -> None:
        cmd = [
            sys.executable,
            "-m",
            "bench.stub_server",
            "--host",
            host,
            "--port",
            str(port),
            "--ttft-ms",
            str(ttft_ms),
            "--itl-ms",
            str(itl_ms),
            "--route",
            route,
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("listening on "):
            self.stop()
            raise RuntimeError(f"the stub server did not start (exit code {self.proc.returncode})")
        self.url = line.split()[-1]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()

    def __enter__(self) -> StubProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_stub(port: int = 0, **kw: Any) -> StubProcess:
    """Start the stub in a subprocess: `with start_stub(ttft_ms=5) as stub: ... stub.url ...`."""
    return StubProcess(port, **kw)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.stub_server", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001, help="0: a free port (printed)")
    parser.add_argument("--ttft-ms", type=float, default=20.0, help="time to the first token")
    parser.add_argument("--itl-ms", type=float, default=2.0, help="time between tokens")
    parser.add_argument("--route", default="decode", help="the x-ppd-route header to send")
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.host, args.port, args.ttft_ms, args.itl_ms, args.route))


if __name__ == "__main__":
    main()
