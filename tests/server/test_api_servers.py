"""`ppd serve --api-server-count 2`: two API-server processes on one port over the same unit (the
stub engine)."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from engine.demo import demo_model_path
from tests.server.test_overload import read_sse, wait_until

COMPLETIONS = "/v1/completions"
STEP_MS = 10


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(
        "--stub-engine", str(STEP_MS), "--api-server-count", "2", "--shutdown-timeout", "20"
    )


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_path())


def complete(url: str, i: int, max_tokens: int = 6) -> httpx.Response:
    body = {
        "model": "demo",
        "prompt": f"request {i}: the quick brown fox",
        "max_tokens": max_tokens,
        "return_token_ids": True,
    }
    with (
        httpx.Client() as client
    ):  # a connection of its own: the kernel picks the API server that accepts it
        return client.post(f"{url}{COMPLETIONS}", json=body, timeout=30)


def served_by_both(url: str, n: int) -> list[httpx.Response]:
    """n concurrent requests, again until both API servers answered some: the kernel spreads the
    connections over the API servers that listen, and API server 1 listens only once it is up, which
    can be after /health says ready (API server 0 serves everything meanwhile)."""
    responses: list[httpx.Response] = []
    deadline = time.monotonic() + 60
    with ThreadPoolExecutor(16) as pool:
        while time.monotonic() < deadline:
            responses += pool.map(
                lambda i: complete(url, i), range(len(responses), len(responses) + n)
            )
            if {r.headers["x-ppd-api-server"] for r in responses} == {"0", "1"}:
                break
            time.sleep(0.5)
    return responses


def test_both_api_servers_answer_correctly(server, tokenizer) -> None:
    responses = served_by_both(server.url, 32)
    assert {r.headers["x-ppd-api-server"] for r in responses} == {"0", "1"}
    for i, r in enumerate(responses):
        assert r.status_code == 200, r.text
        body = r.json()
        prompt = body["prompt_token_ids"]
        # The stub engine answers a request with its own prompt's tokens: another request's would
        # show here.
        assert body["choices"][0]["token_ids"] == prompt[:6], i
        assert body["choices"][0]["text"] == tokenizer.decode(prompt[:6])


def test_stored_responses_are_shared_by_the_api_servers(server) -> None:
    """A response stored by one API server is read and continued through the other (their store is
    one file)."""

    def post(body: dict) -> httpx.Response:
        with httpx.Client() as client:  # a connection of its own: either API server may take it
            resp = client.post(
                f"{server.url}/v1/responses",
                json={"model": "demo", "max_output_tokens": 4, **body},
                timeout=30,
            )
        assert resp.status_code == 200, resp.text
        return resp

    made: dict[str, str] = {}  # response id -> the API server that stored it
    deadline = time.monotonic() + 60
    while set(made.values()) != {"0", "1"} and time.monotonic() < deadline:
        resp = post({"input": f"store me {len(made)}"})
        made[resp.json()["id"]] = resp.headers["x-ppd-api-server"]
    assert set(made.values()) == {"0", "1"}
    for response_id, origin in made.items():
        others = set()
        while not others and time.monotonic() < deadline + 60:
            resp = post({"input": "go on", "previous_response_id": response_id})
            others |= {resp.headers["x-ppd-api-server"]} - {origin}
        assert others, f"no other API server continued {response_id}"


def wait_for_both_to_publish(server) -> None:
    """Until each API server has written its counts (metrics-<i>.msgpack in the run's folder,
    rewritten every SNAPSHOT_INTERVAL_S) after now: a scrape then counts every request that ended
    before this call."""
    since = time.time_ns()

    def published() -> bool:
        files = list(Path(tempfile.gettempdir()).glob(f"ppd-{server.proc.pid}-*/metrics-*.msgpack"))
        return len(files) == 2 and all(f.stat().st_mtime_ns > since for f in files)

    wait_until(published, 30, "both API servers to publish their counts")


def test_every_scrape_counts_the_requests_of_both(server) -> None:
    wait_for_both_to_publish(server)
    before = server.metrics().get("vllm:request_success_total", 0)
    responses = served_by_both(server.url, 16)
    wait_for_both_to_publish(server)
    for _ in range(8):  # new connections: both API servers answer some of the scrapes
        with httpx.Client() as client:
            text = client.get(f"{server.url}/metrics", timeout=10).text
        total = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:request_success_total")
        )
        assert total == before + len(responses)


def stream_until_done(url: str, i: int, max_tokens: int, outcomes: list) -> None:
    body = {
        "model": "demo",
        "prompt": f"stream {i}",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client() as client,
        client.stream("POST", f"{url}{COMPLETIONS}", json=body, timeout=60) as r,
    ):
        assert r.status_code == 200
        outcomes.append((r.headers.get("x-ppd-api-server"), read_sse(r), time.monotonic()))


def start_streams(url: str, n: int, max_tokens: int) -> tuple[list[threading.Thread], list]:
    outcomes: list = []
    threads = [
        threading.Thread(target=stream_until_done, args=(url, i, max_tokens, outcomes))
        for i in range(n)
    ]
    for t in threads:
        t.start()
    return threads, outcomes


def test_a_dead_unit_ends_the_streams_of_every_api_server_and_comes_back(server) -> None:
    threads, outcomes = start_streams(server.url, 24, 3000)  # 30 s: far longer than the test
    wait_until(
        lambda: server.metrics().get("vllm:num_requests_running", 0) >= 24,
        30,
        "every stream to run",
    )
    killed = time.monotonic()
    os.kill(server.worker_pids()["decode"], signal.SIGKILL)
    for t in threads:
        t.join(timeout=30)
    assert len(outcomes) == 24
    assert {api for api, _, _ in outcomes} == {"0", "1"}
    for api, events, ended in outcomes:
        # API server 1 learns of the restart from API server 0 (the launcher): its streams do not
        # hang either.
        assert events[-1] == "[DONE]" and "died" in events[-2], api
        assert ended - killed < 10
    wait_until(lambda: server.health()["units"][0]["ready"], 60, "the unit to restart")
    assert all(r.status_code == 200 for r in served_by_both(server.url, 16))


def test_sigterm_drains_the_streams_of_every_api_server(server) -> None:
    threads, outcomes = start_streams(server.url, 16, 1000 // STEP_MS)  # about a second each
    wait_until(
        lambda: server.metrics().get("vllm:num_requests_running", 0) >= 16,
        30,
        "every stream to run",
    )
    server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=30)
    assert server.proc.wait(timeout=30) in (0, -signal.SIGTERM)
    assert len(outcomes) == 16 and {api for api, _, _ in outcomes} == {"0", "1"}
    for _, events, _ in outcomes:
        assert events[-1] == "[DONE]" and '"finish_reason":"length"' in events[-2]


def health_of(url: str, api_server: int, timeout: float = 30) -> dict:
    """/health as API server `api_server` answers it (new connections until that one takes one)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with httpx.Client() as client:
            health = client.get(f"{url}/health", timeout=10).json()
        if health["api_server"]["index"] == api_server:
            return health
    raise AssertionError(f"API server {api_server} answered no /health within {timeout}s")


