"""Server lifecycle for benchmarks: start a server on a free port, wait until its /health says
ready, stop it.

A server that exits or is not ready in time is a BenchError carrying its log, whose last line says
why."""

from __future__ import annotations

import contextlib
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.common import BenchError

SERVER_START_TIMEOUT_S = 300


def free_port() -> int:
    """A TCP port no one listens on now (for a server about to start)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    serve_args: list[str],
    log: Path,
    env: dict[str, str] | None = None,
    timeout: float = SERVER_START_TIMEOUT_S,
) -> tuple[subprocess.Popen, str]:
    """`ppd serve <serve_args>` on a free port, returned once /health says ready; its output goes to
    log."""
    port, host = option_value(serve_args, "--port"), option_value(serve_args, "--host")
    if port is None:  # a free one, unless the serve arguments name one
        port = str(free_port())
        serve_args = ["--port", port, *serve_args]
    host = "127.0.0.1" if host in (None, "0.0.0.0", "::", "localhost") else host
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    cmd = [sys.executable, "-m", "cli", "serve", *serve_args]
    return start_process(
        cmd, log, url, env, timeout, name=f"ppd serve {shlex.join(serve_args)}"
    ), url


def start_process(
    argv: list[str],
    log: Path,
    url: str,
    env: dict[str, str] | None = None,
    timeout: float = SERVER_START_TIMEOUT_S,
    name: str | None = None,
) -> subprocess.Popen:
    """Any server's command line `argv`, returned once `url`/health answers 200; its output goes to
    log. `name` (default: the command line) is what an error calls it."""
    name = name or shlex.join(argv)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(
                f"`{name}` exited with {proc.returncode} (log {log}):\n{log.read_text()}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc
        time.sleep(0.1)
    stop_server(proc)
    raise BenchError(f"`{name}` not ready after {timeout}s (log {log}):\n{log.read_text()}")


def option_value(args: list[str], name: str) -> str | None:
    """The value of option `name` in a command line (its last one, as argparse takes it), or
    None."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


MODEL_FLAGS = (
    "--model",
    "--dtype",
    "--load-format",
)  # what every command that starts `ppd serve` takes as its own


def add_served_model_args(p) -> None:
    """--model, --dtype and --load-format of a command that starts `ppd serve`, as `ppd serve` takes
    them."""
    p.add_argument(
        "--model",
        default=None,
        help="the model folder the server serves, or 'demo' (default: the demo)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and KV dtype (default: the checkpoint's)",
    )
    p.add_argument(
        "--load-format",
        default=None,
        choices=["auto", "safetensors", "dummy"],
        help="dummy: random weights of the folder's config",
    )


def local_model(name: str | None) -> str | None:
    """`ppd bench --model` where it names a model `ppd serve` can load (a folder, or demo), for the
    servers a bench command starts; None where it is only the name requests carry (of a running
    server)."""
    from engine.demo import DEMO_MODEL

    return name if name is not None and (name == DEMO_MODEL or Path(name).is_dir()) else None


def with_model_args(
    serve_args: list[str],
    model: str | None = None,
    dtype: str | None = None,
    load_format: str | None = None,
) -> list[str]:
    """serve_args with the model flags given on the command's own command line added; one also in
    serve_args with another value is a BenchError naming both."""
    out = list(serve_args)
    for flag, value in zip(MODEL_FLAGS, (model, dtype, load_format)):
        if value is None:
            continue
        given = option_value(out, flag)
        if given is not None and given != value:
            raise BenchError(
                f"{flag} {value} and {flag} {given} in --serve-args differ: give it once"
            )
        if given is None:
            out += [flag, value]
    return out


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL when the server has not exited within 30 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
