"""Every FP8 kernel configuration (engine/kernels/fp8.py) as sm90_compile.py's cases, which it
compiles for an H100/H200 (sm_90) on a machine without a GPU: the activation quantizer (groups of
128, a per-channel row in one tile and one wider than a tile) and the GEMM in each of FP8_CONFIGS'
tiles, W8A8 and W8A16, one group (per-channel scales) and groups of 128 (block checkpoints, with a
bias), in bfloat16 and float16. Shapes are Llama-3.1-8B's qkv projection (4096 -> 6144). Each case
must compile to a cubin that fits sm_90's shared memory.

Compiled as sm90_compile.py's parts fp8-gemm (bfloat16) and fp8-gemm-float16:
    env -u TRITON_INTERPRET python -m tests.engine.kernels.sm90_compile --part fp8-gemm
"""

from __future__ import annotations

import torch

from engine.kernels.fp8 import FP8_CONFIGS, Fp8Config, fp8_config, fp8_gemm, quantize_activations
from engine.quant import FP8, Fp8Weight
from tests.engine.kernels.sm90_compile import (
    DTYPES,
    LLAMA,
    Case,
)

N = LLAMA.num_heads * LLAMA.head_dim + 2 * LLAMA.num_kv_heads * LLAMA.head_dim  # qkv: 6144
K = LLAMA.hidden_size  # 4096
WIDE_K = LLAMA.intermediate_size  # 14336: the down projection's per-channel row
BLOCK = 128  # a block checkpoint's group


def first_m(config: Fp8Config) -> int:
    """The fewest rows that get config."""
    return next(m for m in range(1, 1 << 16) if fp8_config(m, torch.bfloat16, "dynamic") == config)


def quantize(dt: str, k: int, group: int) -> None:
    quantize_activations(torch.zeros(1, k, dtype=DTYPES[dt]), group)


def gemm(dt: str, m: int, activations: str, group: int) -> None:
    """fp8_gemm (W8A8: the quantizer's launch, then the GEMM's) with a bias where groups are
    128."""
    dtype = DTYPES[dt]
    w = Fp8Weight(torch.zeros(N, K, dtype=FP8), torch.ones(N, -(-K // group)), group, activations)
    bias = torch.zeros(N, dtype=dtype) if group == BLOCK else None
    fp8_gemm(torch.zeros(m, K, dtype=dtype), w, bias)


def fp8_gemm_cases(dt: str) -> list[Case]:
    """Quantizer cases, then GEMM cases, in dt; a family compiles in one process."""
    found = []
    for k, group, what in (
        (K, BLOCK, "groups of 128"),
        (K, K, "per-channel"),
        (WIDE_K, WIDE_K, "per-channel, wider than a tile"),
    ):
        found.append(
            Case(
                f"fp8 quantize {dt} K={k} {what}",
                f"fp8 {dt}",
                lambda dt=dt, k=k, g=group: quantize(dt, k, g),
            )
        )
    for config in FP8_CONFIGS:
        m = first_m(config)
        tile = f"tile {config.block_m}x{config.block_n}x{config.block_k}"
        for activations in ("dynamic", "none"):
            for group in (K, BLOCK):
                found.append(
                    Case(
                        f"fp8 gemm {dt} {activations} m={m} ({tile}) "
                        + ("per-channel" if group == K else "groups of 128, bias"),
                        f"fp8 {dt} {activations}",
                        lambda dt=dt, m=m, a=activations, g=group: gemm(dt, m, a, g),
                    )
                )
    return found
