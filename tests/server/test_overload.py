"""Overload, abandoned requests and shutdown, against `ppd serve` with the demo model: only 200s and
429s past capacity, requests whose clients left gone within a step, and SIGTERM that lets streams
end properly."""

from __future__ import annotations

import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.server_process import ServerProcess

CHAT = "/v1/chat/completions"


def body(content: str, max_tokens: int, **kw) -> dict:
    return {
        "model": "demo",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **kw,
    }


def wait_until(predicate, timeout: float, what: str) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if predicate():
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def idle(server: ServerProcess) -> bool:
    m = server.metrics()
    return m.get("vllm:num_requests_running", 1) == 0 and m.get("vllm:kv_cache_usage_perc", 1) == 0


def read_sse(resp: httpx.Response) -> list[str]:
    return [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]


@pytest.mark.slow  # over 10 s on 2 cores: the second suite keeps the default one under its budget
def test_past_capacity_only_200s_and_429s_with_retry_after(start_server) -> None:
    # Long prompts through a small token budget: the admitted requests take a while to start, the
    # rest must not wait.
    server = start_server(
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "128",
        "--max-waiting-requests",
        "4",
        "--max-queue-time-s",
        "5",
    )

    def one(i: int) -> tuple[int, str | None]:
        resp = httpx.post(
            f"{server.url}{CHAT}",
            json=body(f"{i} " + "load " * 400, 16, stream=i % 2 == 0),
            timeout=120,
        )
        return resp.status_code, resp.headers.get("retry-after")

    with ThreadPoolExecutor(40) as pool:
        futures = [pool.submit(one, i) for i in range(40)]
        health = []
        while not all(f.done() for f in futures):
            health.append(server.health())
            time.sleep(0.05)
        results = [f.result() for f in futures]
    statuses = [s for s, _ in results]
    assert set(statuses) <= {200, 429} and statuses.count(200) >= 4 and statuses.count(429) >= 10, (
        statuses
    )
    assert all(retry is not None and int(retry) >= 1 for s, retry in results if s == 429)
    assert any(h["status"] == "overloaded" for h in health)
    refused = httpx.post(f"{server.url}{CHAT}", json=body("x", 2), timeout=30)
    assert refused.status_code in (200, 429)  # whichever, never a 5xx
    assert server.metrics()["ppd:requests_rejected_total"] == statuses.count(429)
    wait_until(lambda: idle(server), 60, "the server to drain")


# 35-60 s on 2 cores each: the second suite keeps the default one under its 10 minutes.
@pytest.mark.slow
@pytest.mark.parametrize("policy", ["aggregated", "pd"])
def test_queue_time_bounds_waiting_to_start_not_the_prefill(start_server, policy: str) -> None:
    """--max-queue-time-s bounds the wait to be scheduled, in the decode worker's queue (aggregated:
    one sequence at a time) and in the prefill worker's (pd: first come, first served): a prefill
    that takes several times the limit on an idle server completes; requests queued behind it are
    ended with 429 at the limit, and leave no KV block or sequence slot behind."""
    limit = 0.3
    server = start_server(
        "--policy",
        policy,
        "--max-queue-time-s",
        str(limit),
        "--max-num-batched-tokens",
        "8",
        "--max-num-seqs",
        "1" if policy == "aggregated" else "4",
        "--max-waiting-requests",
        "0",
    )

    def long_prompt(
        word: str,
    ) -> dict:  # about 3,000 tokens: 375 steps of 8 (a new word: nothing cached)
        return body(f"{word} " * 600, 4)

    started = time.monotonic()
    alone = httpx.post(f"{server.url}{CHAT}", json=long_prompt("load"), timeout=120)
    took = time.monotonic() - started
    assert alone.status_code == 200, alone.text
    assert took > 2 * limit, (
        f"the prefill took {took:.2f}s: too short to show anything against a {limit}s limit"
    )

    def running() -> float:
        return server.metrics().get("vllm:num_requests_running", 0)

    wait_until(lambda: running() == 0, 30, "the first long request to leave the counts")
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(
            httpx.post, f"{server.url}{CHAT}", json=long_prompt("more"), timeout=120
        )
        wait_until(
            lambda: running() >= 1, 30, "the long prefill to start"
        )  # before the short requests arrive
        queued = [
            pool.submit(httpx.post, f"{server.url}{CHAT}", json=body(f"{i} short", 4), timeout=120)
            for i in range(3)
        ]
        assert first.result().status_code == 200
        for future in queued:
            resp = future.result()
            assert (
                resp.status_code == 429 and "without starting" in resp.json()["error"]["message"]
            ), resp.text
    wait_until(lambda: idle(server), 30, "the queued requests' blocks and slots to be freed")
    assert server.metrics()["vllm:num_requests_waiting"] == 0