# about 45 s on 2 cores: in the second suite, which keeps the default one under 10 minutes
@pytest.mark.slow
def test_a_dead_api_servers_requests_are_stopped_in_the_unit_and_the_routers_forget_their_load(
    start_server,
) -> None:
    """A killed API server's requests would run to max_tokens in the unit (the whole context by
    default), holding KV blocks and a decode slot, and stay in every router's load: the unit stops
    them within a few steps, the survivor's router takes the unit's own count, and the survivor
    serves on."""
    server = start_server(
        "--api-server-count", "2", "--policy", "pd"
    )  # the demo model: a real decode worker
    body = {
        "model": "demo",
        "prompt": "a stream through the other API server",
        "max_tokens": 4000,
        "ignore_eos": True,
        "stream": True,
    }
    deadline = time.monotonic() + 60
    with httpx.Client() as first:
        while time.monotonic() < deadline:
            with (
                httpx.Client() as client,
                client.stream("POST", f"{server.url}{COMPLETIONS}", json=body, timeout=60) as resp,
            ):
                if resp.headers["x-ppd-api-server"] != "1":
                    continue  # API server 0 took it: closing the stream aborts it
                lines = resp.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                helper = health_of(server.url, 1)["api_server"]["pid"]
                os.kill(helper, signal.SIGKILL)
                killed = time.monotonic()
                break
        else:
            raise AssertionError("API server 1 took no stream")
        # Gone from the unit within a few steps, its KV blocks back, though its client stayed.
        wait_until(
            lambda: (
                server.metrics().get("vllm:num_requests_running", 1) == 0
                and server.metrics().get("vllm:kv_cache_usage_perc", 1) == 0
            ),
            10,
            "the unit to stop the request",
        )
        assert time.monotonic() - killed < 10
        wait_until(
            lambda: health_of(server.url, 0)["units"][0]["load"] == 0,
            10,
            "the survivor's router to forget it",
        )
        resp = first.post(
            f"{server.url}{COMPLETIONS}",
            json={**body, "stream": False, "max_tokens": 4},
            timeout=60,
        )
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4


# about 65 s on 2 cores: in the second suite, which keeps the default one under 10 minutes
@pytest.mark.slow
def test_a_helper_api_server_started_again_learns_the_units_are_ready_and_serves(
    start_server,
) -> None:
    """A unit that is up never says it is ready again: a helper started after a death asks (Hello),
    and serves."""
    server = start_server("--api-server-count", "2", "--stub-engine", "5")
    old = health_of(server.url, 1)["api_server"]["pid"]
    os.kill(old, signal.SIGKILL)

    def back() -> bool:
        with httpx.Client() as client:
            resp = client.get(f"{server.url}/health", timeout=10)
        who = resp.json()["api_server"]
        return who["index"] == 1 and who["pid"] != old and resp.status_code == 200

    wait_until(back, 60, "API server 1 to start again and find the unit ready")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with httpx.Client() as client:
            resp = client.post(
                f"{server.url}{COMPLETIONS}",
                json={"model": "demo", "prompt": "hi", "max_tokens": 3},
                timeout=30,
            )
        assert resp.status_code == 200, resp.text
        if resp.headers["x-ppd-api-server"] == "1":
            return
    raise AssertionError("the restarted API server 1 served no request")
