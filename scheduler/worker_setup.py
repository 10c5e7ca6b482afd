"""Process plumbing both workers share: lifetime, cores, sockets, and the model over shared memory."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

import msgspec
import torch
import zmq

from engine.config import ModelConfig, resolve_dtype
from engine.loader import arena_nbytes, bind_arena, build_model, load_weights
from engine.model import Model, kv_block_nbytes, kv_pool_shape
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


def create_unit_memory(cfg: UnitConfig) -> tuple[Model, ModelConfig, torch.Tensor, SharedTensorHandle, SharedTensorHandle, int]:
    """Decode worker: load the weights into a shared arena and allocate the shared KV pool.
    Returns (model, model config, kv pool, weights handle, kv handle, number of blocks)."""
    mcfg = ModelConfig.from_folder(cfg.model)
    dtype = resolve_dtype(cfg.dtype, mcfg)
    model = build_model(mcfg, dtype)
    arena, weights = create_shared(f"{cfg.shm_prefix}-u{cfg.unit}-weights", (arena_nbytes(model),), torch.uint8)
    bind_arena(model, arena)
    load_weights(model, cfg.model, cfg.load_format)
    num_blocks = cfg.num_kv_blocks or int(cfg.kv_cache_memory * 2**30) // kv_block_nbytes(mcfg, cfg.block_size, dtype)
    if num_blocks * cfg.block_size < cfg.max_model_len:
        raise ValueError(f"the KV pool holds {num_blocks * cfg.block_size} tokens, fewer than --max-model-len "
                         f"{cfg.max_model_len}; raise --kv-cache-memory or lower --max-model-len")
    kv_pool, kv = create_shared(f"{cfg.shm_prefix}-u{cfg.unit}-kv", kv_pool_shape(mcfg, num_blocks, cfg.block_size), dtype)
    return model, mcfg, kv_pool, weights, kv, num_blocks


def map_unit_memory(cfg: UnitConfig, weights: SharedTensorHandle, kv: SharedTensorHandle) -> tuple[Model, ModelConfig, torch.Tensor]:
    """Prefill worker: bind a model to the decode worker's weight arena and map its KV pool; nothing is copied or loaded."""
    mcfg = ModelConfig.from_folder(cfg.model)
    model = build_model(mcfg, resolve_dtype(cfg.dtype, mcfg))
    bind_arena(model, open_shared(weights))
    return model, mcfg, open_shared(kv)


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()
