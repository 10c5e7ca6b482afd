"""A one-process unit (`--prefill-worker thread`, what `--partition green` runs on a GPU): the
prefill worker is a thread of the decode worker's process with the same messages, so greedy ids
stay transformers' on both routes, aborted requests leak no KV block, and killing the process
restarts the unit with a new thread."""

from __future__ import annotations

import os
import random
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.server.test_lifecycle import wait_until
from tests.server_process import ServerProcess, greedy_completion, process_title, thread_names
from tests.tiny_models import hf_greedy

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def server(start_server, tiny_llama: Path) -> ServerProcess:
    # A small token budget: the prefill thread chunks prompts, and inline appends run beside it.
    return start_server(
        "--model",
        str(tiny_llama),
        "--served-model-name",
        "tiny",
        "--policy",
        "ppd",
        "--partition",
        "none",
        "--prefill-worker",
        "thread",
        "--max-num-batched-tokens",
        "32",
        "--max-num-seqs",
        "16",
        "--num-kv-blocks",
        "96",
    )


def complete(
    server: ServerProcess, prompt: list[int], route: str | None = None, **extra
) -> tuple[list[int], str]:
    resp = greedy_completion(server, "tiny", prompt, NEW_TOKENS, route, **extra)
    return resp.json()["choices"][0]["token_ids"], resp.headers["x-ppd-route"]


def test_one_process_serves_both_workers(server: ServerProcess) -> None:
    unit = server.health()["units"][0]
    workers = {w["role"]: w for w in unit["workers"]}
    assert workers["prefill"]["thread"] and workers["prefill"]["pid"] == workers["decode"]["pid"]
    assert unit["partition"]["backend"] == "none" and "problem" not in unit["partition"]
    # ps names the process for its decode worker, top -H its prefill thread.
    assert process_title(workers["decode"]["pid"]) == "ppd::u0-decode"
    assert "ppd::u0-prefill" in thread_names(workers["decode"]["pid"])


def test_greedy_ids_match_hf_on_both_routes_with_both_threads_busy(
    server: ServerProcess, tiny_llama: Path
) -> None:
    rng = random.Random(3)
    firsts = [[rng.randrange(3, 256) for _ in range(rng.choice((20, 70)))] for _ in range(6)]
    with ThreadPoolExecutor(6) as pool:  # full prefills on the thread while earlier ones decode
        outs = list(pool.map(lambda p: complete(server, p, "prefill"), firsts))
    assert [o for o, _ in outs] == [hf_greedy(tiny_llama, p, NEW_TOKENS) for p in firsts]
    seconds = [
        p + o + [rng.randrange(3, 256) for _ in range(15)] for p, (o, _) in zip(firsts, outs)
    ]
    routes = ["prefill", "decode"] * 3
    with ThreadPoolExecutor(
        6
    ) as pool:  # turn 2: appends on the thread and inlined in decode steps at once
        outs2 = list(pool.map(lambda pr: complete(server, *pr), zip(seconds, routes)))
    assert [r for _, r in outs2] == routes
    assert [o for o, _ in outs2] == [hf_greedy(tiny_llama, p, NEW_TOKENS) for p in seconds]


def test_aborts_leak_no_blocks(server: ServerProcess) -> None:
    def abandon(i: int) -> None:
        body = {
            "model": "tiny",
            "prompt": [5 + i] * 80,
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream(
            "POST",
            f"{server.url}/v1/completions",
            json=body,
            timeout=30,
            headers={"x-ppd-route": "prefill"},
        ) as resp:
            for n, _ in enumerate(resp.iter_lines()):
                if n == 2:
                    return  # closing the connection mid-stream aborts the request

    def time_out(i: int) -> None:  # some end while their prompt is still on the prefill thread
        with pytest.raises(httpx.TimeoutException):
            httpx.post(
                f"{server.url}/v1/completions",
                timeout=0.05,
                headers={"x-ppd-route": "prefill"},
                # ignore_eos: a random model's early EOS once ended one within the timeout
                json={
                    "model": "tiny",
                    "prompt": [9 + i] * 90,
                    "max_tokens": 160,
                    "ignore_eos": True,
                },
            )

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(abandon, range(6))) + list(pool.map(time_out, range(6)))

    def idle() -> bool:
        m = server.metrics()
        return (
            m["vllm:num_requests_running"] == 0
            and m["vllm:num_requests_waiting"] == 0
            and m["vllm:kv_cache_usage_perc"] == 0
        )

    wait_until(idle, 30, "every KV block to be released")


def test_killing_the_process_restarts_the_unit_with_a_new_prefill_thread(
    server: ServerProcess, tiny_llama: Path
) -> None:
    victim = server.worker_pids()["decode"]
    os.kill(victim, signal.SIGKILL)

    def restarted() -> (
        bool
    ):  # one /health answer: the new pid shows before the new process is ready
        health = server.health()
        workers = {w["role"]: w["pid"] for w in health["units"][0]["workers"]}
        return health["status"] == "ok" and workers.get("decode") not in (None, victim)

    wait_until(restarted, 120, "the unit to restart")
    assert server.worker_pids()["prefill"] == server.worker_pids()["decode"]
    prompt = list(range(10, 60))
    assert complete(server, prompt, "prefill")[0] == hf_greedy(tiny_llama, prompt, NEW_TOKENS)
