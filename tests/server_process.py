"""Run `ppd serve` as a real subprocess for end-to-end tests."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx

from bench.servers import start_server, stop_server
from bench.soak import gauges


def greedy_completion(
    server: "ServerProcess",
    model: str,
    prompt: list[int],
    max_tokens: int,
    route: str | None = None,
    timeout: float = 120,
    **fields,
) -> httpx.Response:
    """/v1/completions of token ids, greedy past any end of turn, with the answer's ids; route asks
    for one for an append-prefill (x-ppd-route). Asserts a 200."""
    resp = httpx.post(
        f"{server.url}/v1/completions",
        timeout=timeout,
        headers={"x-ppd-route": route} if route else {},
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            **fields,
        },
    )
    assert resp.status_code == 200, resp.text
    return resp


def wait_until(predicate, timeout: float, what: str) -> None:
    """Return once predicate() holds (polled every 0.1 s); fail naming `what` after timeout
    seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class ServerProcess:
    """`ppd serve <args>` on a free port, ready; `stop()` sends SIGTERM and returns the exit
    status."""

    def __init__(self, *args: str, cache_dir: Path, log_path: Path) -> None:
        self.log_path = log_path
        # PPD_CHECK_INVARIANTS: each decode worker checks its books whenever it goes idle.
        env = {
            **os.environ,
            "PPD_CACHE_DIR": str(cache_dir),
            "PYTHONUNBUFFERED": "1",
            "PPD_CHECK_INVARIANTS": "1",
        }
        if (
            "--policy" not in args
        ):  # the two-worker path these tests exercise; on the CPU auto picks it only on 4+ cores
            args = ("--policy", "ppd", *args)
        self.proc, self.url = start_server(list(args), log_path, env=env, timeout=120)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=5).json()

    def worker_pids(self) -> dict[str, int]:
        """role -> pid of unit 0's workers."""
        return {w["role"]: w["pid"] for w in self.health()["units"][0]["workers"]}

    def metrics(self) -> dict[str, float]:
        """Prometheus samples, summed over labels: name -> value."""
        return gauges(self.url)

    def stop(self) -> int:
        if self.proc.poll() is None:
            stop_server(self.proc)
        return self.proc.returncode


def process_title(pid: int) -> str:
    """What `ps` shows for a process: its command line (setproctitle rewrites it)."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


def thread_names(pid: int) -> set[str]:
    """The names of a process's threads (`top -H`)."""
    return {(task / "comm").read_text().strip() for task in Path(f"/proc/{pid}/task").iterdir()}
