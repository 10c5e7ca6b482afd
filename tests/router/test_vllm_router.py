"""`ppd serve` nodes behind the real vllm-router (the second suite: `python -m pytest -m 'router or
slow'`).

Each routing policy a multi-node deployment would use: kv_aware (placing by the
nodes' KV-cache events), cache_aware (by the prompts it has routed) and
consistent_hash (by x-session-id). A later turn proves it reached the node
holding its prefix by its cached_tokens: the other node never saw the
conversation. Also: a node killed under load costs only its in-flight
requests, and a node's 429 stays a 429 through the router's retries.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from bench.router import Node, Router, router_args, run_conversations, session_header, start_nodes
from bench.servers import stop_server
from tests.server.test_overload import wait_until

pytestmark = pytest.mark.router

BLOCK = 16
NODE_ARGS = [
    "--policy",
    "aggregated",
    "--num-kv-blocks",
    "256",
]  # a small pool, to evict in a few requests


@pytest.fixture(scope="module")
def env(cache_dir: Path) -> dict[str, str]:
    return {**os.environ, "PPD_CACHE_DIR": str(cache_dir), "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def nodes(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip(
        "vllm_router", reason="vllm-router is in the test extra: pip install -e '.[test]'"
    )
    started = start_nodes(2, NODE_ARGS, tmp_path_factory.mktemp("nodes"), env=env)
    yield started
    for node in started:
        stop_server(node.proc)


@pytest.fixture
def router(nodes: list[Node], tmp_path: Path):
    """router(policy, *extra) -> a running vllm-router over the two nodes, stopped after the
    test."""
    routers: list[Router] = []

    def start(policy: str, *extra: str, over: list[Node] | None = None) -> Router:
        over = over or nodes
        r = Router(
            policy,
            [n.url for n in over],
            [*router_args(policy, over), *extra],
            tmp_path / f"router-{policy}.log",
        )
        routers.append(r)
        return r

    yield start
    for r in routers:
        r.stop()


def ask(url: str, messages: list[dict], **kw) -> dict:
    r = httpx.post(
        f"{url}/v1/chat/completions",
        timeout=120,
        json={
            "model": "demo",
            "messages": messages,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            **kw,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def words(seed: int, n: int = 80) -> str:
    return " ".join(f"w{(seed * 7919 + i * 104729) % 997}" for i in range(n))


def next_turn(messages: list[dict], answer: dict, seed: int) -> list[dict]:
    return [
        *messages,
        {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
        {"role": "user", "content": words(seed, 30)},
    ]


def test_kv_aware_sends_each_turn_to_the_node_holding_its_blocks(nodes: list[Node], router) -> None:
    r = router("kv_aware")
    # Two conversations start on different nodes (directly), so the router can only know where they
    # are from the nodes' events.
    convs = {0: [{"role": "user", "content": words(1)}], 1: [{"role": "user", "content": words(2)}]}
    before = {}  # each conversation's last prompt: the prefix its next turn must find cached
    last = {}
    for i, messages in convs.items():
        first = ask(nodes[i].url, messages)
        convs[i], before[i] = next_turn(messages, first, 10 + i), first["usage"]["prompt_tokens"]
    time.sleep(0.5)  # the events travel asynchronously
    for turn in range(2):
        for i, messages in convs.items():
            answer = ask(r.url, messages)
            # Only node i ever saw this conversation: a cached prefix means the router sent it
            # there.
            assert cached(answer) >= before[i] // BLOCK * BLOCK, (turn, i)
            last[i] = (messages, answer["choices"][0]["message"]["content"])
            convs[i], before[i] = (
                next_turn(messages, answer, 20 + turn * 2 + i),
                answer["usage"]["prompt_tokens"],
            )
        time.sleep(0.5)
    for i, (
        messages,
        text,
    ) in last.items():  # the same weights answer the same, wherever the router sent it
        assert ask(nodes[1 - i].url, messages)["choices"][0]["message"]["content"] == text


def test_kv_aware_forgets_evicted_blocks(nodes: list[Node], router) -> None:
    """A conversation's blocks evicted from node 0 and its first turn cached on node 1: its next
    turn goes to node 1, which a router still believing node 0's longer (evicted) prefix would
    not do."""
    r = router("kv_aware")
    turn1 = [{"role": "user", "content": words(3)}]
    a1 = ask(nodes[0].url, turn1)
    turn2 = next_turn(turn1, a1, 30)
    a2 = ask(nodes[0].url, turn2)
    for k in range(8):  # about 5,000 tokens of other prompts through node 0's 4,096-token pool
        ask(nodes[0].url, [{"role": "user", "content": words(100 + k, 200)}], max_tokens=1)
    assert cached(ask(nodes[1].url, turn1, max_tokens=1)) == 0  # node 1 holds turn 1's prompt now
    time.sleep(0.5)
    answer = ask(r.url, next_turn(turn2, a2, 31))
    assert cached(answer) >= a1["usage"]["prompt_tokens"] // BLOCK * BLOCK


def test_kv_aware_sends_each_turn_to_the_unit_holding_its_blocks(
    router, env: dict[str, str], tmp_path: Path
) -> None:
    """Nodes of two units each: the router reads every unit's events and names the unit
    (X-data-parallel-rank), and every later turn finds its prefix, on whichever node and unit its
    conversation began."""
    pair = start_nodes(2, ["--policy", "aggregated"], tmp_path, env=env, units=2)
    try:
        r = router("kv_aware", over=pair)
        convs, before = [], []
        with concurrent.futures.ThreadPoolExecutor(
            8
        ) as pool:  # started together, so each node uses both units
            firsts = list(
                pool.map(
                    lambda i: ask(pair[i % 2].url, [{"role": "user", "content": words(40 + i)}]),
                    range(8),
                )
            )
        for i, first in enumerate(firsts):
            convs.append(next_turn([{"role": "user", "content": words(40 + i)}], first, 50 + i))
            before.append(first["usage"]["prompt_tokens"])
        time.sleep(0.5)
        for messages, prompt in zip(convs, before):
            assert cached(ask(r.url, messages)) >= prompt // BLOCK * BLOCK
        log = re.sub(r"\x1b\[[0-9;]*m", "", r.log.read_text())  # its debug log is coloured
        assert "rank=0" in log and "rank=1" in log  # both units of the nodes were chosen
    finally:
        for node in pair:
            stop_server(node.proc)


def test_cache_aware_keeps_conversations_on_their_node(router) -> None:
    r = router("cache_aware")
    turns = run_conversations(r.url, 6, 3, seed=5, concurrency=3)
    assert all(t.status == 200 for t in turns)
    later = [t for t in turns if t.turn > 0]
    assert sum(t.hit for t in later) >= len(later) - 1, [
        (t.conversation, t.turn, t.cached_tokens) for t in later
    ]


def test_consistent_hash_on_session_id_keeps_conversations_on_their_node(router) -> None:
    r = router("consistent_hash")
    # Shorter turns than the default: the hash may put most conversations on one node, whose small
    # pool (NODE_ARGS) must still hold them all, or an eviction reads as a routing miss (once in
    # five runs with 60 words).
    turns = run_conversations(
        r.url, 6, 3, seed=6, concurrency=3, words=30, headers_for=session_header
    )
    assert all(t.status == 200 for t in turns)
    assert all(t.hit for t in turns if t.turn > 0), [
        (t.conversation, t.turn, t.cached_tokens) for t in turns
    ]


def test_a_nodes_429_reaches_the_client_as_429(router, env: dict[str, str], tmp_path: Path) -> None:
    """A node that sheds load answers 429 with Retry-After; the router may retry it, but never turns
    it into an error: every answer is a 200 or that 429."""
    (tight,) = start_nodes(
        1,
        [
            "--policy",
            "aggregated",
            "--max-num-seqs",
            "1",
            "--max-waiting-requests",
            "1",
            "--max-num-batched-tokens",
            "64",
        ],
        tmp_path,
        env=env,
    )
    try:
        r = router(
            "round_robin",
            "--retry-max-retries",
            "2",
            "--retry-initial-backoff-ms",
            "10",
            over=[tight],
        )
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            statuses = list(
                pool.map(
                    lambda i: (
                        httpx.post(
                            f"{r.url}/v1/chat/completions",
                            timeout=120,
                            json={
                                "model": "demo",
                                "messages": [{"role": "user", "content": words(200 + i)}],
                                "max_tokens": 16,
                            },
                        ).status_code
                    ),
                    range(24),
                )
            )
        assert set(statuses) <= {200, 429} and 429 in statuses and 200 in statuses, statuses
    finally:
        stop_server(tight.proc)


def test_a_killed_node_costs_only_its_in_flight_requests(
    router, env: dict[str, str], tmp_path: Path
) -> None:
    pair = start_nodes(2, ["--policy", "aggregated"], tmp_path, env=env)
    try:
        r = router(
            "round_robin",
            "--health-check-interval-secs",
            "1",
            "--cb-failure-threshold",
            "1",
            over=pair,
        )
        results: list[tuple[float, float, int]] = []  # (start, end, status)
        stop = threading.Event()

        def load() -> None:
            with httpx.Client(timeout=60) as client:
                while not stop.is_set():
                    start = time.monotonic()
                    try:
                        status = client.post(
                            f"{r.url}/v1/chat/completions",
                            json={
                                "model": "demo",
                                "messages": [{"role": "user", "content": "hello " * 20}],
                                "max_tokens": 4,
                            },
                        ).status_code
                    except httpx.HTTPError:
                        status = -1
                    results.append((start, time.monotonic(), status))

        def answered_since(t: float) -> int:
            return sum(st == 200 for s, _, st in list(results) if s > t)

        threads = [threading.Thread(target=load) for _ in range(4)]
        for t in threads:
            t.start()
        wait_until(lambda: answered_since(0) >= 8, 60, "the load to run through the router")
        killed_at = time.monotonic()
        os.kill(
            pair[1].proc.pid, signal.SIGKILL
        )  # the workers follow it (they die with their parent)
        wait_until(lambda: answered_since(killed_at) >= 8, 60, "8 answers after the kill")
        stop.set()
        for t in threads:
            t.join()
        failed = [(s - killed_at, e - killed_at, st) for s, e, st in results if st != 200]
        in_flight = [x for x in results if x[0] <= killed_at <= x[1]]
        assert len(failed) <= len(in_flight), failed  # only requests running at the kill may fail
        assert all(s <= 0 for s, _, _ in failed), failed
        assert (
            sum(st == 200 for s, _, st in results if s > killed_at) >= 8
        )  # and the rest kept going
    finally:
        for node in pair:
            if node.proc.poll() is None:
                stop_server(node.proc)
