"""Green contexts: SM partitions of one GPU inside one process, made through the driver API
(cuda-bindings).

A green context covers a group of SMs; work enqueued on a stream of that context runs only on those
SMs. Two groups are disjoint only when they come from one split call, so each split here is its own
call: decode's group of n SMs and the rest of the device for prefill. Hopper splits in multiples of
8 SMs and rounds silently, so the granted counts are read back (cuGreenCtxGetDevResource), logged,
and a count the driver did not grant is refused. torch's own GreenContext.create(n) (2.10, 2.11)
splits the whole device on every call, so two of them may share SMs: it makes no split, and nothing
here uses it.

StreamSplits is what a one-process unit (`--partition green`, the prefill worker a thread of the
decode worker's process) runs on: for each pre-built split i, a decode stream on n_i SMs and a
prefill stream on the rest; and under the key WHOLE two ordinary streams, where both workers may use
every SM (a side alone, or no green contexts at all). The share manager picks a key per step; the
decode worker replays CUDA graphs captured on that key's decode stream (a graph keeps the partition
of the stream it was captured on), and the prefill thread switches stream between two forward
passes. Nothing is created at run time.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from partition.driver import cuda_driver, driver_call

log = logging.getLogger("ppd.partition")

WHOLE = -1  # the key of the ordinary streams: no partition, both workers may use every SM
SM_GRANULARITY = 8  # Hopper's green contexts split SMs in multiples of 8 (sm_80/86/89 split in 2s)


class GreenError(RuntimeError):
    """Green contexts cannot be made here; the message says why."""


def default_decode_sms(total: int, granularity: int = SM_GRANULARITY) -> tuple[int, ...]:
    """Decode's SM counts when none are given: a quarter, a half and three quarters of the device,
    each rounded down to the granularity (32, 64 and 96 of an H100's 132)."""
    counts = {max(granularity, total * k // 4 // granularity * granularity) for k in (1, 2, 3)}
    return tuple(sorted(c for c in counts if c < total))


def check_decode_sms(counts: Sequence[int], total: int | None = None) -> tuple[int, ...]:
    """counts as an ascending tuple, or ValueError naming what is wrong with them."""
    if not counts:
        raise ValueError("no SM counts: give one or more, e.g. 32,64,96")
    if any(c <= 0 for c in counts):
        raise ValueError(f"SM counts must be positive, got {list(counts)}")
    if total is not None and max(counts) >= total:
        raise ValueError(
            f"decode's SM counts must leave prefill some of the device's {total} SMs, got "
            f"{max(counts)}"
        )
    return tuple(sorted(set(counts)))


class GreenStreams:
    """Green contexts and their streams on one device, remembered so that destroy() frees every
    one."""

    def __init__(self, drv: Any, device: int) -> None:
        self.drv, self.device = drv, device
        driver_call(drv, "cuInit", 0)
        self.dev = driver_call(drv, "cuDeviceGet", device)
        self.sm_type = drv.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM
        self.contexts: list[Any] = []
        self.streams: list[Any] = []
        self.torch_streams: list[Any] = []

    def whole_device(self) -> Any:
        return driver_call(self.drv, "cuDeviceGetDevResource", self.dev, self.sm_type)

    def split(self, resource: Any, sms: int) -> tuple[Any, Any]:
        """(one group of at least sms SMs, the rest): disjoint, as they come from one split call."""
        groups, count, rest = driver_call(
            self.drv, "cuDevSmResourceSplitByCount", 1, resource, 0, sms
        )
        if count < 1 or not groups:
            raise RuntimeError(f"cuDevSmResourceSplitByCount made no group of {sms} SMs")
        return groups[0], rest

    def create(self, resource: Any) -> tuple[Any, int]:
        """(a torch stream on a new green context over resource, the SM count the context was
        granted)."""
        import torch

        drv = self.drv
        desc = driver_call(drv, "cuDevResourceGenerateDesc", [resource], 1)
        flags = (
            drv.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM
        )  # cuGreenCtxCreate requires this flag
        context = driver_call(drv, "cuGreenCtxCreate", desc, self.dev, flags)
        self.contexts.append(context)
        stream = driver_call(
            drv, "cuGreenCtxStreamCreate", context, drv.CUstream_flags.CU_STREAM_NON_BLOCKING, 0
        )
        self.streams.append(stream)
        granted = driver_call(drv, "cuGreenCtxGetDevResource", context, self.sm_type).sm.smCount
        torch_stream = torch.cuda.ExternalStream(int(stream), device=self.device)
        self.torch_streams.append(torch_stream)
        return torch_stream, int(granted)

    def destroy(self) -> list[str]:
        """Wait for the streams, free torch's cached blocks, destroy streams then contexts; the
        errors, if any."""
        import torch

        from partition.child import error_text

        errors = []
        gc.collect()  # graphs captured on these streams must be gone before their contexts are
        for step in [s.synchronize for s in self.torch_streams] + [
            torch.cuda.synchronize,
            torch.cuda.empty_cache,
        ]:
            try:
                step()
            except Exception as exc:
                errors.append(error_text(exc))
        for name, handles in (
            ("cuStreamDestroy", self.streams),
            ("cuGreenCtxDestroy", self.contexts),
        ):
            for handle in handles:
                try:
                    driver_call(self.drv, name, handle)
                except Exception as exc:
                    errors.append(error_text(exc))
        self.torch_streams, self.streams, self.contexts = [], [], []
        return errors


@dataclass(frozen=True)
class StreamPair:
    """One key's streams and the SMs each may use."""

    decode: Any  # a torch stream
    prefill: Any
    decode_sms: int
    prefill_sms: int


class StreamSplits:
    """The streams of a one-process unit: WHOLE (two ordinary streams) and one green pair per decode
    SM count."""

    def __init__(
        self,
        total_sms: int,
        whole: StreamPair,
        splits: dict[int, StreamPair],
        greens: GreenStreams | None = None,
    ) -> None:
        self.total_sms, self.pairs, self.greens = total_sms, {WHOLE: whole, **splits}, greens

    @classmethod
    def plain(cls, device: int = 0) -> StreamSplits:
        """Only WHOLE: both workers on ordinary streams of the whole device (overlapping, with no SM
        split)."""
        import torch

        total = torch.cuda.get_device_properties(device).multi_processor_count
        return cls(
            total,
            StreamPair(torch.cuda.Stream(device), torch.cuda.Stream(device), total, total),
            {},
        )

    @classmethod
    def green(cls, decode_sms: Sequence[int], device: int = 0) -> StreamSplits:
        """WHOLE, and for each count n one split call: decode on n SMs, prefill on the rest. Raises
        GreenError when cuda-bindings or the driver cannot make them, or the driver grants other
        counts than asked."""
        plain = cls.plain(device)
        try:
            drv = cuda_driver()
        except ImportError as exc:
            raise GreenError(
                "green contexts are made with cuda-python's driver API, which is not installed "
                f"({exc}): "
                "pip install cuda-python"
            ) from exc
        greens = GreenStreams(drv, device)
        try:
            whole = greens.whole_device()
            total = int(whole.sm.smCount)
            splits = {}
            for key, n in enumerate(check_decode_sms(decode_sms, total)):
                group, rest = greens.split(whole, n)
                (decode, got), (prefill, rest_sms) = greens.create(group), greens.create(rest)
                if got != n:
                    raise GreenError(
                        f"asked for {n} SMs for decode, the driver granted {got}: give counts in "
                        f"multiples of {SM_GRANULARITY} (Hopper's granularity)"
                    )
                splits[key] = StreamPair(decode, prefill, got, rest_sms)
        except GreenError:
            greens.destroy()
            raise
        except (
            RuntimeError,
            AttributeError,
            ValueError,
        ) as exc:  # the driver refused, or bindings too old
            greens.destroy()
            raise GreenError(f"cannot make green contexts: {exc}") from exc
        made = cls(total, plain.pairs[WHOLE], splits, greens)
        log.info("green contexts: %s", made.describe())
        return made

    @property
    def keys(self) -> list[int]:
        return list(self.pairs)

    def stream(self, role: str, key: int) -> Any:
        pair = self.pairs[key]
        return pair.decode if role == "decode" else pair.prefill

    def sms(self, role: str, key: int) -> int:
        pair = self.pairs[key]
        return pair.decode_sms if role == "decode" else pair.prefill_sms

    def graph_targets(self, role: str) -> tuple[dict[int, Any], dict[int, int]]:
        """role's stream and SM count under every key: where an engine captures a graph set for each
        split."""
        return {k: self.stream(role, k) for k in self.keys}, {
            k: self.sms(role, k) for k in self.keys
        }

    def decode_counts(self) -> tuple[int, ...]:
        """Decode's SM count of each split, ascending (the share manager's choices besides
        WHOLE)."""
        return tuple(self.pairs[k].decode_sms for k in self.keys if k != WHOLE)

    def middle_decode_sms(self) -> int:
        """Decode's SMs in the middle split (64 of 132 by default): the even split when both workers
        are busy."""
        counts = self.decode_counts()
        return counts[len(counts) // 2]

    def key_for(self, decode_sms: int | None) -> int:
        """The key of the split that gives decode decode_sms SMs; WHOLE for None (both on the whole
        device)."""
        if decode_sms is None:
            return WHOLE
        for key, pair in self.pairs.items():
            if key != WHOLE and pair.decode_sms == decode_sms:
                return key
        raise KeyError(f"no split gives decode {decode_sms} SMs (there are {self.decode_counts()})")

    def describe(self) -> str:
        splits = ", ".join(
            f"{p.decode_sms}/{p.prefill_sms}" for k, p in self.pairs.items() if k != WHOLE
        )
        return (
            f"{self.total_sms} SMs; SMs granted to decode/prefill in each split {splits}"
            if splits
            else f"{self.total_sms} SMs, both workers on ordinary streams (no split)"
        )

    def destroy(self) -> list[str]:
        return self.greens.destroy() if self.greens is not None else []


def graph_targets(
    streams: StreamSplits | None, role: str
) -> tuple[dict[int, Any] | None, dict[int, int] | None]:
    """StreamSplits.graph_targets, or (None, None) without splits (one graph set on an ordinary
    stream)."""
    return streams.graph_targets(role) if streams is not None else (None, None)


def on_stream(streams: StreamSplits | None, role: str, key: int) -> Any:
    """The context a worker's step runs in: role's stream of split key, in a one-process unit on a
    GPU (else none)."""
    if streams is None:
        return contextlib.nullcontext()
    import torch

    return torch.cuda.stream(streams.stream(role, key))
