"""A supervised background task: logged, its problem on the process while it is down, run again,
healthy again."""

from __future__ import annotations

import asyncio
import logging

import pytest

from server import supervise as supervise_module
from server.supervise import supervise


def test_a_task_that_raises_is_logged_ended_run_again_and_healthy_once_it_runs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(supervise_module, "HEALTHY_AFTER_S", 0.05)
    problems: dict[str, str] = {}
    failures: list[Exception] = []
    runs: list[int] = []
    seen: list[dict[str, str]] = []

    async def body() -> None:
        runs.append(len(runs))
        seen.append(dict(problems))
        if len(runs) <= 2:
            raise KeyError("boom")
        await asyncio.sleep(0.2)  # a run that lasts: the problem clears while it runs

    async def main() -> None:
        await asyncio.wait_for(supervise("the test task", body, problems, failures.append), 5)

    with caplog.at_level(logging.ERROR):
        asyncio.run(main())
    assert len(runs) == 3 and len(failures) == 2
    assert seen[0] == {} and "the test task failed (KeyError: 'boom')" in seen[1]["the test task"]
    assert problems == {}, "healthy again once the third run lasted"
    assert [r.exc_info is not None for r in caplog.records] == [True, True], (
        "each failure logged with its traceback"
    )


def test_a_task_whose_failure_carries_no_request_leaves_the_process_healthy() -> None:
    async def main() -> dict[str, str]:
        async def body() -> None:
            raise OSError("disk full")

        problems: dict[str, str] = {}
        task = supervise("the metrics writer", body, None)
        await asyncio.sleep(0.05)
        task.cancel()
        return problems

    assert asyncio.run(main()) == {}
