"""cpu_gemv.c's float32 linear of 1-32 rows (linear_rows_f32; the build $PPD_CPU_ISA picks), its weights float32 or
bfloat16 widened in registers, beside what runs otherwise: oneDNN's float32 GEMM on the prepacked float32 weight, and
for bfloat16 weights of 1-8 rows the few-rows kernel (linear_few_rows_bf16). 24 weights of each shape cycled (beyond
L2), both threads; milliseconds a call, the minimum of 3 passes. Usage: python rows_bench.py [ROWS,...]"""
import sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
import torch
from engine.attention.cpu_kernel import load

lib = load()
gen = torch.Generator().manual_seed(0)
rows = [int(r) for r in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 2, 4, 8, 12, 16, 24, 32]


def per_call(fn, weights):
    for w in weights:
        fn(w)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for w in weights:
            fn(w)
        best = min(best, (time.perf_counter() - t) / len(weights))
    return best


for n, k in ((3072, 1024), (1024, 2816), (5632, 1024)):  # llama-1b-cpu's qkv, down, gate_up
    ws = [torch.randn(n, k, generator=gen) / 32 for _ in range(24)]
    bf = [w.to(torch.bfloat16) for w in ws]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws]
    for m in rows:
        x = torch.randn(m, k, generator=gen)
        xb = x.to(torch.bfloat16)
        onednn = per_call(lambda p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""), packed)
        f32 = per_call(lambda w: lib.linear_rows(x, w, None), ws)
        b16 = per_call(lambda w: lib.linear_rows(xb.float(), w, None).to(torch.bfloat16), bf)
        few = per_call(lambda w: lib.linear_few_rows(xb, w, None), bf) if m <= 8 else float("nan")
        print(f"{n} x {k}, {m:2d} rows: oneDNN f32 {onednn * 1e3:.3f}  rows f32 {f32 * 1e3:.3f} "
              f"({f32 / onednn:.2f}x)  rows bf16 {b16 * 1e3:.3f} ({b16 / onednn:.2f}x)  few bf16 {few * 1e3:.3f}",
              flush=True)
