"""The CPU ranks' shared-memory collectives: every rank ends with the sum (or the stack) of every
rank's tensor, the same bits on each, for tensors larger than a slot (sent in pieces), many calls in
a row (the two slot sets alternate), and ranks that run at different speeds."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.shm_collectives import ShmCollectives

SLOT = 4096  # bytes: a 1,000-element float32 tensor goes in pieces


def tensors(rank: int, call: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + call)
    n = 1000 if call % 3 else 7  # a tensor of 4,000 bytes (pieces) and one of 28
    return torch.randn(n, generator=gen, dtype=torch.float32)


def rank_main(path: str, size: int, rank: int, calls: int, ready: Any, results: Any) -> None:
    try:
        if rank == 0:
            comm = ShmCollectives(path, size, rank, create=True, slot_bytes=SLOT)
            for _ in range(size - 1):
                ready.put(True)
        else:
            ready.get(timeout=60)
            comm = ShmCollectives(path, size, rank, create=False, slot_bytes=SLOT)
        rng = random.Random(rank)
        sums, gathers = [], []
        for call in range(calls):
            if rng.random() < 0.2:
                time.sleep(0.002)  # one rank late now and then
            x = tensors(rank, call)
            comm.all_reduce(x)
            sums.append(x.numpy())
            mine = tensors(rank, call)
            out = torch.empty(size * mine.shape[0])
            comm.all_gather(out, mine)
            gathers.append(out.numpy())
        results.put((rank, sums, gathers, None))
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put((rank, None, None, traceback.format_exc()))


@pytest.mark.parametrize("size", [2, 3])
def test_every_rank_gets_the_same_sum_and_stack(size: int, tmp_path: Path) -> None:
    path = f"/dev/shm/ppd-test-{os.getpid()}-{size}"
    ctx = mp.get_context("spawn")
    ready, results = ctx.Queue(), ctx.Queue()
    calls = 40
    procs = [
        ctx.Process(target=rank_main, args=(path, size, r, calls, ready, results))
        for r in range(size)
    ]
    try:
        for p in procs:
            p.start()
        got = {}
        for _ in range(size):
            rank, sums, gathers, error = results.get(timeout=120)
            assert error is None, f"rank {rank}:\n{error}"
            got[rank] = (sums, gathers)
    finally:
        ShmCollectives.unlink(path)
        for p in procs:
            p.join(timeout=10)
    for call in range(calls):
        expected = tensors(0, call).clone()
        for r in range(1, size):
            expected += tensors(r, call)  # rank order, as the communicator sums
        stacked = torch.cat([tensors(r, call) for r in range(size)])
        for rank in range(size):
            assert torch.equal(torch.from_numpy(got[rank][0][call]), expected), (rank, call)
            assert torch.equal(torch.from_numpy(got[rank][1][call]), stacked), (rank, call)
