"""What must hold whatever clients and workers do: no leaked KV blocks, one copy of the shared
memory, prompt failure and recovery when a worker dies, nothing left behind after SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.server_process import ServerProcess, process_title, wait_until

CHAT = "/v1/chat/completions"


def body(content: str, max_tokens: int, **kw) -> dict:
    return {
        "model": "demo",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **kw,
    }


def test_no_blocks_leak_after_aborts_disconnects_stops_and_preemption(start_server) -> None:
    # 48 blocks of 16 tokens: eight concurrent 150-token answers cannot all fit, so some are
    # preempted.
    server = start_server("--num-kv-blocks", "48", "--max-model-len", "512", "--policy", "dlocal")

    def abandon_stream(i: int) -> None:
        with httpx.stream(
            "POST", server.url + CHAT, json=body(f"abandon {i}", 400, stream=True), timeout=30
        ) as resp:
            for n, _ in enumerate(resp.iter_lines()):
                if n == 3:
                    return  # closing the connection mid-stream aborts the request

    def time_out(i: int) -> None:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server.url + CHAT, json=body(f"timeout {i}", 400), timeout=0.3)

    def long_answer(i: int) -> int:
        resp = httpx.post(
            server.url + CHAT, json=body(f"long {i}", 150, temperature=0), timeout=120
        )
        assert resp.status_code == 200, resp.text
        return resp.json()["usage"]["completion_tokens"]

    def stopped(i: int) -> None:
        resp = httpx.post(
            server.url + CHAT, json=body(f"stop {i}", 300, stop=["a", "e", "o"]), timeout=60
        )
        assert resp.status_code == 200

    with ThreadPoolExecutor(16) as pool:
        jobs = [pool.submit(abandon_stream, i) for i in range(12)] + [
            pool.submit(time_out, i) for i in range(6)
        ]
        answers = [pool.submit(long_answer, i) for i in range(8)] + [
            pool.submit(stopped, i) for i in range(6)
        ]
        for job in jobs + answers:
            job.result()
    assert [a.result() for a in answers[:8]] == [150] * 8  # preempted requests still finish whole

    def idle() -> bool:
        m = server.metrics()
        return (
            m["vllm:num_requests_running"] == 0
            and m["vllm:num_requests_waiting"] == 0
            and m["vllm:kv_cache_usage_perc"] == 0
        )

    wait_until(idle, 15, "every KV block to be released")
    assert server.metrics()["vllm:num_preemptions_total"] > 0
    ok = httpx.post(server.url + CHAT, json=body("still fine", 5), timeout=30)
    assert ok.status_code == 200


@pytest.fixture(scope="module")
def server(start_server) -> ServerProcess:
    return start_server("--policy", "pd")


def shared_mappings(pid: int, prefix: str) -> dict[str, tuple[str, str]]:
    """name suffix (weights/kv) -> (device, inode) of the process's mapping of that shared-memory
    file."""
    found = {}
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and prefix in fields[5]:
            found[fields[5].rsplit("-", 1)[1]] = (fields[3], fields[4])
    return found


def test_workers_map_one_copy_of_weights_and_kv(server: ServerProcess) -> None:
    pids = server.worker_pids()
    prefix = f"/dev/shm/ppd-{server.proc.pid}-u0-"
    decode, prefill = (
        shared_mappings(pids["decode"], prefix),
        shared_mappings(pids["prefill"], prefix),
    )
    assert set(decode) == {"weights", "kv"}
    assert decode == prefill  # the same files (device and inode), not copies
    # The names are dropped once both workers mapped them: the memory lives exactly as long as the
    # workers.
    assert not list(Path("/dev/shm").glob(f"ppd-{server.proc.pid}-*"))


def test_pd_policy_prefills_turn_two_on_prefill_worker_reusing_cache(server: ServerProcess) -> None:
    messages = [{"role": "user", "content": "pd routing " * 12}]
    first = httpx.post(
        server.url + CHAT, json={"model": "demo", "messages": messages, "max_tokens": 4}, timeout=60
    ).json()
    messages += [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "and?"},
    ]
    resp = httpx.post(
        server.url + CHAT, json={"model": "demo", "messages": messages, "max_tokens": 4}, timeout=60
    )
    assert resp.headers["x-ppd-route"] == "prefill"
    assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 96


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_killed_worker_fails_requests_fast_and_unit_restarts(
    server: ServerProcess, role: str
) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    victim = server.worker_pids()[role]
    outcome: dict = {}

    def stream_until_error() -> None:
        stream = client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "long"}],
            max_tokens=3000,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        try:
            for n, _ in enumerate(stream):
                if n == 2:
                    outcome["streaming"] = time.monotonic()
                    os.kill(victim, signal.SIGKILL)
            outcome["error"] = None
        except openai.APIError as exc:
            outcome["error"] = exc
        outcome["ended"] = time.monotonic()

    # Whichever worker dies, the unit restarts whole, so a request that is decoding must end too.
    thread = threading.Thread(target=stream_until_error)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the request hung after its worker died"
    assert outcome["error"] is not None and "died" in str(outcome["error"])
    assert outcome["ended"] - outcome["streaming"] < 5
    wait_until(lambda: server.health()["status"] == "ok", 120, "the unit to restart")
    assert server.worker_pids()[role] != victim
    again = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "back"}],
        max_tokens=4,
        extra_body={"ignore_eos": True},
    )
    assert (
        again.choices[0].finish_reason == "length" and again.usage.completion_tokens == 4
    )  # a whole answer


def proc_stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name: state, parent pid, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def parent_pid(pid: int) -> int:
    return int(proc_stat(pid)[1])


def exited(pid: int) -> bool:
    """Gone, or a zombie its parent has not reaped yet."""
    return not Path(f"/proc/{pid}").exists() or proc_stat(pid)[0] == "Z"


def test_sigterm_to_every_process_drains_then_stops_everything(server: ServerProcess) -> None:
    """A stop sent to every process of the server at once, as systemd sends SIGTERM to a service's
    whole control group (and a terminal's Ctrl-C to its process group): the launcher drains the
    stream in flight while the workers and their parent, the CPU path's fork server, keep running
    for it; then nothing is left."""
    pids = list(server.worker_pids().values())
    parents = {parent_pid(pid) for pid in pids} - {server.proc.pid}  # the fork server, on the CPU
    assert all("fork-server" in process_title(p) for p in parents)

    def stream() -> str | None:
        with httpx.stream(
            "POST", server.url + CHAT, json=body("drain me", 200, stream=True), timeout=60
        ) as resp:
            finish = None
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:  # the unit went down under the stream
                        return f"error: {chunk['error']}"
                    finish = chunk["choices"][0]["finish_reason"] or finish
            return finish

    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(stream)
        wait_until(
            lambda: server.metrics().get("vllm:num_requests_running", 0) > 0, 30, "the stream"
        )
        for pid in [server.proc.pid, *parents, *pids]:
            os.kill(pid, signal.SIGTERM)
        assert answer.result(timeout=60) == "length"  # all 200 tokens, not cut short
    # uvicorn shuts down gracefully, then re-raises the signal it caught, so the exit status is
    # SIGTERM's.
    assert server.stop() in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in server.log_path.read_text()
    for pid in [*pids, *parents]:
        wait_until(lambda: exited(pid), 10, f"worker {pid} to exit")
    assert not list(Path("/dev/shm").glob(f"ppd-{server.proc.pid}-*"))


@pytest.mark.slow  # a server of its own (over 10 s on 2 cores): the second suite
def test_a_killed_launcher_takes_every_worker_with_it(start_server) -> None:
    """SIGKILL to the launcher, which can stop nothing itself: its workers (and on the CPU the fork
    server they were forked from) die with it, so no orphan keeps the cores, a GPU or the port."""
    server = start_server("--policy", "pd")
    pids = list(server.worker_pids().values())
    others = [*pids, *({parent_pid(pid) for pid in pids} - {server.proc.pid})]
    assert len(others) == 3
    server.proc.kill()
    server.proc.wait()
    for pid in others:
        wait_until(lambda: exited(pid), 10, f"process {pid} to exit after its launcher")
