"""Run `ppd serve` as a real subprocess for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

START_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`ppd serve <args>` on a free port; `stop()` sends SIGTERM and checks that it exits cleanly."""

    def __init__(self, *args: str, cache_dir: Path, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PPD_CACHE_DIR": str(cache_dir), "PYTHONUNBUFFERED": "1"}
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--port", str(self.port), *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.wait_ready()

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ppd serve exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"ppd serve not ready after {timeout}s:\n{self.log_path.read_text()}")

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=5).json()

    def worker_pids(self) -> dict[str, int]:
        """role -> pid of unit 0's workers."""
        return {w["role"]: w["pid"] for w in self.health()["units"][0]["workers"]}

    def metrics(self) -> dict[str, float]:
        """Prometheus samples, summed over labels: name -> value."""
        values: dict[str, float] = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=5).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.split("{")[0].split(" ")[0], float(line.rsplit(" ", 1)[1])
                values[name] = values.get(name, 0.0) + value
        return values

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