# a server of its own, about 24 s on 2 cores: in the second suite, under the default one's budget
@pytest.mark.slow
def test_streams_abandoned_before_their_first_token_leave_at_once(start_server) -> None:
    # Prompts long enough that prefills queue up: the clients leave while theirs wait.
    server = start_server("--max-num-batched-tokens", "256")
    port = int(server.url.rsplit(":", 1)[1])
    payload = httpx.Request(
        "POST", f"{server.url}{CHAT}", json=body("many words " * 300, 200, stream=True)
    )
    raw = (
        f"POST {CHAT} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload.read())}\r\n\r\n"
    ).encode() + payload.read()
    socks = []
    for _ in range(30):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(raw)
        socks.append(s)
    wait_until(
        lambda: server.metrics().get("vllm:num_requests_running", 0) > 0,
        30,
        "the requests to start",
    )
    for s in socks:
        s.close()
    # One step of the demo model is well under a second: everything must be gone within a second or
    # two.
    assert wait_until(lambda: idle(server), 10, "the abandoned requests to leave") < 2.0


@pytest.mark.slow  # over 10 s on 2 cores: the second suite keeps the default one under its budget
def test_sigterm_lets_streams_finish_or_end_them_properly(start_server) -> None:
    server = start_server("--shutdown-timeout", "3")
    outcomes: dict[str, list] = {"short": [], "long": [], "plain": []}

    def stream(kind: str, max_tokens: int) -> None:
        with httpx.stream(
            "POST", f"{server.url}{CHAT}", json=body(kind, max_tokens, stream=True), timeout=60
        ) as r:
            outcomes[kind].append(read_sse(r))

    def plain() -> None:
        outcomes["plain"].append(
            httpx.post(f"{server.url}{CHAT}", json=body("plain", 3000), timeout=60)
        )

    threads = [threading.Thread(target=stream, args=("short", 40)) for _ in range(4)]
    threads += [threading.Thread(target=stream, args=("long", 3000)) for _ in range(4)]
    threads.append(threading.Thread(target=plain))
    for t in threads:
        t.start()
    wait_until(
        lambda: server.metrics().get("vllm:num_requests_running", 0) >= 9,
        30,
        "every request to run",
    )
    pid = server.proc.pid
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=30)
    code = server.proc.wait(timeout=30)
    assert time.monotonic() - started < 3 + 5
    assert code in (0, -signal.SIGTERM)
    for events in outcomes["short"]:  # finished within the timeout: whole answers
        assert events[-1] == "[DONE]" and '"finish_reason":"length"' in events[-2]
    for events in outcomes["long"]:  # still running at the timeout: an error event, then [DONE]
        assert events[-1] == "[DONE]" and '"error"' in events[-2] and "shutting down" in events[-2]
    (resp,) = outcomes["plain"]
    assert resp.status_code == 503 and "shutting down" in resp.json()["error"]["message"]
    log = server.log_path.read_text()
    assert "Traceback" not in log
    assert not list(Path("/dev/shm").glob(f"ppd-{pid}-*")) and not list(
        Path("/tmp").glob(f"ppd-{pid}-*")
    )
