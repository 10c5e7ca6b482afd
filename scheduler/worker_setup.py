"""Process plumbing both workers share: lifetime, cores, sockets, and the model over shared memory."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

import torch
import zmq

from engine.config import ModelConfig, resolve_dtype
from engine.loader import arena_nbytes, bind_arena, build_model, load_weights
from engine.model import Model, kv_pool_shape
from engine.shared_tensor import SharedTensorHandle, create_shared, open_shared
from partition.cpu import pin_to_cores
from scheduler.config import UnitConfig

PR_SET_PDEATHSIG = 1


def init_worker_process(cores: tuple[int, ...]) -> None:
    """Die with the launcher (no orphans even if it is killed), leave Ctrl-C to it, and take our cores."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:  # the launcher died before prctl took effect
            os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pin_to_cores(cores)
    torch.set_grad_enabled(False)


def socket(ctx: zmq.Context, kind: int, address: str, bind: bool = False) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


def recv_nowait(sock: zmq.Socket) -> bytes | None:
    """The next message waiting on sock, or None if there is none."""
    try:
        return sock.recv(zmq.NOBLOCK)
    except zmq.Again:
        return None


def create_unit_memory(cfg: UnitConfig) -> tuple[Model, ModelConfig, torch.Tensor, SharedTensorHandle, SharedTensorHandle]:
    """Decode worker: load the weights into a shared arena and allocate the shared KV pool.
    Returns (model, model config, kv pool, weights handle, kv handle)."""
    mcfg = ModelConfig.from_folder(cfg.model)
    dtype = resolve_dtype(cfg.dtype, mcfg)
    model = build_model(mcfg, dtype)
    arena, weights = create_shared(cfg.shm_name("weights"), (arena_nbytes(model),), torch.uint8)
    bind_arena(model, arena)
    load_weights(model, cfg.model, cfg.load_format)
    assert cfg.num_kv_blocks * cfg.block_size >= cfg.max_model_len, "the launcher sizes the pool to hold max_model_len"
    kv_pool, kv = create_shared(cfg.shm_name("kv"), kv_pool_shape(mcfg, cfg.num_kv_blocks, cfg.block_size), dtype)
    return model, mcfg, kv_pool, weights, kv


def map_unit_memory(cfg: UnitConfig, weights: SharedTensorHandle, kv: SharedTensorHandle) -> tuple[Model, ModelConfig, torch.Tensor]:
    """Prefill worker: bind a model to the decode worker's weight arena and map its KV pool; nothing is copied or loaded."""
    mcfg = ModelConfig.from_folder(cfg.model)
    model = build_model(mcfg, resolve_dtype(cfg.dtype, mcfg))
    bind_arena(model, open_shared(weights))
    return model, mcfg, open_shared(kv)
