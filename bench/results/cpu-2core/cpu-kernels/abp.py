"""A/B in one process: the prefill kernel alone (one layer of issue 23's model: 16 heads, 8 KV heads, D 64, bf16),
built from REV's sources (A) or the working tree's (B), 6 alternating rounds. Usage: python abp.py REV."""
import sys, time, torch
from ab_decode import ROOT, kernels_at
sys.path.insert(0, str(ROOT / "tests" / "engine"))
from test_cpu_attention import paged
rev = sys.argv[1]
old_lib, new_lib = kernels_at(rev)
cases = {"5 x 400 over 1000": ([1400] * 5, [400] * 5), "5 x 400 over 2500": ([2900] * 5, [400] * 5),
         "2048 prompt": ([2048], [2048]), "4 x 512 prompts": ([512] * 4, [512] * 4)}
res = {}
for name, (lens, news) in cases.items():
    k_cache, v_cache, tables = paged(lens, 16, 8, 64, torch.bfloat16, seed=1)
    qs = [0]
    for n in news: qs.append(qs[-1] + n)
    q = torch.randn(qs[-1], 16, 64).to(torch.bfloat16)
    width = max(map(len, tables))
    tt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    sl = torch.tensor(lens, dtype=torch.int32); qst = torch.tensor(qs, dtype=torch.int32)
    outs = {}
    for rnd in range(6):
        for tag, lib in ([("A", old_lib), ("B", new_lib)] if rnd % 2 == 0 else [("B", new_lib), ("A", old_lib)]):
            f = lambda: lib.paged_prefill(q, k_cache, v_cache, tt, sl, qst, 0.125, 16)
            outs[tag] = f(); ts = []
            for _ in range(5):
                t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
            res.setdefault((name, tag), []).append(sorted(ts)[2] * 1e3)
    a, b = sorted(res[(name, "A")])[3], sorted(res[(name, "B")])[3]
    diff = (outs["A"].float() - outs["B"].float()).abs().max().item()
    print(f"{name}: {rev} {a:.2f} ms, working tree {b:.2f} ms, ratio {b / a:.3f} (max |A-B| {diff:.3g})", flush=True)
