"""CPU partitioning: each worker pinned to its own cores, the CPU stand-in for SM shares."""

from __future__ import annotations

import os

import torch


def available_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def split_cores(
    cores: list[int], num_units: int, with_prefill: bool
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(decode cores, prefill cores) for each unit. Units get disjoint slices when there are enough
    cores; with fewer cores than workers, workers share cores round-robin (pinning then only spreads
    the load)."""
    per_unit = len(cores) // num_units
    need = 2 if with_prefill else 1
    shares = []
    for unit in range(num_units):
        if per_unit >= need:
            mine = cores[unit * per_unit : (unit + 1) * per_unit]
        else:
            mine = [cores[(unit * need + i) % len(cores)] for i in range(need)]
        if not with_prefill:
            shares.append((tuple(mine), ()))
            continue
        half = len(mine) // 2
        shares.append((tuple(mine[:half]), tuple(mine[half:])))
    return shares


def rank_cores(cores: tuple[int, ...], rank: int, size: int) -> tuple[int, ...]:
    """A tensor-parallel rank's part of its role's cores: an equal slice each when there are enough,
    else all of them (the ranks then take turns on them)."""
    if len(cores) < size:
        return cores
    per = len(cores) // size
    return cores[rank * per : (rank + 1) * per]


def pin_to_cores(cores: tuple[int, ...]) -> None:
    """Run this process (and torch's intra-op pool) on exactly these cores; no-op for an empty
    share."""
    if not cores:
        return
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))


def repin(cores: tuple[int, ...]) -> None:
    """Move this running process to exactly these cores: every thread it has (sched_setaffinity(0)
    would move only the caller; torch's pool threads keep the affinity they were started with), then
    torch's pool size."""
    if not cores:
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that ended meanwhile
    torch.set_num_threads(len(cores))
