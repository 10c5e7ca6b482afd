"""What one GPU of a tensor-parallel unit holds: the weights of its shard and the KV cache a token
takes, for each tensor-parallel size that splits the model, and how many tokens of KV the rest of
the GPU's share fits before the activations and CUDA graphs (which `ppd serve` measures at start and
logs: its plan is the exact one).

Usage: python bench/scripts/tp_memory.py [MODEL_FOLDER] [--gpu-memory-gib 79.1] [--utilization 0.9]
(default: bench/models/llama-3.1-70b; bfloat16; computed from the configuration alone, no GPU
needed)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from engine.config import ModelConfig, tensor_parallel_sizes
from engine.loader import arena_nbytes, build_model
from engine.model import kv_block_nbytes

GiB = 2**30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "model",
        nargs="?",
        default=str(Path(__file__).resolve().parents[1] / "models" / "llama-3.1-70b"),
    )
    p.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=79.1,
        help="one GPU's memory (an H100 80GB: 79.1 GiB)",
    )
    p.add_argument("--utilization", type=float, default=0.9, help="--gpu-memory-utilization")
    p.add_argument("--gpus", type=int, default=8, help="GPUs on the node")
    args = p.parse_args()
    cfg = ModelConfig.from_folder(args.model)
    share = args.gpu_memory_gib * args.utilization
    print(
        f"{Path(args.model).name}, bfloat16, {args.gpus} GPUs of {args.gpu_memory_gib:g} GiB at "
        f"--gpu-memory-utilization {args.utilization:g} ({share:.1f} GiB each)\n"
    )
    print(
        "| -tp | units | weights / GPU | KV / token / GPU | KV tokens / unit before activations |"
    )
    print("| ---: | ---: | ---: | ---: | ---: |")
    for n in tensor_parallel_sizes(cfg, args.gpus):
        if args.gpus % n:
            continue
        shard = cfg.sharded(n)
        weights = arena_nbytes(build_model(shard, torch.bfloat16))
        per_token = kv_block_nbytes(shard, 16, torch.bfloat16) // 16
        left = share * GiB - weights
        tokens = f"{int(left // per_token):,}" if left > 0 else "does not fit"
        print(
            f"| {n} | {args.gpus // n} | {weights / GiB:.1f} GiB | {per_token / 1024:.0f} KiB | "
            f"{tokens} |"
        )


if __name__ == "__main__":
    main()
