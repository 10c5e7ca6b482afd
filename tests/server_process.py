"""Run `ppd serve` as a real subprocess for end-to-end tests."""

from __future__ import annotations

import os
from pathlib import Path

import httpx

from bench.cli import start_server, stop_server


class ServerProcess:
    """`ppd serve <args>` on a free port, ready; `stop()` sends SIGTERM and returns the exit status."""

    def __init__(self, *args: str, cache_dir: Path, log_path: Path) -> None:
        self.log_path = log_path
        env = {**os.environ, "PPD_CACHE_DIR": str(cache_dir), "PYTHONUNBUFFERED": "1"}
        self.proc, self.url = start_server(list(args), log_path, env=env, timeout=120)

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
            stop_server(self.proc)
        return self.proc.returncode
