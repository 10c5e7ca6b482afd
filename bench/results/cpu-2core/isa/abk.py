"""The attention kernels alone, REV's sources (A) against the working tree's (B), on one thread, CPU time (the
machine is shared: a second process on the other core moves wall times, not one thread's CPU time), 6 alternating
rounds; issue 23's layer (16 heads, 8 KV heads, D 64), contiguous blocks. PPD_CPU_ISA=avx2 builds both without
AVX-512. Usage: python abk.py REV decode|prefill [float32] [bfloat16]"""
import statistics, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu-kernels"))
from ab_decode import ROOT, kernels_at
sys.path.insert(0, str(ROOT / "tests" / "engine"))
import torch
from test_cpu_attention import paged

torch.set_num_threads(1)
old_lib, new_lib = kernels_at(sys.argv[1])
what, dtypes = sys.argv[2], [getattr(torch, d) for d in sys.argv[3:]] or [torch.float32, torch.bfloat16]


def cpu_ms(fn, n=5):
    fn()
    ts = []
    for _ in range(n):
        t = time.thread_time(); fn(); ts.append(time.thread_time() - t)
    return statistics.median(ts) * 1e3


cases = []
for dtype in dtypes:
    name = str(dtype).removeprefix("torch.")
    if what == "prefill":
        for label, lens, news in (("2048 prompt", [2048], [2048]), ("4 x 512", [512] * 4, [512] * 4),
                                  ("16 x 128", [128] * 16, [128] * 16), ("64 over 2048", [2112], [64]),
                                  ("64 over 512", [576], [64])):
            k, v, tables = paged(lens, 16, 8, 64, dtype, seed=1)
            qs = [0]
            for n in news:
                qs.append(qs[-1] + n)
            q = torch.randn(qs[-1], 16, 64).to(dtype)
            width = max(map(len, tables))
            tt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
            sl, qst = torch.tensor(lens, dtype=torch.int32), torch.tensor(qs, dtype=torch.int32)
            flops = sum(4 * 16 * 64 * (n * (L - n) + n * (n + 1) / 2) for L, n in zip(lens, news))
            cases.append((f"{name} prefill {label}", flops / 1e6, "GFLOP/s",
                          lambda lib, q=q, k=k, v=v, tt=tt, sl=sl, qst=qst: lib.paged_prefill(q, k, v, tt, sl, qst, 0.125, 16)))
    else:
        for b, L in ((1, 2048), (8, 256), (8, 1024), (32, 256), (32, 1024), (32, 2048)):
            k, v, tables = paged([L] * b, 16, 8, 64, dtype, seed=1)
            q = torch.randn(b, 16, 64).to(dtype)
            tt, sl = torch.tensor(tables, dtype=torch.int32), torch.tensor([L] * b, dtype=torch.int32)
            cases.append((f"{name} decode batch {b}, context {L}", 2 * b * L * 8 * 64 * dtype.itemsize / 1e6, "GB/s",
                          lambda lib, q=q, k=k, v=v, tt=tt, sl=sl: lib.paged_decode(q, k, v, tt, sl, 0.125, 16)))
for label, work, unit, fn in cases:
    ra, rb = [], []
    for r in range(6):
        for lib, res in ([(old_lib, ra), (new_lib, rb)] if r % 2 == 0 else [(new_lib, rb), (old_lib, ra)]):
            res.append(cpu_ms(lambda: fn(lib)))
    a, b = statistics.median(ra), statistics.median(rb)
    diff = (fn(old_lib).float() - fn(new_lib).float()).abs().max().item()
    print(f"{label}: {sys.argv[1]} {a:.2f} ms ({work / a:.0f} {unit}), working tree {b:.2f} ms ({work / b:.0f}), "
          f"ratio {b / a:.3f} (max |A-B| {diff:.2g})", flush=True)
