"""Timing the engine's steps outside a server, for the tools that measure the engine alone (`ppd
bench engine`, `ppd bench sampling`, `ppd profile partition`): block tables for made-up
sequences, one greedy step, the median of timed calls, random KV, the engine's shared memory
released, and the --model/--device/--dtype flags they share.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from engine.demo import DEMO_MODEL
from engine.engine import Engine
from engine.model_runner import StepInput
from engine.sampler import Row
from engine.sampling_params import SamplingParams
from engine.shared_memory import release_name

# Llama-3.1-8B's configuration (no weights: they are random), kept with the benchmarks' other model
# folders.
LLAMA_8B = Path(__file__).resolve().parents[1] / "bench" / "models" / "llama-3.1-8b"
GREEDY = SamplingParams(temperature=0.0)


class Blocks:
    """Hands out consecutive blocks of a pool of `num_blocks` to made-up sequences, from the start
    again when the pool runs out (a timing never reads what another sequence wrote)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size, self.next = num_blocks, block_size, 0

    def fits(self, tokens_per_seq: int, num_seqs: int) -> bool:
        """Whether num_seqs sequences of tokens_per_seq tokens fit the pool at once."""
        return num_seqs * -(-tokens_per_seq // self.block_size) <= self.num_blocks

    def table(self, num_tokens: int) -> list[int]:
        """The block table of one sequence of num_tokens tokens."""
        n = -(-num_tokens // self.block_size)
        if self.next + n > self.num_blocks:
            self.next = 0
        table = list(range(self.next, self.next + n))
        self.next += n
        return table


def greedy_step(engine: Engine, inputs: list[StepInput]) -> float:
    """Run one step with greedy sampling, returning once its tokens are on the host; the host time
    until the step was queued on the device (ms)."""
    start = time.perf_counter()
    logits = engine.runner.forward(inputs)
    queued = time.perf_counter()
    engine.sampler(logits, [Row(GREEDY)] * len(logits))  # its copy to the host waits for the step
    return (queued - start) * 1000


def time_step(
    engine: Engine, inputs: list[StepInput], repeat: int, warmup: int = 3, graphs: bool = True
) -> tuple[float, float]:
    """(median wall ms, median host ms) of the greedy step over `repeat` runs, after `warmup` runs;
    with the runner's CUDA graphs as they are, or turned off for the while (graphs=False: eager)."""
    runner = engine.runner
    saved, runner.graphs = runner.graphs, runner.graphs if graphs else None
    try:
        for _ in range(warmup):
            greedy_step(engine, inputs)
        host, wall = [], []
        for _ in range(repeat):
            start = time.perf_counter()
            host.append(greedy_step(engine, inputs))
            wall.append((time.perf_counter() - start) * 1000)
        return statistics.median(wall), statistics.median(host)
    finally:
        runner.graphs = saved


def device_ms(
    engine: Engine, inputs: list[StepInput], repeat: int, graphs: bool = True, host_ms: float = 10.0
) -> float | None:
    """The median time the greedy step keeps the device busy, host time out: the step is queued
    behind a sleeping kernel long enough for the host to queue all of it before the device starts
    it (twice host_ms, the step's host time, and a millisecond), and timed by CUDA events from
    the sleep's end to the tokens' copy. None off CUDA."""
    if engine.device.type != "cuda":
        return None
    runner = engine.runner
    saved, runner.graphs = runner.graphs, runner.graphs if graphs else None
    try:
        greedy_step(engine, inputs)  # warm
        cycles = int(_sleep_cycles_per_ms() * (2 * host_ms + 1))
        times = []
        for _ in range(repeat):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(cycles)
            start.record()
            logits = runner.forward(inputs)
            engine.sampler.draw(logits, [Row(GREEDY)] * len(logits))
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    finally:
        runner.graphs = saved


@functools.cache
def _sleep_cycles_per_ms() -> float:
    """torch.cuda._sleep's cycles per millisecond on this GPU, timed once."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**7)
    end.record()
    end.synchronize()
    return 10**7 / start.elapsed_time(end)


def pipelined_ms(
    engine: Engine, inputs: list[StepInput], repeat: int, graphs: bool = True
) -> float:
    """The median wall time a step takes when each is launched before the one before is taken, as
    async scheduling runs them (Engine.launch): every input of one token takes its token from the
    step before. The host's work then overlaps the device's: a step costs the larger of the two."""
    runner = engine.runner
    saved, runner.graphs = runner.graphs, runner.graphs if graphs else None
    ahead, k = [], 0
    for inp in inputs:
        one = len(inp.token_ids) == 1 and inp.sample
        ahead.append(replace(inp, token_ids=[0], previous=k) if one else inp)
        k += inp.sample
    rows = [Row(GREEDY)] * k
    try:
        launched = engine.launch(inputs, rows)
        for _ in range(2):  # warm
            launched = engine.launch(ahead, rows, launched)
        launched.result()
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            batch = [engine.launch(ahead, rows, launched)]
            for _ in range(4):
                batch.append(engine.launch(ahead, rows, batch[-1]))
                batch[-2].result()
            batch[-1].result()
            launched = batch[-1]
            times.append((time.perf_counter() - start) * 1000 / len(batch))
        return statistics.median(times)
    finally:
        runner.graphs = saved


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(
    fn: Callable[[], object], device: torch.device, repeat: int, warmup: int = 2
) -> float:
    """The median wall time (ms) of fn() over `repeat` calls after `warmup`, each call's work
    finished on device."""
    for _ in range(warmup):
        fn()
    sync_device(device)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync_device(device)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def fill_random_kv(engine: Engine) -> None:
    """Random KV: never time on zeros, which can hide unwritten outputs and run faster than data."""
    for chunk in engine.runner.kv_pool.view(-1).split(2**28):
        chunk.normal_(0.0, 1.0)


def release_engine(engine: Engine) -> None:
    """Unlink the shared memory of the engine's weights and KV pool (Engine.create made it under its
    names)."""
    release_name(engine.weights_handle)
    release_name(engine.kv_handle)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model, --device and --dtype of the tools that time the engine alone (bench engine, profile
    partition)."""
    p.add_argument(
        "--model",
        default=None,
        help=f"model folder (default: {LLAMA_8B} with random weights on a GPU, the demo model on "
        "the CPU)",
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cuda", "cpu"],
        help="auto: CUDA when there is a GPU",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and KV dtype (auto: bfloat16 on a GPU for a float32 checkpoint)",
    )


def chosen_device(args: argparse.Namespace) -> torch.device:
    """--device: auto is CUDA when there is a GPU."""
    if args.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(args.device)


def chosen_model(args: argparse.Namespace, device: torch.device) -> str:
    """--model: by default Llama-3.1-8B's configuration (random weights) on a GPU, the demo model on
    the CPU."""
    return args.model or (str(LLAMA_8B) if device.type == "cuda" else DEMO_MODEL)
