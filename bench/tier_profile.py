"""`ppd profile tier`: how fast this machine copies KV blocks between the pool and the second tier
(--kv-offloading-size), for one model's block: the rate the ppd policy counts a tier-cached
prefix's load at until a unit has measured its own copies.

It builds a pool of the model's block shape on the device (zeros: the bytes' values do not change a
copy's speed) and a TierStore as `ppd serve` makes one (a file-backed mapping on the CPU, pinned
host memory on a GPU), then times stores and loads of --blocks blocks, each --repeats times, one
indexed copy per direction as the decode worker runs them. Output:
$PPD_CACHE_DIR/profiles/<device>__<model>__tier.json, with the medians:

  {"schema": "ppd-tier-profile", "version": 1, "device": ..., "model": ..., "dtype": ...,
   "block_size": 16, "block_bytes": ..., "blocks": ..., "store_tokens_per_s": ...,
   "load_tokens_per_s": ..., "store_gib_per_s": ..., "load_gib_per_s": ...}
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from pathlib import Path
from typing import Any

from profiles import TIER_PROFILE_SCHEMA, tier_profile_path, write_json

log = logging.getLogger("ppd.profile.tier")

VERSION = 1


def measure(
    pool_shape: tuple[int, ...], dtype: Any, device: str, blocks: int, repeats: int, folder=None
) -> dict[str, float]:
    """Median store and load rates of `blocks` blocks of a pool of pool_shape (with num_blocks
    2 * blocks) on device; tokens/s and GiB/s."""
    import torch

    from engine.kv_tier import KVCopy, TierStore

    layers, two, _, block_size, heads, dim = pool_shape
    shape = (layers, two, 2 * blocks, block_size, heads, dim)
    pool = torch.zeros(shape, dtype=dtype, device=device)
    store = TierStore(pool, blocks, folder)
    stores = [KVCopy(True, b, b) for b in range(blocks)]
    loads = [KVCopy(False, blocks + b, b) for b in range(blocks)]

    def timed(copies: list[KVCopy]) -> float:
        started = time.perf_counter()
        done = store.run(copies)
        if done is not None:
            done.synchronize()
        return time.perf_counter() - started

    timed(stores), timed(loads)  # warm: pages mapped, pinned memory touched
    store_s = statistics.median(timed(stores) for _ in range(repeats))
    load_s = statistics.median(timed(loads) for _ in range(repeats))
    tokens, nbytes = blocks * block_size, blocks * store.block_nbytes
    return {
        "store_tokens_per_s": tokens / store_s,
        "load_tokens_per_s": tokens / load_s,
        "store_gib_per_s": nbytes / store_s / 2**30,
        "load_gib_per_s": nbytes / load_s / 2**30,
    }


def add_tier_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="demo",
        help="the model, as `ppd serve --model` takes it (a folder, demo, smollm2, a .gguf)",
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="auto", help="the KV cache's dtype, as `ppd serve --dtype`")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--blocks", type=int, default=256, help="blocks per timed copy")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="64 blocks, 3 repeats")
    p.add_argument(
        "--kv-offloading-dir", default=None, help="the CPU tier's folder, as for `ppd serve`"
    )
    p.add_argument(
        "--out", default=None, help="the profile's folder (default: $PPD_CACHE_DIR/profiles)"
    )


def main(args: argparse.Namespace) -> Path:
    """`ppd profile tier`: measure and write the tier profile; returns its path."""
    import torch

    from engine.config import ModelConfig, resolve_dtype
    from engine.model import kv_pool_shape
    from profiles import cpu_device_name, model_name
    from server.plan import model_path

    if args.quick:
        args.blocks, args.repeats = 64, 3
    if args.blocks < 1 or args.repeats < 1:
        raise SystemExit("ppd profile tier: --blocks and --repeats must be at least 1")
    folder = model_path(args.model)
    cfg = ModelConfig.from_folder(folder)
    dtype = resolve_dtype(args.dtype, cfg, args.device)
    shape = kv_pool_shape(cfg, 2 * args.blocks, args.block_size)
    rates = measure(shape, dtype, args.device, args.blocks, args.repeats, args.kv_offloading_dir)
    device = cpu_device_name() if args.device == "cpu" else torch.cuda.get_device_properties(0).name
    model = model_name(folder)
    block_bytes = shape[0] * shape[1] * args.block_size * shape[4] * shape[5] * dtype.itemsize
    data = {
        "schema": TIER_PROFILE_SCHEMA,
        "version": VERSION,
        "device": device,
        "model": model,
        "dtype": str(dtype).removeprefix("torch."),
        "block_size": args.block_size,
        "block_bytes": block_bytes,
        "blocks": args.blocks,
        "repeats": args.repeats,
        **{k: round(v, 3) for k, v in rates.items()},
    }
    path = write_json(tier_profile_path(device, model, Path(args.out) if args.out else None), data)
    print(
        f"tier copies of {model}'s {block_bytes}-byte blocks on {device}: load "
        f"{rates['load_tokens_per_s']:.0f} tokens/s ({rates['load_gib_per_s']:.2f} GiB/s), store "
        f"{rates['store_tokens_per_s']:.0f} tokens/s -> {path}"
    )
    return path
