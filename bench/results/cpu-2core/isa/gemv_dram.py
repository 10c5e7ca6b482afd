"""cpu_gemv.c's bfloat16 linear of 1-8 rows (the build $PPD_CPU_ISA picks) on 24 weights of N x K cycled (100-280 MB:
beyond L2, if not always beyond an L3 as large as 480 MB), beside oneDNN's float32 GEMM on float32 copies of them (what a CPU without native
bfloat16 runs from 9 rows, engine/attention/cpu_linear.py); GB/s of weights read. Usage: python gemv_dram.py"""
import sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
import torch
from engine.attention.cpu_kernel import load

lib = load()
gen = torch.Generator().manual_seed(0)


def per_call(fn, weights):
    for w in weights:
        fn(w)
    t = time.perf_counter()
    for _ in range(3):
        for w in weights:
            fn(w)
    return (time.perf_counter() - t) / (3 * len(weights))


for n, k in ((5632, 1024), (1024, 2816), (2048, 1024)):
    ws = [(torch.randn(n, k, generator=gen) / 32).to(torch.bfloat16) for _ in range(24)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w.float(), None) for w in ws]
    for m in (1, 2, 4, 8):
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        x32 = x.float()
        row = [f"{n} x {k}, {m} rows:"]
        dt = min(per_call(lambda w: lib.linear_few_rows(x, w, None), ws) for _ in range(2))
        row.append(f"cpu_gemv.c {dt * 1e3:.3f} ms ({n * k * 2 / dt / 1e9:.1f} GB/s)")
        dt = min(per_call(lambda p: torch.ops.mkldnn._linear_pointwise(x32, p, None, "none", [], ""), packed) for _ in range(2))
        row.append(f"float32 oneDNN {dt * 1e3:.3f} ms ({n * k * 4 / dt / 1e9:.1f} GB/s of float32)")
        print(*row, flush=True)
