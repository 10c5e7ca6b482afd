"""`ppd profile partition` on the CPU: share s is the first s allowed cores, each measurement in a
child process pinned to its cores before it builds its engine (so torch's thread pool is the share's
size).

A decode share's child owns an engine; an interference pair adds a child on the prefill cores (the
next p cores, or the same ones when p is the whole CPU: time-sliced) that maps the owner's weights
and KV pool, as the server's prefill worker does. The two meet at a barrier to start together, and
the prefill runs until the decode's timing ends.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import traceback
from typing import Any

from engine.engine import Engine, EngineConfig
from engine.shared_memory import remove_leftover
from partition.cpu import available_cores, pin_to_cores
from partition.profiler import ProfilerError
from partition.share_timer import Timer


class CpuBench:
    """Share s is the first s allowed cores. Each decode share has a child process that owns an
    engine; an interference pair adds a child on the prefill cores that maps the owner's weights
    and KV pool."""

    unit = "cores"
    decode_graphs = False

    def __init__(self, cfg: EngineConfig, decode_blocks: int) -> None:
        self.cfg, self.decode_blocks = cfg, decode_blocks
        self.cores = available_cores()
        self.total = len(self.cores)
        self.ctx = mp.get_context("spawn")
        self.start, self.stop = self.ctx.Barrier(2), self.ctx.Event()
        self.owners: dict[int, _Child] = {}
        self.peers: dict[tuple[int, int], _Child] = {}

    def decode(self, share: int, batch: int, context: int, steps: int) -> list[float]:
        return self._owner(share).call("decode", batch=batch, context=context, steps=steps)

    def prefill(self, share: int, prompt: int, total: int, repeat: int) -> float:
        return self._owner(share).call("prefill", prompt=prompt, total=total, repeat=repeat)

    def interference(
        self,
        decode_share: int,
        prefill_share: int,
        batch: int,
        context: int,
        kind: str,
        concurrent: int,
        new_tokens: int,
        steps: int,
    ) -> list[float]:
        owner = self._owner(decode_share)
        if concurrent == 0:
            return owner.call("decode", batch=batch, context=context, steps=steps)
        peer = self._peer(decode_share, prefill_share)
        peer.send(
            "prefill_until",
            kind=kind,
            concurrent=concurrent,
            new_tokens=new_tokens,
            context=context,
            sync=True,
        )
        owner.send("decode", batch=batch, context=context, steps=steps, sync=True)
        results, errors = [], []
        for child in (
            peer,
            owner,
        ):  # both answer, whichever failed: a failure aborts the other's wait
            try:
                results.append(child.receive())
            except ProfilerError as exc:
                errors.append(str(exc))
        self.stop.clear()
        if errors:
            raise ProfilerError("\n".join(errors))
        return results[-1]

    def close(self) -> None:
        for child in [*self.peers.values(), *self.owners.values()]:
            child.close()
        for share in self.owners:
            for name in self._names(share):
                remove_leftover(name)

    def _owner(self, share: int) -> _Child:
        if share not in self.owners:
            self.owners[share] = _Child(self, self.cores[:share], self._names(share), None)
        return self.owners[share]

    def _peer(self, decode_share: int, prefill_share: int) -> _Child:
        if (decode_share, prefill_share) not in self.peers:
            first = 0 if prefill_share == self.total else decode_share
            if first + prefill_share > self.total:
                raise ProfilerError(
                    f"decode on {decode_share} and prefill on {prefill_share} of {self.total} "
                    "cores: the prefill share must fit beside decode, or be every core"
                )
            owner = self._owner(decode_share)
            self.peers[(decode_share, prefill_share)] = _Child(
                self, self.cores[first : first + prefill_share], None, owner.shared
            )
        return self.peers[(decode_share, prefill_share)]

    def _names(self, share: int) -> tuple[str, str]:
        return (
            f"ppd-partition-{os.getpid()}-{share}-weights",
            f"ppd-partition-{os.getpid()}-{share}-kv",
        )


class _Child:
    """One pinned child process running Timer methods on request."""

    def __init__(
        self, bench: CpuBench, cores: list[int], names: tuple[str, str] | None, attach: Any
    ) -> None:
        self.conn, theirs = bench.ctx.Pipe()
        self.process = bench.ctx.Process(
            target=_child_main,
            daemon=True,
            name=f"ppd-profile-{cores}",
            args=(
                tuple(cores),
                bench.cfg,
                bench.decode_blocks,
                names,
                attach,
                theirs,
                bench.start,
                bench.stop,
            ),
        )
        self.process.start()
        theirs.close()
        self.shared = (
            self.receive()
        )  # (weights handle, KV handle, KV blocks, max_model_len) once it is ready

    def send(self, method: str, **kwargs: Any) -> None:
        self.conn.send((method, kwargs))

    def receive(self) -> Any:
        try:
            ok, value = self.conn.recv()
        except EOFError:
            raise ProfilerError(
                f"the profiling child {self.process.name} died (exit code {self.process.exitcode})"
            ) from None
        if not ok:
            raise ProfilerError(f"the profiling child {self.process.name} failed:\n{value}")
        return value

    def call(self, method: str, **kwargs: Any) -> Any:
        self.send(method, **kwargs)
        return self.receive()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.process.join(timeout=5)
        if self.process.is_alive():  # busy in a step (Ctrl-C): its result is not wanted
            self.process.terminate()
            self.process.join()


def _child_main(
    cores: tuple[int, ...],
    cfg: EngineConfig,
    decode_blocks: int,
    names: tuple[str, str] | None,
    attach: Any,
    conn: Any,
    start: Any,
    stop: Any,
) -> None:
    signal.signal(
        signal.SIGINT, signal.SIG_IGN
    )  # Ctrl-C is the parent's to handle: it stops the children
    try:
        pin_to_cores(cores)  # before the engine exists, so torch's thread pool is the share's size
        if attach is None:
            engine = Engine.create(cfg, names)
        else:
            engine = Engine.attach(cfg, *attach)
        timer = Timer(engine, decode_blocks)
        conn.send(
            (
                True,
                (
                    engine.weights_handle,
                    engine.kv_handle,
                    engine.num_kv_blocks,
                    engine.max_model_len,
                ),
            )
        )
    except Exception:  # noqa: BLE001 - the parent reports it, with the traceback
        conn.send((False, traceback.format_exc()))
        return
    while (job := conn.recv()) is not None:
        method, kwargs = job
        if kwargs.pop("sync", False):
            kwargs.update(start=start, stop=stop)
        try:
            conn.send((True, getattr(timer, method)(**kwargs)))
        except Exception:  # noqa: BLE001 - likewise
            conn.send((False, traceback.format_exc()))
