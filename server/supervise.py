"""Background tasks that carry requests, run under a guard, as vLLM's output handler is: a
try/except around the loop, the error sent to every request the loop carried, the process marked
unhealthy.

A supervised task that raises is logged with its traceback; its owner's on_failure ends what it
carried (each owner says with which error); while it is down the process is unhealthy (it is named
in `problems`, which /health shows with a 503); and it runs again after a backoff, healthy again
once the new run has lasted HEALTHY_AFTER_S. Each owner says in its docstring why running the task
again, rather than restarting the process, is the cure.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger("ppd.api")

RESTART_DELAY_S = 0.1  # the first restart's wait; it doubles while the task keeps failing
MAX_RESTART_DELAY_S = 10.0
HEALTHY_AFTER_S = 1.0  # a run that lasted this long without failing clears the process's problem


def supervise(
    name: str,
    body: Callable[[], Awaitable[None]],
    problems: dict[str, str] | None,
    on_failure: Callable[[Exception], None] | None = None,
) -> asyncio.Task:
    """Run body() as a task, again each time it raises, until it returns or is cancelled. name says
    what it is in the log and on /health ("the output reader"); problems: the process's, where the
    task is named while it is down (None: a task whose failure carries no request, which leaves the
    process healthy); on_failure(exc) ends what the task carried, at once."""
    return asyncio.get_running_loop().create_task(_run(name, body, problems, on_failure), name=name)


async def _run(
    name: str,
    body: Callable[[], Awaitable[None]],
    problems: dict[str, str] | None,
    on_failure: Callable[[Exception], None] | None,
) -> None:
    loop = asyncio.get_running_loop()
    delay = RESTART_DELAY_S
    while True:
        began = time.monotonic()
        healthy = (
            loop.call_later(HEALTHY_AFTER_S, problems.pop, name, None)
            if problems and name in problems
            else None
        )
        try:
            await body()
            return
        except Exception as exc:  # noqa: BLE001 - the point: no exception ends a task that carries requests silently
            if (
                time.monotonic() - began > MAX_RESTART_DELAY_S
            ):  # it had been running well: start the backoff over
                delay = RESTART_DELAY_S
            log.error(
                "%s failed; ending what it carried and running it again in %.1fs",
                name,
                delay,
                exc_info=exc,
            )
            if problems is not None:
                problems[name] = (
                    f"{name} failed ({type(exc).__name__}: {exc}); it is being restarted"
                )
            if on_failure is not None:
                try:
                    on_failure(exc)
                except Exception:  # noqa: BLE001 - the restart below must happen all the same
                    log.exception("%s: ending what it carried failed too", name)
        finally:
            if healthy is not None:
                healthy.cancel()
        await asyncio.sleep(delay)
        delay = min(2 * delay, MAX_RESTART_DELAY_S)
