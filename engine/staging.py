"""Pinned host buffers for a step's small inputs (token ids, positions, slots, block tables), copied
to the device without a synchronisation.

A copy from pageable memory (torch.tensor(list, device="cuda")) makes the host wait for the device;
from pinned memory it is queued like a kernel. A pinned buffer can be refilled only once the copy
that read it has run: the ring holds `depth` buffers and an event per buffer, and waits on that
event (normally long done) before reuse. On the CPU there is nothing to stage: the device tensor is
a copy of the host array.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


class Staging:
    """host = staging.buffer(n) (a host array of n elements to fill), then staging.to_device(...)
    queues copies of it."""

    def __init__(
        self, dtype: torch.dtype, device: torch.device, depth: int = 2, capacity: int = 1024
    ) -> None:
        self.dtype, self.device = dtype, device
        self.cuda = device.type == "cuda"
        self.host: list[Tensor] = [self._alloc(capacity) for _ in range(depth)]
        self.events: list[torch.cuda.Event | None] = [None] * depth
        self.slot, self.n = 0, 0

    def _alloc(self, n: int) -> Tensor:
        return torch.empty(n, dtype=self.dtype, pin_memory=self.cuda)

    def buffer(self, n: int) -> np.ndarray:
        """The next buffer of the ring, as a numpy view of n elements to fill (contents
        undefined)."""
        self.slot = (self.slot + 1) % len(self.host)
        if (event := self.events[self.slot]) is not None:
            event.synchronize()
        if self.host[self.slot].numel() < n:
            self.host[self.slot] = self._alloc(max(n, 2 * self.host[self.slot].numel()))
        self.n = n
        return self.host[self.slot].numpy()[:n]

    def to_device(
        self, dst: Tensor | None = None, start: int = 0, stop: int | None = None
    ) -> Tensor:
        """Queue the copy of elements [start, stop) of the filled buffer (default: all of it) into
        dst (a device tensor of that many elements, possibly a strided view of a static buffer),
        else into a new device tensor; returns the device tensor."""
        src = self.host[self.slot][start : self.n if stop is None else stop]
        if dst is None:
            if not self.cuda:
                return src.clone()
            dst = torch.empty(src.shape, dtype=self.dtype, device=self.device)
        dst.copy_(src.view(dst.shape), non_blocking=self.cuda)
        # the buffer's event: recorded after its latest copy, which follows the others on the stream
        if self.cuda:
            event = self.events[self.slot] or torch.cuda.Event()
            event.record()
            self.events[self.slot] = event
        return dst


def take_previous(
    ids: Tensor, previous: list[tuple[int, int]], tokens: Tensor | None, staging: Staging
) -> None:
    """Write into the device's input ids the tokens that the step before sampled and the host has
    not seen yet: ids[row] = tokens[index] for each (row, index) of previous (queued behind that
    step on the same stream)."""
    if not previous:
        return
    assert tokens is not None, "a step takes tokens of the step before, and none was given"
    k = len(previous)
    host = staging.buffer(2 * k)
    host[:k], host[k:] = zip(*previous)
    pairs = staging.to_device()
    ids.index_copy_(0, pairs[:k], tokens.index_select(0, pairs[k:]).to(ids.dtype))
