"""Several units on one machine: later turns follow their prefix, new conversations spread, workers
are pinned."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from partition.cpu import available_cores, split_cores
from tests.server_process import ServerProcess, wait_until


@pytest.fixture(scope="module")
def server(start_server) -> ServerProcess:
    return start_server("--units", "2", "--policy", "dlocal")


def chat(server: ServerProcess, messages: list[dict]) -> tuple[dict, str]:
    resp = httpx.post(
        f"{server.url}/v1/chat/completions",
        timeout=60,
        json={
            "model": "demo",
            "messages": messages,
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert resp.status_code == 200, resp.text
    return resp.json(), resp.headers["x-ppd-route"]


def per_engine(server: ServerProcess, name: str) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(rf'^{re.escape(name)}{{engine="(\d+)"[^}}]*}} (\S+)$', text, re.M)
    }


def test_later_turns_hit_their_unit_and_load_spreads(server: ServerProcess) -> None:
    assert len(server.health()["units"]) == 2
    conversations = [
        [{"role": "user", "content": f"conversation {i}: " + "tell me something " * 6}]
        for i in range(6)
    ]
    for conv in conversations:
        answer, route = chat(server, conv)
        assert route == "prefill"
        conv += [
            {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
            {"role": "user", "content": "more"},
        ]
    for conv in conversations:
        answer, route = chat(server, conv)
        # Cached on the unit it was sent to: only possible if turn 2 found turn 1's unit.
        assert route == "decode" and answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    queries = per_engine(server, "vllm:prefix_cache_queries_total")
    assert set(queries) == {"0", "1"} and all(v > 0 for v in queries.values())


def test_stored_conversations_stay_on_the_unit_holding_their_blocks(server: ServerProcess) -> None:
    # Several conversations at once, three turns each through stored responses: every later turn
    # finds every earlier token cached, which it can only on the unit that ran the turns before.
    previous: dict[int, dict] = {}
    for turn in range(3):
        for i in range(4):
            body = {
                "model": "demo",
                "input": f"stored {i}, turn {turn}: " + "say more " * 4,
                "max_output_tokens": 6,
                "temperature": 0,
                "ignore_eos": True,
            }
            if i in previous:
                body["previous_response_id"] = previous[i]["id"]
            resp = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
            assert resp.status_code == 200, resp.text
            usage = resp.json()["usage"]
            if i in previous:
                earlier = (
                    previous[i]["usage"]["input_tokens"] + previous[i]["usage"]["output_tokens"]
                )
                assert usage["input_tokens_details"]["cached_tokens"] == (earlier - 1) // 16 * 16
            previous[i] = resp.json()
    queries = per_engine(server, "vllm:prefix_cache_queries_total")
    assert all(v > 0 for v in queries.values())


def allowed_cores(pid: int) -> set[int]:
    text = Path(f"/proc/{pid}/status").read_text()
    spec = re.search(r"^Cpus_allowed_list:\s*(\S+)$", text, re.M).group(1)
    cores: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


def test_workers_are_pinned_to_their_share(server: ServerProcess) -> None:
    expected = split_cores(available_cores(), 2, with_prefill=True)
    for unit, (decode, prefill) in zip(server.health()["units"], expected):
        pids = {w["role"]: w["pid"] for w in unit["workers"]}
        assert allowed_cores(pids["decode"]) == set(decode)
        assert allowed_cores(pids["prefill"]) == set(prefill)


def test_session_header_keeps_a_conversation_on_its_unit(server: ServerProcess) -> None:
    def send(content: str, session: str) -> dict:
        resp = httpx.post(
            f"{server.url}/v1/chat/completions",
            timeout=60,
            headers={"x-session-id": session},
            json={
                "model": "demo",
                "messages": [{"role": "user", "content": content}],
                "max_tokens": 2,
                "ignore_eos": True,
            },
        )
        assert resp.status_code == 200, resp.text
        return resp.json()

    before = per_engine(server, "vllm:prefix_cache_queries_total")
    # Unrelated prompts of one session (no shared prefix) all land on one unit; without the header
    # they spread.
    for i in range(4):
        send(f"session prompt {i} " + "x" * (10 + i), "conversation-7")
    after = per_engine(server, "vllm:prefix_cache_queries_total")
    grew = [u for u in after if after[u] > before.get(u, 0)]
    assert len(grew) == 1


def test_an_outside_routers_rank_header_picks_the_unit(server: ServerProcess) -> None:
    """vLLM's X-data-parallel-rank, which vllm-router's kv_aware sends to a node whose units' events
    it reads: the request runs on that unit, even where this server's own router would choose
    another."""

    def ask(messages: list[dict], rank: str) -> httpx.Response:
        return httpx.post(
            f"{server.url}/v1/chat/completions",
            headers={"x-data-parallel-rank": rank},
            timeout=60,
            json={"model": "demo", "messages": messages, "max_tokens": 4, "temperature": 0},
        )

    conv = [{"role": "user", "content": "ranked conversation: " + "pick my unit " * 8}]
    for rank in (
        "1",
        "0",
        "1",
    ):  # the second turn leaves the unit holding its prefix because the header says so
        before = per_engine(server, "vllm:prefix_cache_queries_total")
        resp = ask(conv, rank)
        assert resp.status_code == 200, resp.text
        after = per_engine(server, "vllm:prefix_cache_queries_total")
        grew = {e for e in after if after[e] > before.get(e, 0)}
        assert grew == {rank}
    for bad in ("2", "-1", "one"):
        resp = ask(conv, bad)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "x-data-parallel-rank"


# about 25 s on 2 cores: in the second suite, which keeps the default one under 10 minutes
@pytest.mark.slow
def test_two_units_killed_at_once_both_end_their_streams_at_once_and_both_restart(
    server: ServerProcess,
) -> None:
    """A restart lasts until the unit is ready again (minutes on a GPU): a second unit that dies
    meanwhile must not wait for it. Both units' streams end with an error event at once, both units
    come back, and each serves again."""
    victims = [
        {w["role"]: w["pid"] for w in unit["workers"]}["decode"]
        for unit in server.health()["units"]
    ]
    streaming = [threading.Event() for _ in victims]
    outcomes: dict[int, tuple[list[str], float]] = {}

    def stream(rank: int) -> None:
        body = {
            "model": "demo",
            "messages": [{"role": "user", "content": f"long {rank}"}],
            "max_tokens": 3000,
            "ignore_eos": True,
            "stream": True,
        }
        events: list[str] = []
        with httpx.stream(
            "POST",
            f"{server.url}/v1/chat/completions",
            json=body,
            timeout=60,
            headers={"x-data-parallel-rank": str(rank)},
        ) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        streaming[rank].set()
        outcomes[rank] = (events, time.monotonic())

    threads = [threading.Thread(target=stream, args=(rank,)) for rank in range(len(victims))]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in streaming), "both streams to run"
    killed = time.monotonic()
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(timeout=60)
    assert sorted(outcomes) == [0, 1]
    for rank, (events, ended) in outcomes.items():
        assert events[-1] == "[DONE]" and "died" in events[-2], rank
        assert ended - killed < 3, (
            f"unit {rank}'s stream ended {ended - killed:.1f}s after its worker died"
        )
    wait_until(lambda: server.health()["status"] == "ok", 120, "both units to restart")
    workers = [{w["role"]: w["pid"] for w in unit["workers"]} for unit in server.health()["units"]]
    assert all(w["decode"] != victim for w, victim in zip(workers, victims))
    for rank in ("0", "1"):
        resp = httpx.post(
            f"{server.url}/v1/chat/completions",
            headers={"x-data-parallel-rank": rank},
            timeout=60,
            json={
                "model": "demo",
                "messages": [{"role": "user", "content": "back"}],
                "max_tokens": 4,
                "ignore_eos": True,
            },
        )
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4, resp.text
