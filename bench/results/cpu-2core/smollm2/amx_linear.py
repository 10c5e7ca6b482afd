"""bfloat16 linears on AMX's tiles (cpu_amx.c) against oneDNN's GEMM on its prepacked weights, at SmolLM2-135M's
shapes, both threads: a layer's four linears cycled over 30 layers of their own weights (as a decode step reads them:
each weight from memory, not from the last call's cache), medians of 7 passes, at 1, 8 and 32 rows; the 49,152 x 576
head at 1-32 rows; then 48-2,048 rows (mixed steps, prefill) on one weight each, repeated. Usage: python amx_linear.py"""
import sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
import torch
from engine.attention.cpu_kernel import load

lib = load()
torch.manual_seed(0)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate+up, down: [out, in]
LAYERS = 30


def onednn(w):
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def amx(w):
    tiles = lib.amx_pack(w)
    return lambda x: lib.amx_linear(x, tiles, w.shape[0], None)


def median(fn, n):
    fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[n // 2]


weights = [[torch.randn(n, k, dtype=torch.bfloat16) for n, k in SHAPES] for _ in range(LAYERS)]
calls = {name: [[make(w) for w in layer] for layer in weights] for name, make in (("onednn", onednn), ("amx", amx))}
for rows in (1, 8, 32):
    xs = [torch.randn(rows, k, dtype=torch.bfloat16) for _, k in SHAPES]
    spent = {}
    for name in ("onednn", "amx", "onednn", "amx"):  # alternating, each pass cycles every layer
        for i, (n, k) in enumerate(SHAPES):
            def cycle(i=i):
                for layer in calls[name]:
                    layer[i](xs[i])
            spent.setdefault((name, i), []).append(median(cycle, 7) / LAYERS)
    for i, (n, k) in enumerate(SHAPES):
        a, b = min(spent[("onednn", i)]), min(spent[("amx", i)])
        print(f"{rows:>4} rows, {n} x {k}: oneDNN {a * 1e6:6.1f} us, AMX {b * 1e6:6.1f} us ({b / a:.2f}x), "
              f"AMX reads {n * k * 2 / b / 1e9:.1f} GB/s")
head = torch.randn(49152, 576, dtype=torch.bfloat16)
head_calls = {"onednn": onednn(head), "amx": amx(head)}
for rows in (1, 8, 32):
    x = torch.randn(rows, 576, dtype=torch.bfloat16)
    a, b = (median(lambda: head_calls[name](x), 9) for name in ("onednn", "amx"))
    print(f"{rows:>4} rows, 49152 x 576 (the head): oneDNN {a * 1e3:.2f} ms, AMX {b * 1e3:.2f} ms ({b / a:.2f}x)")
for n, k in SHAPES[:3]:
    w = torch.randn(n, k, dtype=torch.bfloat16)
    fns = onednn(w), amx(w)
    for rows in (48, 96, 128, 160, 256, 2048):
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        a, b = (median(lambda: fn(x), 7) for fn in fns)
        print(f"{rows:>4} rows, {n} x {k}: oneDNN {a * 1e3:.2f} ms, AMX {b * 1e3:.2f} ms ({b / a:.2f}x)")
