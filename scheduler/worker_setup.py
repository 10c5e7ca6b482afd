"""Process plumbing both workers share: lifetime, device, cores and sockets."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import time
from collections.abc import Callable

import msgspec
import torch
import zmq

from engine.config import ModelError
from engine.memory_plan import StartupError
from partition.backends import apply_at_start
from partition.cpu import pin_to_cores, rank_cores
from scheduler.config import UnitConfig
from scheduler.messages import WorkerOutput, api_server_of

log = logging.getLogger("ppd.worker")
PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
# messages a worker queues for a helper API server that does not read (about 20 MB at most)
HELPER_QUEUE = 100_000
# of the newest step in the speed averages the workers report (the router's policy reads them)
EMA_WEIGHT = 0.1


def die_with_parent() -> None:
    """Be killed when the process that started this one dies (Linux), even by SIGKILL: no orphan
    keeps a GPU or a port."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:  # the parent died before prctl took effect
            os._exit(1)


def set_process_title(title: str) -> None:
    """Name this process as `ps`, `top` and an orchestrator's logs show it (vLLM's VLLM::EngineCore,
    ours ppd::u0-decode): its command line through setproctitle where installed, and its name (15
    characters) through prctl on Linux."""
    with contextlib.suppress(ImportError):
        import setproctitle

        setproctitle.setproctitle(title)
    set_thread_name(title)


def set_thread_name(name: str) -> None:
    """Name the calling thread (`top -H`, /proc/PID/task/TID/comm; the kernel keeps 15 characters).
    Linux only."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(
            PR_SET_NAME, ctypes.c_char_p(name.encode()[:15])
        )


def worker_title(cfg: UnitConfig, role: str, rank: int = 0) -> str:
    """ppd::u0-decode, ppd::u0-prefill; under tensor parallelism ppd::u0-rank1-decode."""
    return f"ppd::u{cfg.unit}-" + (f"rank{rank}-" if cfg.tensor_parallel_size > 1 else "") + role


def init_worker_process(cfg: UnitConfig, role: str, rank: int = 0) -> None:
    """Die with the launcher (no orphans even if it is killed), leave Ctrl-C and SIGTERM to it, see
    only the rank's GPU, and take our share of it (cores, or the MPS daemon and thread percentage; a
    tensor-parallel rank its part of its role's cores). Runs before anything touches CUDA."""
    die_with_parent()
    set_process_title(worker_title(cfg, role, rank))
    # Ctrl-C and SIGTERM reach the whole process group (a terminal, systemd): the launcher drains
    # the requests in flight and then stops the workers itself, so they ignore both (and die with it
    # all the same, above).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=cfg.log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s [unit {cfg.unit} %(processName)s]: %(message)s",
    )
    if cfg.gpu is not None:
        # Both workers of a rank see the same single GPU as cuda:0, so IPC handles name the same
        # device.
        os.environ["CUDA_VISIBLE_DEVICES"] = cfg.rank_gpu(rank)
        # The weights and KV pool are exported by CUDA IPC, whose path for expandable segments is
        # unreliable.
        for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
            if var in os.environ:
                kept = [
                    o
                    for o in os.environ[var].split(",")
                    if not o.replace(" ", "").startswith("expandable_segments")
                ]
                os.environ[var] = ",".join(kept)
    apply_at_start(cfg.partition, role)
    if cfg.tensor_parallel_size > 1 and (cores := cfg.partition.share(role).cores):
        pin_to_cores(rank_cores(cores, rank, cfg.tensor_parallel_size))
    torch.set_grad_enabled(False)


def zmq_socket(ctx: zmq.Context, kind: int, address: str, bind: bool = False) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


class ApiServers:
    """A worker's way to the API servers: each request's outputs (and the news that it started) go
    to the API server that sent it, and the rest of a WorkerOutput (stats, ready, fatal) to every
    one. With a single API server, the message goes as it is."""

    def __init__(self, ctx: zmq.Context, cfg: UnitConfig) -> None:
        self.socks = [
            zmq_socket(ctx, zmq.PUSH, cfg.outputs_address(i)) for i in range(cfg.api_servers)
        ]
        for sock in self.socks[1:]:
            sock.setsockopt(zmq.SNDHWM, HELPER_QUEUE)
        self.encode = msgspec.msgpack.Encoder().encode
        self.dropped = [0] * len(self.socks)

    def send_to(self, index: int, msg: WorkerOutput) -> None:
        """msg to API server `index` alone. API server 0 is the launcher: while it lives the worker
        waits for it to read. Another (a helper) may have died, its address unread until it starts
        again: a worker never waits for one (the whole unit would stall), it queues up to
        HELPER_QUEUE messages, then drops them, loudly (the dead helper's requests are stopped in
        the unit: AbortPrefix)."""
        if index == 0:
            self.socks[0].send(self.encode(msg))
            return
        try:
            self.socks[index].send(self.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            self.dropped[index] += 1
            if self.dropped[index] % HELPER_QUEUE == 1:
                log.error(
                    "API server %d has not read %d messages (it died, or is stuck): %d dropped "
                    "since",
                    index,
                    HELPER_QUEUE,
                    self.dropped[index],
                )

    def send(self, msg: WorkerOutput) -> None:
        if len(self.socks) == 1:
            self.socks[0].send(self.encode(msg))
            return
        outputs: list[list] = [[] for _ in self.socks]
        started: list[list] = [[] for _ in self.socks]
        for out in msg.outputs:
            outputs[api_server_of(out.request_id)].append(out)
        for request_id in msg.started:
            started[api_server_of(request_id)].append(request_id)
        to_all = (
            msg.stats is not None
            or msg.ready is not None
            or msg.fatal is not None
            or msg.prefill_stats is not None
            or msg.held is not None
        )
        for index, (mine, began) in enumerate(zip(outputs, started)):
            if mine or began or to_all:
                self.send_to(index, msgspec.structs.replace(msg, outputs=mine, started=began))


def requests_socket(ctx: zmq.Context, cfg: UnitConfig) -> zmq.Socket:
    """The decode worker's one socket for the requests of every API server (PULL takes from each in
    turn)."""
    sock = zmq_socket(ctx, zmq.PULL, cfg.requests_address(0))
    for i in range(1, cfg.api_servers):
        sock.connect(cfg.requests_address(i))
    return sock


def recv_nowait(sock: zmq.Socket) -> bytes | None:
    """The next message waiting on sock, or None if there is none."""
    try:
        return sock.recv(zmq.NOBLOCK)
    except zmq.Again:
        return None


def run_or_report(unit: int, out: ApiServers, main: Callable[[], None]) -> None:
    """Run a worker; if it cannot start for a reason the operator must fix (the model does not fit,
    a bad folder), tell the API server, which stops with that message, and exit instead of being
    restarted forever."""
    try:
        main()
    except (StartupError, ModelError) as exc:
        out.send(WorkerOutput(unit, fatal=str(exc)))
        time.sleep(0.5)  # let the message leave before the process (and its socket) goes
        sys.exit(3)


def ema(old: float, new: float) -> float:
    """A moving average that starts at its first value."""
    return new if old == 0.0 else old + EMA_WEIGHT * (new - old)
