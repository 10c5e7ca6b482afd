"""Tensor parallelism: a rank's place among the processes that hold one role's shards of a model.

A unit of `ppd serve --tensor-parallel-size N` spans N devices. On each device a decode rank and a
prefill rank share that device's shard of the weights and of the KV pool, as a one-device unit's two
workers share the whole of them; the N decode ranks form one communicator and the N prefill ranks
another (engine/model.py shards in the Megatron style: two all-reduces a layer, one for the
embedding, and an all-gather of the logits).

Rank 0 of each role runs the worker (its scheduler, sockets and sampling); ranks 1..N-1 are
followers: they run each forward pass rank 0 runs, with the same inputs, which rank 0 sends them
over a ZeroMQ socket before the pass (FollowerLink). The collectives are NCCL's on GPUs; on the CPU
the model's all-reduces and all-gathers go through shared memory (engine/shm_collectives.py: gloo's
loopback TCP is slow), the rest through gloo. A follower waits for its next step on the socket
rather than in a collective, so an idle server holds no collective open (whose timeout would end
it).
"""

from __future__ import annotations

import datetime
import os
import pickle
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from engine.shm_collectives import ShmCollectives

COLLECTIVE_TIMEOUT = datetime.timedelta(
    minutes=30
)  # one step's collectives; an idle rank waits on its socket


class TensorParallel:
    """This process's rank among `size` ranks of one role, and the collectives the model needs. size
    1: every collective is the identity, and nothing is initialised."""

    def __init__(
        self, size: int = 1, rank: int = 0, group: Any = None, shm: ShmCollectives | None = None
    ) -> None:
        assert 0 <= rank < size, f"rank {rank} of {size}"
        self.size, self.rank, self.group, self.shm = size, rank, group, shm
        # Time spent in collectives and the bytes each rank sent, for `ppd bench engine` (timed only
        # when asked, each collective then waited for on the device).
        self.timed = False
        self.seconds = 0.0
        self.wire_bytes = 0.0

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: Tensor) -> Tensor:
        """The sum of x over the ranks, in place (a row-parallel layer's partial products)."""
        if self.size > 1:
            # A ring all-reduce sends 2 (N - 1) / N of the tensor from each rank (NCCL's
            # bus-bandwidth convention).
            run = (
                (lambda: self.shm.all_reduce(x))
                if self.shm is not None and not x.is_cuda
                else (lambda: dist.all_reduce(x, group=self.group))
            )
            self._timed(run, x, 2 * (self.size - 1) / self.size)
        return x

    def all_gather_last(self, x: Tensor) -> Tensor:
        """[..., n] on every rank -> [..., size * n], rank r's part at r * n (a vocabulary-parallel
        layer's logits)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        run = (
            (lambda: self.shm.all_gather(out, x))
            if self.shm is not None and not x.is_cuda
            else (lambda: _GATHER(out, x, group=self.group))
        )
        self._timed(run, out, (self.size - 1) / self.size)
        return out.view(self.size, *x.shape).movedim(0, -2).flatten(-2)

    def all_gather_object(self, value: Any) -> list[Any]:
        """Every rank's value (picklable), in rank order."""
        if self.size == 1:
            return [value]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def split(self) -> TensorParallel:
        """A second communicator over the same ranks (a one-process unit's prefill threads, beside
        the decode ranks' own): every rank calls it at the same point, from its main thread."""
        if self.size == 1:
            return SINGLE
        group = dist.new_group(list(range(self.size)))
        shm = (
            _shm_collectives(self.size, self.rank, "split", group) if self.shm is not None else None
        )
        return TensorParallel(self.size, self.rank, group, shm)

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.group)

    def min_over_ranks(self, value: int) -> int:
        """The smallest of each rank's value (the KV blocks that fit on every device of a unit)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=_collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def _timed(self, run: Callable[[], Any], moved: Tensor, wire: float) -> None:
        """run() the collective over `moved` (the tensor every rank ends with); timed, it counts
        wire x its bytes as sent by each rank."""
        if not self.timed:
            run()
            return
        if moved.is_cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        if moved.is_cuda:
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - started
        self.wire_bytes += wire * moved.numel() * moved.element_size()

    def reset_timing(self) -> None:
        self.seconds, self.wire_bytes = 0.0, 0.0


SINGLE = TensorParallel()
# Ranks' tensors stacked along the first dimension (the newer name of all_gather_into_tensor).
_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _collective_device() -> torch.device:
    return torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")


def init_tensor_parallel(size: int, rank: int, store_file: str, device: str) -> TensorParallel:
    """Join the role's communicator (a file store in the unit's IPC folder names it): NCCL on a GPU,
    gloo on the CPU."""
    if size == 1:
        return SINGLE
    os.environ.setdefault(
        "GLOO_SOCKET_IFNAME", "lo"
    )  # one node: the ranks meet on the loopback interface
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"file://{store_file}",
        rank=rank,
        world_size=size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    shm = _shm_collectives(size, rank, os.path.basename(store_file)) if backend == "gloo" else None
    return TensorParallel(size, rank, dist.group.WORLD, shm)


def _shm_collectives(size: int, rank: int, tag: str, group: Any = None) -> ShmCollectives:
    """The CPU ranks' shared-memory communicator: rank 0 makes the file (named after its pid and
    tag), the others map it, then its name goes."""
    # Named ppd-<pid>-...: what a rank 0 killed before the unlink leaves, the next `ppd serve`
    # removes.
    name = [f"/dev/shm/ppd-{os.getpid()}-tp-{tag}" if rank == 0 else None]
    shm = ShmCollectives(name[0], size, rank, create=True) if rank == 0 else None
    dist.broadcast_object_list(name, src=0, group=group)
    if rank != 0:
        shm = ShmCollectives(name[0], size, rank, create=False)
    dist.barrier(group=group)
    if rank == 0:
        ShmCollectives.unlink(name[0])
    return shm


class FollowerLink:
    """Rank 0's way to its followers: each message (a step's inputs, a command) goes to every
    follower, in order. A follower binds its socket (ipc, in the unit's folder), rank 0 connects
    to each."""

    def __init__(self, ctx: Any, addresses: list[str]) -> None:
        import zmq

        self.socks = []
        for address in addresses:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self.socks.append(sock)

    def send(self, kind: str, payload: Any = None) -> None:
        raw = pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)
        for sock in self.socks:
            sock.send(raw)

    def send_each(self, kind: str, payloads: list[Any]) -> None:
        """Follower i (rank i + 1) gets payloads[i]."""
        assert len(payloads) == len(self.socks), "one payload per follower"
        for sock, payload in zip(self.socks, payloads):
            sock.send(pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL))


def follower_socket(ctx: Any, address: str) -> Any:
    """A follower's end of its FollowerLink: messages arrive as (kind, payload), read with
    receive()."""
    import zmq

    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    return sock


def receive(sock: Any) -> tuple[str, Any]:
    return pickle.loads(sock.recv())
