"""Host time of an eager step on the GPU path, without a GPU: `python bench/scripts/host_path.py
[ROUNDS]` from a checkout's root.

The Triton kernels are compiled for sm_90 and launched into a recorder (the stand-in driver of
tests/engine/kernels/sm90_compile.py), so a launch costs the host what Triton's Python costs it
(binding, cache lookup) but not the driver's cuLaunchKernel (about 2-4 us on a GPU host). The GEMMs
(torch's linear) are stood in by allocating their output, so their cost here is an allocation, not
cuBLAS's launch (about 5-8 us on a GPU host, 4 a layer). What is left is the engine's own host code
per step: metadata, staging, the kernels' wrappers, the model's Python. The model is Llama-3.1-8B's
layout (32 layers, 32 heads, 8 KV heads, head_dim 128) with a narrow hidden size, MLP and vocabulary
(nothing runs: only the number of ops matters), bfloat16, on the CPU's torch.

Prints one line per step kind: the median over ROUNDS (default 5) of the mean host time of 20 steps,
per step and per layer, and the Triton launches recorded per step. It imports whatever engine is on
PYTHONPATH, so the same script times two revisions (a worktree of each) in alternating processes.
`--jit` sends every launch through the JIT (engine/kernels/launch.py's Launches relaunching
nothing), where the revision has Launches. Run with MALLOC_MMAP_THRESHOLD_=4000000000: glibc
otherwise maps and unmaps every large CPU tensor, a cost CUDA's caching allocator does not have.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import replace

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

from tests.engine.kernels.sm90_compile import StopAfterPtxas  # noqa: E402

try:
    STAND_IN = StopAfterPtxas(
        keep_args=False
    )  # records that keep arguments keep every step's tensors alive
except TypeError:  # a revision whose recorder keeps none
    STAND_IN = StopAfterPtxas()
driver.set_active(STAND_IN)

from engine.attention.base import AttentionShape  # noqa: E402
from engine.attention.triton_backend import TritonBackend  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.loader import arena_nbytes, bind_arena, build_model  # noqa: E402
from engine.model import kv_pool_shape  # noqa: E402
from engine.model_runner import ModelRunner, StepInput  # noqa: E402

LAYERS, BLOCK = 32, 16
STEPS = 20


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.empty(*x.shape[:-1], weight.shape[0], dtype=x.dtype)


def runner() -> ModelRunner:
    cfg = replace(
        ModelConfig.from_folder("bench/models/llama-3.1-8b"),
        hidden_size=512,
        intermediate_size=256,
        vocab_size=1024,
        max_position_embeddings=8192,
    )
    model = build_model(cfg, torch.bfloat16)
    bind_arena(model, torch.zeros(arena_nbytes(model), dtype=torch.uint8))
    pool = torch.zeros(kv_pool_shape(cfg, 8 * 1024 // BLOCK + 8, BLOCK), dtype=torch.bfloat16)
    shape = AttentionShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, BLOCK, 8192 // BLOCK)
    run = ModelRunner(model, pool, BLOCK, TritonBackend(shape, torch.device("cpu")))
    run.backend.ops.linear = linear
    return run


def steps() -> dict[str, list[StepInput]]:
    table = list(range(4096 // BLOCK + 17))
    decode = [StepInput([5], 1023, table[: 1024 // BLOCK + 1]) for _ in range(32)]
    append = [StepInput([5] * 256, 4096, table)]
    return {
        "decode 32 x 1K": decode,
        "append 256 over 4K": append,
        "mixed 32 x 1K + 256 over 4K": decode + append,
    }


def jit_only() -> None:
    from engine.kernels.launch import Launches

    def launch(self, kernel, grid, tensors, scalars, consts) -> None:
        kernel[grid](*tensors, *scalars, **consts.kwargs)

    Launches.__call__ = launch


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--jit"]
    if "--jit" in sys.argv:
        jit_only()
    rounds = int(args[0]) if args else 5
    run = runner()
    for name, inputs in steps().items():
        run.forward(inputs)  # compiles
        times, launches = [], 0
        for _ in range(rounds):
            before = len(STAND_IN.launches)
            started = time.perf_counter()
            for _ in range(STEPS):
                run.forward(inputs)
            times.append((time.perf_counter() - started) / STEPS)
            launches = (len(STAND_IN.launches) - before) // STEPS
        ms = statistics.median(times) * 1000
        print(
            f"{name:30s} {ms:7.2f} ms a step  {1000 * ms / LAYERS:6.0f} us a layer  {launches} "
            "launches a step"
        )


if __name__ == "__main__":
    main()
