"""Timing one engine's steps on one share of the device, for `ppd profile partition`: decode steps,
prefills, and a prefill run beside a decode until the decode's timing ends (the two meet at a
barrier to start together).

A Timer runs its steps on its share's stream (none on the CPU, where a share is the cores its
process is pinned to) and, where the share has CUDA graphs captured on that stream, replays them: a
decode step is then timed as the decode worker runs it, on the share's SMs, not as the host time of
an eager step.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from engine.engine import Engine
from engine.model_runner import StepInput
from engine.step_timing import Blocks, greedy_step, median_ms

WARMUP_STEPS = 3
# A decode point stops timing after this long (once it has MIN_STEPS): time-sliced on a small CPU, a
# step can take many times as long as alone (docs/profiling.md#measurements-behind-the-code), and
# the full count of steps would take minutes.
POINT_LIMIT_S = 2.0
MIN_STEPS = 5
SYNC_TIMEOUT_S = (
    300.0  # the longest one worker waits for the other at the start of an interference point
)


class Timer:
    """Times one engine's steps on its stream: decodes use the first `decode_blocks` blocks of the
    pool, prefills the rest, so a prefill beside a decode never writes the decode's KV. graphs: the
    key of the graph set captured on stream (engine.runner.capture_graphs), replayed by its steps;
    None: the runner's steps as they are (eager where it has no graphs)."""

    def __init__(
        self, engine: Engine, decode_blocks: int, stream: Any = None, graphs: Any = None
    ) -> None:
        self.engine, self.stream, self.graphs, self.offset = engine, stream, graphs, decode_blocks
        self.decode_blocks = Blocks(decode_blocks, engine.plan.block_size)
        self.prefill_blocks = Blocks(engine.num_kv_blocks - decode_blocks, engine.plan.block_size)

    def decode(
        self, batch: int, context: int, steps: int, start: Any = None, stop: Any = None
    ) -> list[float]:
        """Step times (ms) of `steps` steps (fewer past POINT_LIMIT_S) of `batch` sequences at
        `context` cached tokens; with start and stop, timing begins when both workers reach `start`
        and `stop` is set after the last step (the prefill beside it runs until then)."""
        inputs = [
            StepInput([1], context, self.decode_blocks.table(context + 1)) for _ in range(batch)
        ]
        times = []
        try:
            with self.on_stream():
                for _ in range(WARMUP_STEPS):
                    greedy_step(self.engine, inputs)
                if start is not None:
                    start.wait(SYNC_TIMEOUT_S)
                first = time.perf_counter()
                while len(times) < steps and (
                    len(times) < MIN_STEPS or time.perf_counter() - first < POINT_LIMIT_S
                ):
                    began = time.perf_counter()
                    greedy_step(self.engine, inputs)
                    times.append((time.perf_counter() - began) * 1000)
        except BaseException:
            if start is not None:
                # the prefill waiting at start must not wait for a decode that will never come
                start.abort()
            raise
        finally:
            if stop is not None:
                stop.set()
        return times

    def prefill(self, prompt: int, total: int, repeat: int) -> float:
        """Tokens/s of prefill steps of max(1, total // prompt) prompts of `prompt` tokens (the
        median step)."""
        num = max(1, total // prompt)
        inputs = [StepInput([1] * prompt, 0, self._prefill_table(prompt)) for _ in range(num)]
        with self.on_stream():
            ms = median_ms(
                lambda: greedy_step(self.engine, inputs), self.engine.device, repeat, warmup=1
            )
        return num * prompt / (ms / 1000)

    def prefill_until(
        self, kind: str, concurrent: int, new_tokens: int, context: int, start: Any, stop: Any
    ) -> int:
        """Runs steps of `concurrent` prefills of `new_tokens` (over `context` cached tokens for an
        append) from `start` until `stop` is set; the number of steps."""
        cached = context if kind == "append" else 0
        inputs = [
            StepInput([1] * new_tokens, cached, self._prefill_table(cached + new_tokens))
            for _ in range(concurrent)
        ]
        try:
            with self.on_stream():
                greedy_step(
                    self.engine, inputs
                )  # warm-up, before the decode beside it starts timing
                start.wait(SYNC_TIMEOUT_S)
                steps = 0
                while True:
                    greedy_step(self.engine, inputs)
                    steps += 1
                    if stop.is_set():
                        return steps
        except BaseException:
            # the decode waiting at start must not wait for a prefill that will never come
            start.abort()
            raise

    def on_stream(self) -> contextlib.AbstractContextManager:
        """The context this share's work runs in: its stream, with its graph set picked for the
        runner's steps."""
        if self.graphs is not None:
            self.engine.runner.use_graphs(self.graphs)
        return (
            torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        )

    def _prefill_table(self, tokens: int) -> list[int]:
        return [self.offset + b for b in self.prefill_blocks.table(tokens)]
