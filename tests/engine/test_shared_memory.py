"""A shared tensor is one copy of memory that a second process maps: writes on either side are seen
by the other."""

from __future__ import annotations

import multiprocessing as mp

import msgspec
import pytest
import torch

from engine.shared_memory import (
    CudaIpcHandle,
    SharedHandle,
    ShmHandle,
    create_shared,
    open_shared,
    release_name,
)

HANDLE = msgspec.msgpack.Decoder(SharedHandle)


def _child(raw: bytes, done: mp.Event) -> None:
    """Open the parent's tensor, check the pattern it wrote, answer with another (in place, no
    copy)."""
    t = open_shared(HANDLE.decode(raw))
    expected = torch.arange(t.numel(), device=t.device, dtype=torch.float32).view(t.shape)
    ok = bool(torch.equal(t.float(), expected))
    t.mul_(-1 if ok else 0)
    if t.is_cuda:
        torch.cuda.synchronize()
    done.set()


def round_trip(device: str, shape: tuple[int, ...]) -> torch.Tensor:
    tensor, handle = create_shared(f"ppd-test-{device}", shape, torch.float32, device)
    tensor.copy_(torch.arange(tensor.numel(), dtype=torch.float32).view(shape))
    ctx = mp.get_context("spawn")
    done = ctx.Event()
    child = ctx.Process(target=_child, args=(msgspec.msgpack.encode(handle), done))
    child.start()
    assert done.wait(120), "the child never finished"
    child.join(30)
    assert child.exitcode == 0
    release_name(handle)
    return tensor


def test_cpu_handle_round_trip_between_processes() -> None:
    shape = (3, 5, 7)
    tensor = round_trip("cpu", shape)
    # The child saw the parent's values and wrote their negation into the same memory.
    assert torch.equal(tensor, -torch.arange(105, dtype=torch.float32).view(shape))


def test_cpu_handle_is_a_file_until_released(tmp_path) -> None:
    tensor, handle = create_shared("ppd-test-release", (4,), torch.float32)
    assert isinstance(handle, ShmHandle)
    mapped = open_shared(handle)
    mapped.fill_(3.0)
    assert torch.equal(tensor, torch.full((4,), 3.0))
    release_name(handle)
    with pytest.raises(FileNotFoundError, match="is gone"):
        open_shared(handle)
    assert torch.equal(mapped, torch.full((4,), 3.0))  # the memory lives on while mapped


@pytest.mark.gpu
def test_cuda_ipc_round_trip_between_processes() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    shape = (1024, 1024)
    tensor = round_trip("cuda", shape)
    assert torch.equal(
        tensor, -torch.arange(shape[0] * shape[1], dtype=torch.float32, device="cuda").view(shape)
    )


@pytest.mark.gpu
def test_cuda_handle_survives_encoding() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _, handle = create_shared("unused", (16,), torch.bfloat16, "cuda")
    assert isinstance(handle, CudaIpcHandle)
    assert HANDLE.decode(msgspec.msgpack.encode(handle)) == handle


EXPANDABLE_CHILD = """
import os, sys
# torch first, as a spawned worker imports torch with its own module before init_worker_process runs
import torch
from engine.engine import EngineConfig
from engine.shared_memory import create_shared
from scheduler.config import UnitConfig
from scheduler.worker_setup import init_worker_process

init_worker_process(UnitConfig(EngineConfig(model="unused"), gpu=sys.argv[1]), "decode")
tensor, _ = create_shared("unused", (64 << 20,), torch.uint8, "cuda")
ptr = tensor.data_ptr()
segment = next(s for s in torch.cuda.memory._snapshot()["segments"]
               if s["address"] <= ptr < s["address"] + s["total_size"])
print("expandable", segment.get("is_expandable"))
"""


@pytest.mark.gpu
def test_a_worker_exports_from_an_ordinary_segment_even_when_started_with_expandable_segments() -> (
    None
):
    """The exporter must not use expandable segments (their IPC path has known bugs). A worker drops
    the option from its environment in init_worker_process, after torch is imported but before CUDA
    starts: this shows that torch reads the option only then, so the pool really is an ordinary
    cudaMalloc segment."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [sys.executable, "-c", EXPANDABLE_CHILD, gpu],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["expandable", "False"], done.stdout + done.stderr[-2000:]
