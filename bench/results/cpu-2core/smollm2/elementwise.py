"""The fused elementwise kernels (cpu_elementwise.c: SiLU-and-multiply, add + RMSNorm) against TorchOps' composition
at SmolLM2-135M's widths (intermediate 1536, hidden 576), bfloat16, 8 rows (a decode step) and 512 (a prefill),
both threads; microseconds a call. Usage: python elementwise.py"""
import sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
import torch
from engine.attention.cpu_kernel import load
from engine.ops import TorchOps

lib = load()


def us(fn, n=50):
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


for rows in (8, 512):
    x = torch.randn(rows, 3072).to(torch.bfloat16)
    h, r = torch.randn(rows, 576).to(torch.bfloat16), torch.randn(rows, 576).to(torch.bfloat16)
    w = torch.randn(576).to(torch.bfloat16)
    print(f"{rows} rows: silu_mul ours {us(lambda: lib.silu_mul(x)):.0f}, torch {us(lambda: TorchOps.silu_and_mul(x)):.0f}; "
          f"add + rms_norm ours {us(lambda: lib.rms_norm(h, w, 1e-5, r)):.0f}, "
          f"torch {us(lambda: TorchOps.add_rms_norm(h, r, w, 1e-5)):.0f}")
