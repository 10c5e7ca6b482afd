"""CUDA IPC of one big tensor between two processes, round trip verified, through the project's own
path (engine/shared_memory.py: create_shared, a msgspec CudaIpcHandle sent as msgpack bytes,
open_shared).

ipc_round_trip runs in a probe child (the exporter): it creates the tensor, fills pattern A and
starts an importer, which maps the tensor from the handle, checks pattern A on the device, writes
pattern B, synchronises and signals; the exporter then checks pattern B while the importer still
holds the mapping. The importer's allocator and free-memory deltas around open_shared show a mapping
(about 0) rather than a copy (the size).
"""

from __future__ import annotations

import os
import time
from typing import Any

from partition.child import SPAWN, Finding, finish_child, start_child
from partition.driver import mps_enabled, nvml_processes

SEED_A = 0x2545F491
SEED_B = 0x5BD1E995
CHUNK_WORDS = (
    1 << 24
)  # int32 words per pattern chunk (64 MiB): bounds the temporaries on both sides


def pattern(start: int, count: int, seed: int, device: Any) -> Any:
    """Words start..start+count of a pseudo-random int32 pattern (a multiplicative hash of the word
    index)."""
    import torch

    index = torch.arange(start, start + count, device=device, dtype=torch.int64)
    return (((index * 2654435761 + seed) >> 7) & 0x7FFFFFFF).to(torch.int32)


def fill(words: Any, seed: int) -> None:
    for start in range(0, words.numel(), CHUNK_WORDS):
        count = min(CHUNK_WORDS, words.numel() - start)
        words[start : start + count].copy_(pattern(start, count, seed, words.device))


def matches(words: Any, seed: int) -> bool:
    """Whether words hold exactly the pattern of seed (compared on the device, chunk by chunk)."""
    import torch

    for start in range(0, words.numel(), CHUNK_WORDS):
        count = min(CHUNK_WORDS, words.numel() - start)
        if not torch.equal(words[start : start + count], pattern(start, count, seed, words.device)):
            return False
    return True


def ipc_round_trip(device: int, nbytes: int, nvml_index: int | None, timeout: float) -> Finding:
    """The exporter side (runs in a child). nbytes must be a multiple of 4."""
    import msgspec
    import torch

    from engine.shared_memory import create_shared

    torch.cuda.set_device(device)
    start = time.perf_counter()
    tensor, handle = create_shared("ppd-probe-ipc", (nbytes,), torch.uint8, f"cuda:{device}")
    encoded = msgspec.msgpack.encode(handle)
    export_s = time.perf_counter() - start
    words = tensor.view(torch.int32)
    fill(words, SEED_A)
    torch.cuda.synchronize()

    written, release = SPAWN.Event(), SPAWN.Event()
    importer = start_child(
        import_and_rewrite, (encoded, device, written, release, timeout), name="ipc-importer"
    )
    try:
        signalled = written.wait(timeout)
        start = time.perf_counter()
        verified_b = signalled and matches(words, SEED_B)
        verify_b_s = time.perf_counter() - start
        # Read while the importer still holds its context and the mapping.
        importer_nvml = nvml_processes(nvml_index)
    finally:
        release.set()
        side = finish_child(importer, timeout)
    mapped = _mapped_not_copied(side, nbytes)
    ok = bool(side.get("ok") and side.get("verified_a") and verified_b)
    return {
        "ok": ok,
        "error": None if ok else _ipc_error(side, signalled),
        "bytes": nbytes,
        "mps_enabled": mps_enabled(device),
        "export_s": export_s,
        "open_s": side.get("open_s"),
        "verify_a_s": side.get("verify_a_s"),
        "write_b_s": side.get("write_b_s"),
        "verify_b_s": verify_b_s,
        "verified_a": side.get("verified_a"),
        "verified_b": verified_b,
        "importer_allocated_delta_bytes": side.get("allocated_delta_bytes"),
        "importer_free_delta_bytes": side.get("free_delta_bytes"),
        "importer_nvml_used_bytes": _used_by(importer_nvml, importer.process.pid),
        "mapped_not_copied": mapped,
        "importer": side,
    }


def import_and_rewrite(
    encoded: bytes, device: int, written: Any, release: Any, timeout: float
) -> Finding:
    """The importer side (runs in the exporter's child). Always signals written, so the exporter
    never waits in vain."""
    try:
        return _import_and_rewrite(encoded, device, written, release, timeout)
    finally:
        written.set()


def _import_and_rewrite(
    encoded: bytes, device: int, written: Any, release: Any, timeout: float
) -> Finding:
    import msgspec
    import torch

    from engine.shared_memory import CudaIpcHandle, open_shared

    torch.cuda.set_device(device)
    free_before, _ = torch.cuda.mem_get_info(
        device
    )  # creates the context first, so the deltas are the mapping alone
    allocated_before = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    tensor = open_shared(msgspec.msgpack.decode(encoded, type=CudaIpcHandle))
    torch.cuda.synchronize()
    open_s = time.perf_counter() - start
    allocated_delta = torch.cuda.memory_allocated(device) - allocated_before
    free_after, _ = torch.cuda.mem_get_info(device)
    words = tensor.view(torch.int32)

    start = time.perf_counter()
    verified_a = matches(words, SEED_A)
    verify_a_s = time.perf_counter() - start
    start = time.perf_counter()
    fill(words, SEED_B)
    torch.cuda.synchronize()  # the writes are on the device before the exporter is told
    write_b_s = time.perf_counter() - start
    written.set()
    released = release.wait(timeout)
    del words, tensor
    return {
        "pid": os.getpid(),
        "open_s": open_s,
        "verify_a_s": verify_a_s,
        "write_b_s": write_b_s,
        "verified_a": verified_a,
        "allocated_delta_bytes": allocated_delta,
        "free_delta_bytes": free_before - free_after,
        "released_in_time": released,
    }


def _ipc_error(side: Finding, signalled: bool) -> str:
    if side.get("error"):
        return f"importer: {side['error']}"
    if not signalled:
        return "the importer did not signal in time"
    if not side.get("verified_a"):
        return "the importer did not see pattern A"
    return "the exporter did not see the importer's pattern B"


def _mapped_not_copied(side: Finding, nbytes: int) -> bool | None:
    """True when neither the importer's allocator nor the device's free memory grew by anything near
    the size."""
    deltas = [side.get("allocated_delta_bytes"), side.get("free_delta_bytes")]
    if any(d is None for d in deltas):
        return None
    return all(d < nbytes // 2 for d in deltas)


def _used_by(processes: list[dict[str, Any]] | str, pid: int | None) -> int | str | None:
    if isinstance(processes, str):
        return processes
    return next((p["used_bytes"] for p in processes if p["pid"] == pid), None)
