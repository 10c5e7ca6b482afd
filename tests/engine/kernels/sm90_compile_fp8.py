"""Compile every FP8 kernel configuration (engine/kernels/fp8.py) for an H100/H200 (sm_90) on a
machine without a GPU, with sm90_compile.py's stand-in driver: the activation quantizer (groups of
128, a per-channel row in one tile and one wider than a tile) and the GEMM in each of FP8_CONFIGS'
tiles, W8A8 and W8A16, one group (per-channel scales) and groups of 128 (block checkpoints, with a
bias), in bfloat16 and float16. Shapes are Llama-3.1-8B's qkv projection (4096 -> 6144). Each case
must compile to a cubin that fits sm_90's shared memory.

Run with TRITON_INTERPRET unset, in a process of its own:
    env -u TRITON_INTERPRET python -m tests.engine.kernels.sm90_compile_fp8 [--dtypes D] [--jobs N]
Prints one line per case and exits 1 if any case is not OK.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import torch
import triton
from triton.runtime.driver import driver

from engine.kernels.fp8 import FP8_CONFIGS, Fp8Config, fp8_config, fp8_gemm, quantize_activations
from engine.quant import FP8, Fp8Weight
from tests.engine.kernels.sm90_compile import (
    DTYPES,
    H100_SHARED_MEMORY,
    LLAMA,
    Case,
    Result,
    StopAfterPtxas,
    run_case,
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


def cases(dtypes: tuple[str, ...] = ("bfloat16", "float16")) -> list[Case]:
    """Quantizer cases, then GEMM cases, for each of dtypes; a family compiles in one process."""
    found = []
    for dt in dtypes:
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


_stand_in: StopAfterPtxas | None = None
_cases: list[Case] = []


def _start_worker(dtypes: tuple[str, ...]) -> None:
    global _stand_in, _cases
    torch.set_num_threads(1)
    _stand_in = StopAfterPtxas(keep_args=False)
    driver.set_active(_stand_in)
    _cases = cases(dtypes)


def _run_family(family: str) -> list[tuple[int, Result]]:
    assert _stand_in is not None, "call _start_worker first"
    return [(i, run_case(_stand_in, c)) for i, c in enumerate(_cases) if c.family == family]


def run(dtypes: tuple[str, ...], jobs: int) -> list[Result]:
    """Every case's result in order; each family in one process, up to jobs at a time."""
    _start_worker(dtypes)
    families = list(dict.fromkeys(c.family for c in _cases))
    if jobs <= 1:
        done = [pair for family in families for pair in _run_family(family)]
    else:
        spawn = multiprocessing.get_context("spawn")  # forking after torch's import is unsafe
        with ProcessPoolExecutor(
            min(jobs, len(families)),
            mp_context=spawn,
            initializer=_start_worker,
            initargs=(dtypes,),
        ) as pool:
            done = [pair for pairs in pool.map(_run_family, families) for pair in pairs]
    return [result for _, result in sorted(done, key=lambda pair: pair[0])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dtypes", default="bfloat16,float16", help="x's dtypes, comma-separated (default both)"
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiling processes")
    args = parser.parse_args(argv)
    dtypes = tuple(args.dtypes.split(","))
    if not set(dtypes) <= {"bfloat16", "float16"}:
        parser.error(f"--dtypes takes bfloat16 and float16, got {args.dtypes}")
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: under the interpreter nothing is compiled", file=sys.stderr)
        return 2
    start = time.perf_counter()
    results = run(dtypes, args.jobs)
    print(
        f"triton {triton.__version__}, torch {torch.__version__}, target cuda:90, "
        f"shared memory limit {H100_SHARED_MEMORY} B"
    )
    for result in results:
        print(result.line(), flush=True)
    bad = [r for r in results if r.status != "OK"]
    print(
        f"{len(results) - len(bad)} of {len(results)} cases OK in "
        f"{time.perf_counter() - start:.0f} s"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
