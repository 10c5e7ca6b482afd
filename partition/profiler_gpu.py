"""`ppd profile partition` on a GPU: each share a green-context stream of one process, and decode
timed through the CUDA graphs the decode worker would replay there.

Share s is a green context of s SMs (the whole device: an ordinary stream). Its decode steps replay
a graph set captured on its stream with split-KV counts sized for its s SMs, as a green unit's
decode worker captures one set per split: timed eagerly, a step would measure the host's launch
time, not what the share's SMs buy. An interference pair is the two groups of one split, decode (its
own graph set) and prefill enqueued from two threads; the prefill side runs on a sibling engine (its
own runner, eager), as the prefill thread of a green unit does. Where torch has cuBLAS's SM target
(`torch._C._set_sm_carveout_experimental`), a prefill-sized GEMM is also timed on each share with
and without the SMs outside the share carved out, for the profile's meta: a GPU run tells whether
telling cuBLAS the share's size helps (before CUDA 13.3 its heuristics pick configurations for the
whole device inside a green context).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from engine.engine import Engine, EngineConfig
from engine.step_timing import fill_random_kv, median_ms, release_engine, sync_device
from partition.green import SM_GRANULARITY, GreenStreams
from partition.profiler import ProfilerError
from partition.share_timer import Timer


def sm_carveout_available() -> bool:
    """Whether this torch can tell cuBLAS(Lt) to leave SMs free (an experimental knob, present since
    torch 2.6)."""
    return hasattr(torch._C, "_set_sm_carveout_experimental")


class GpuBench:
    """Measures on SM shares of one GPU (see the module docstring); `profile` asks it for each
    point."""

    unit = "sms"

    def __init__(self, cfg: EngineConfig, decode_blocks: int) -> None:
        from partition.driver import cuda_driver

        try:
            driver = cuda_driver()
        except ImportError as exc:
            raise ProfilerError(
                f"SM shares are green contexts made with cuda-python's driver API ({exc}); "
                "pip install cuda-python"
            ) from exc
        self.engine = Engine.create(
            cfg, (f"ppd-partition-{os.getpid()}-weights", f"ppd-partition-{os.getpid()}-kv")
        )
        fill_random_kv(self.engine)
        self.sibling = Engine.sibling(self.engine)
        self.decode_graphs = self.engine.runner.backend.supports_cuda_graphs
        self.decode_blocks = decode_blocks
        self.greens = GreenStreams(driver, self.engine.device.index or 0)
        self.whole = self.greens.whole_device()
        self.total = int(self.whole.sm.smCount)
        self.timers: dict[int, Timer] = {}
        self.pairs: dict[int, tuple[Timer, Timer]] = {}

    def decode(self, share: int, batch: int, context: int, steps: int) -> list[float]:
        with self._point():
            return self._timer(share).decode(batch, context, steps)

    def prefill(self, share: int, prompt: int, total: int, repeat: int) -> float:
        with self._point():
            return self._timer(share).prefill(prompt, total, repeat)

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
        with self._point():
            return self._interference(
                decode_share, prefill_share, batch, context, kind, concurrent, new_tokens, steps
            )

    def gemm(self, share: int, tokens: int, repeat: int) -> dict:
        """A prefill's MLP GEMM (tokens x hidden by hidden x intermediate) on share's stream: its
        time (ms), and its time with cuBLAS's SM carveout set to the SMs outside the share (the
        same call where the share is the whole device). Serving does not set the carveout: only a
        profile showing that it helps may make it do so."""
        mcfg, device = self.engine.mcfg, self.engine.device
        dtype = self.engine.runner.kv_pool.dtype
        x = torch.randn(tokens, mcfg.hidden_size, dtype=dtype, device=device)
        w = torch.randn(mcfg.intermediate_size, mcfg.hidden_size, dtype=dtype, device=device)
        sync_device(device)  # filled on this stream, read on the share's
        carveout = self.total - share
        with self._point(), self._timer(share).on_stream():
            ms = median_ms(lambda: F.linear(x, w), device, repeat)
            carved = ms
            if carveout > 0:
                torch._C._set_sm_carveout_experimental(carveout)
                try:
                    carved = median_ms(lambda: F.linear(x, w), device, repeat)
                finally:
                    torch._C._set_sm_carveout_experimental(None)
        return {"ms": ms, "carveout": carveout, "carveout_ms": carved}

    def _interference(
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
        decode, prefill = self._pair(decode_share, prefill_share)
        if concurrent == 0:
            return decode.decode(batch, context, steps)
        # unverified on a GPU: that the GIL leaves both streams fed. A prefill that raises prints
        # its traceback and breaks the barrier, so decode raises too.
        start, stop = threading.Barrier(2), threading.Event()
        thread = threading.Thread(
            target=prefill.prefill_until,
            daemon=True,
            args=(kind, concurrent, new_tokens, context, start, stop),
        )
        thread.start()
        try:
            return decode.decode(batch, context, steps, start, stop)
        finally:
            thread.join()  # decode set stop, or broke the barrier, however it ended

    def close(self) -> None:
        release_engine(self.engine)
        # The graphs captured on green streams must be gone before their contexts are (destroy
        # collects them).
        self.timers, self.pairs, self.engine, self.sibling = {}, {}, None, None
        errors = self.greens.destroy()
        if errors:
            print(f"cleaning up the green contexts: {'; '.join(errors)}", file=sys.stderr)

    @contextlib.contextmanager
    def _point(self) -> Iterator[None]:
        try:
            yield
        finally:
            # The allocator caches activations per stream: with one stream per share, what each kept
            # would pile up beside the KV pool (about 53 GB for the default grid).
            torch.cuda.empty_cache()

    def _timer(self, share: int) -> Timer:
        if share not in self.timers:
            if share >= self.total:
                stream, sms = torch.cuda.Stream(self.engine.device), None
            else:
                group, _ = self.greens.split(self.whole, share)
                stream, sms = self._create(group, share), share
            self.timers[share] = Timer(
                self.engine,
                self.decode_blocks,
                stream,
                self._capture(("share", share), stream, sms),
            )
        return self.timers[share]

    def _pair(self, decode_share: int, prefill_share: int) -> tuple[Timer, Timer]:
        if decode_share not in self.pairs:
            group, rest = self.greens.split(self.whole, decode_share)
            # unverified on a GPU: that the rest of a split holds exactly total - share SMs (68 of
            # 132 for 64).
            decode, prefill = self._create(group, decode_share), self._create(rest, prefill_share)
            self.pairs[decode_share] = (
                Timer(
                    self.engine,
                    self.decode_blocks,
                    decode,
                    self._capture(("pair", decode_share), decode, decode_share),
                ),
                Timer(self.sibling, self.decode_blocks, prefill),
            )
        return self.pairs[decode_share]

    def _capture(self, key: Any, stream: Any, sms: int | None) -> Any:
        """Capture a decode graph set on stream, sized for sms SMs (None: the whole device); the key
        that replays it, None where the attention backend cannot be captured (the steps then run
        eagerly). Every set stays, in one memory pool, until the bench closes."""
        if not self.decode_graphs:
            return None
        # Decode buckets only: the profile's prefills batch prompts up to prefill_tokens, beyond any
        # token bucket.
        self.engine.runner.capture_graphs(
            self.engine.cfg.max_num_seqs,
            {key: stream},
            sms=None if sms is None else {key: sms},
            max_tokens=0,
        )
        return key

    def _create(self, resource: Any, sms: int) -> Any:
        stream, granted = self.greens.create(resource)
        if granted != sms:
            raise ProfilerError(
                f"asked for {sms} SMs, the driver granted {granted}: give --shares in multiples "
                f"of {SM_GRANULARITY}"
            )
        return stream
