"""All-reduce and all-gather between the CPU ranks of one host through shared memory (the CPU's
stand-in for NCCL).

gloo's collectives go through the loopback TCP stack, slow for a decode step's many small ones
(docs/cpu-engine.md#measurements-behind-the-code). Here each rank copies its tensor into its slot of
one /dev/shm file, tells every other rank (a POSIX semaphore for each pair of sender and receiver,
in the same file: sem_post is a full memory barrier, so the copy is visible before the signal, and a
receiver's k-th wait on a sender's semaphore is that sender's k-th call), waits for theirs, and sums
the slots in rank order, so that every rank ends with the same bits. Two sets of slots alternate
between calls: a rank writes set p again only two calls later, after every rank has signalled the
call between, which each does only once it finished reading set p. A tensor larger than a slot goes
in slot-sized pieces.

Waiting blocks in the kernel (sem_timedwait), so ranks that share a core take turns rather than
spin.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import time
from pathlib import Path

import torch
from torch import Tensor

SLOT_BYTES = 8 * 2**20  # one rank's piece of one call
HEADER = (
    4096  # the semaphores, one per (receiver, sender), each on its own 64-byte line: up to 8 ranks
)
SEM_STRIDE = 64
WAIT_S = 30 * 60  # a rank that has not signalled in this long is gone: raise rather than hang


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL("libc.so.6", use_errno=True)
_libc.sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
_libc.sem_post.argtypes = [ctypes.c_void_p]
_libc.sem_timedwait.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Timespec)]


class ShmCollectives:
    """One role's ranks on one host: create() on rank 0 before the others open() the same path."""

    def __init__(
        self, path: str, size: int, rank: int, create: bool, slot_bytes: int = SLOT_BYTES
    ) -> None:
        assert size * size * SEM_STRIDE <= HEADER, "too many ranks for the header"
        self.size, self.rank, self.path, self.slot_bytes = size, rank, path, slot_bytes
        nbytes = HEADER + 2 * size * slot_bytes
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, nbytes)
            self.map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        if create:
            for r in range(size * size):
                if _libc.sem_init(self.base + r * SEM_STRIDE, 1, 0) != 0:
                    raise OSError(ctypes.get_errno(), "sem_init in shared memory failed")
        whole = torch.frombuffer(
            self.map, dtype=torch.uint8, offset=HEADER, count=2 * size * slot_bytes
        )
        self.slots = whole.view(2, size, slot_bytes)
        self.calls = 0

    @staticmethod
    def unlink(path: str) -> None:
        """Drop the file's name once every rank mapped it: the memory then lives as long as the
        ranks."""
        Path(path).unlink(missing_ok=True)

    def all_reduce(self, x: Tensor) -> None:
        """x = the sum of every rank's x, in place, summed in rank order (the same bits on every
        rank)."""
        flat = x.view(-1) if x.is_contiguous() else x.reshape(-1)
        step = self.slot_bytes // x.element_size()
        for start in range(0, flat.numel(), step):
            piece = flat[start : start + step]
            slots = self._exchange(piece)
            n = piece.numel()
            piece.copy_(slots[0][:n])
            for r in range(1, self.size):
                piece.add_(slots[r][:n])
        if not x.is_contiguous():
            x.copy_(flat.view(x.shape))

    def all_gather(self, out: Tensor, x: Tensor) -> None:
        """out [size * x.shape[0], ...] = every rank's x stacked along the first dimension, in rank
        order."""
        flat = x.reshape(-1)
        rows = out.view(self.size, -1)
        step = self.slot_bytes // x.element_size()
        for start in range(0, flat.numel(), step):
            piece = flat[start : start + step]
            slots = self._exchange(piece)
            for r in range(self.size):
                rows[r, start : start + piece.numel()].copy_(slots[r][: piece.numel()])

    def _exchange(self, piece: Tensor) -> list[Tensor]:
        """Put piece in this rank's slot of this call's set, signal every other rank, wait for each
        of theirs; every rank's slot of the set, viewed as piece's dtype."""
        parity = self.calls % 2
        self.calls += 1
        nbytes = piece.numel() * piece.element_size()
        mine = self.slots[parity, self.rank, :nbytes].view(piece.dtype)
        mine.copy_(piece)
        for r in range(self.size):
            if r != self.rank:
                _libc.sem_post(self._sem(r, self.rank))
        for r in range(self.size):
            if r != self.rank:
                self._wait(self._sem(self.rank, r))
        return [self.slots[parity, r, :nbytes].view(piece.dtype) for r in range(self.size)]

    def _sem(self, receiver: int, sender: int) -> int:
        return self.base + (receiver * self.size + sender) * SEM_STRIDE

    def _wait(self, sem: int) -> None:
        deadline = time.clock_gettime(time.CLOCK_REALTIME) + WAIT_S
        ts = _Timespec(int(deadline), int((deadline % 1) * 1e9))
        while _libc.sem_timedwait(sem, ctypes.byref(ts)) != 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            if err == errno.ETIMEDOUT:
                raise RuntimeError(
                    f"tensor-parallel rank {self.rank}: no word from the other ranks in {WAIT_S} s"
                )
            raise OSError(err, "sem_timedwait failed")
