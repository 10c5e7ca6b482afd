"""How `ppd probe` runs a step so that its failure becomes a finding, never a crash or a hang of the
whole probe.

Contract: every probe step returns a plain JSON-serialisable dict with "ok" (bool) and "error" (str
| None). guarded() turns an exception into such a dict; run_in_child() runs a step in a spawned
process, so a segfault, a sticky CUDA error or a wedged driver costs only that step: a dead child or
one past its timeout is reported (and killed), not waited on. The probe's own process never
initialises CUDA.

A child's function must be module-level (spawn pickles it by name). env is applied in the child
before the function runs (a value of None removes the variable), so CUDA sees it when it
initialises, and processes the child starts inherit it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Callable

SPAWN = mp.get_context(
    "spawn"
)  # fork would copy a CUDA-initialised parent, which CUDA does not support

Env = dict[str, "str | None"]
Finding = dict[str, Any]


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def failed(error: str, **extra: Any) -> Finding:
    return {"ok": False, "error": error, **extra}


def skipped(reason: str) -> Finding:
    """A step that was not run: not a failure of the host, so error stays None."""
    return {"ok": False, "error": None, "skipped": reason}


def with_status(result: Any) -> Finding:
    """result as a finding: a dict gets "ok" (default True) and "error" (default None); anything
    else is a bug."""
    if not isinstance(result, dict):
        return failed(f"the probe returned {type(result).__name__}, not a dict")
    result.setdefault("ok", True)
    result.setdefault("error", None)
    return result


def guarded(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Finding:
    """fn(*args, **kwargs) as a finding; an exception becomes ok=False with its text and the last
    frames."""
    try:
        return with_status(fn(*args, **kwargs))
    except Exception as exc:
        return failed(error_text(exc), traceback=traceback.format_exc(limit=-4))


def apply_env(env: Env | None) -> None:
    for name, value in (env or {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _child_main(conn: Connection, fn: Callable[..., Any], args: tuple, env: Env | None) -> None:
    apply_env(env)
    conn.send(guarded(fn, *args))
    conn.close()


@dataclass
class Child:
    """A started child and the read end of the pipe its finding comes back on."""

    name: str
    process: BaseProcess
    conn: Connection


def start_child(
    fn: Callable[..., Any], args: tuple = (), env: Env | None = None, name: str | None = None
) -> Child:
    recv, send = SPAWN.Pipe(duplex=False)
    # Not a daemon process: daemonic processes may not start children, and the IPC exporter starts
    # its importer.
    process = SPAWN.Process(
        target=_child_main, args=(send, fn, args, env), name=name or fn.__name__, daemon=False
    )
    process.start()
    send.close()  # only the child holds the write end now, so its death reads as EOF here
    return Child(name=process.name, process=process, conn=recv)


def finish_child(child: Child, timeout: float) -> Finding:
    """The child's finding, or a failure if it died without one or sent none within timeout (it is
    then killed)."""
    grace = 15.0  # an answered child still tears CUDA down; a silent one is not waited for
    try:
        if child.conn.poll(max(timeout, 0.0)):
            result = child.conn.recv()
        else:
            grace = 0.0
            result = failed(f"{child.name}: no result within {timeout:.0f} s; the child was killed")
    except EOFError:
        child.process.join(5)
        result = failed(
            f"{child.name}: the child exited with code {child.process.exitcode} without a result"
        )
    finally:
        child.conn.close()
        _reap(child.process, grace)
    return result


def _reap(process: BaseProcess, grace: float) -> None:
    """Give the child grace seconds to exit, then terminate it, then kill it."""
    process.join(grace)
    if process.is_alive():
        process.terminate()
        process.join(5)
    if process.is_alive():
        process.kill()
        process.join(5)


def run_in_child(
    fn: Callable[..., Any], args: tuple = (), env: Env | None = None, timeout: float = 120.0
) -> Finding:
    """fn(*args) in a spawned process, as a finding; never raises, never waits past timeout (plus
    reaping)."""
    try:
        child = start_child(fn, args, env)
    except Exception as exc:
        return failed(f"could not start a child process: {error_text(exc)}")
    return finish_child(child, timeout)


def finish_all(children: list[Child], timeout: float) -> list[Finding]:
    """Each child's finding, all within one shared deadline."""
    deadline = time.monotonic() + timeout
    return [finish_child(child, deadline - time.monotonic()) for child in children]
