"""One layer's prefill attention at SmolLM2-135M's shape (9 heads, 3 KV heads, D 64, bfloat16, blocks of 16 scattered
over the pool): our kernel (cpu_prefill.c) against PyTorch's SDPA over the gathered blocks (what CpuBackend runs for
bfloat16 prefill rows on a CPU with AMX-BF16), both threads, milliseconds a layer (best of 5 passes of 20).
Usage: python sdpa_layer.py"""
import sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "tests" / "engine"))
import torch
from engine.attention.cpu_kernel import load
from engine.attention.torch_backend import AttentionMetadata, sdpa_attention
from test_cpu_attention import paged

lib, H, HKV, D, BS = load(), 9, 3, 64, 16


def best_ms(fn, n=20):
    fn()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n * 1e3)
    return best


for label, news, cached in (("512-token prompt", [512], [0]), ("16 x 128-token prompts", [128] * 16, [0] * 16),
                            ("256 new over 1,024 cached", [256], [1024]), ("64 new over 2,048 cached", [64], [2048])):
    lens = [n + c for n, c in zip(news, cached)]
    k_cache, v_cache, tables = paged(lens, BS, HKV, D, torch.bfloat16, 0)
    q = torch.randn(sum(news), H, D).to(torch.bfloat16)
    longest = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (longest - len(t)) for t in tables], dtype=torch.int32)
    starts = [0]
    for n in news:
        starts.append(starts[-1] + n)
    qs, sl = torch.tensor(starts, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    ours = best_ms(lambda: lib.paged_prefill(q, k_cache, v_cache, bt, sl, qs, 0.125, BS))

    def sdpa():  # a fresh metadata each call: the gather's blocks and masks built per step, as in the engine
        meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.int64), query_start=starts,
                                 context_lens=lens, block_tables=tables, block_size=BS)
        return sdpa_attention(q, k_cache, v_cache, meta, 0.125)

    theirs = best_ms(sdpa)
    print(f"{label}: our kernel {ours:.2f} ms, SDPA with the gather {theirs:.2f} ms ({theirs / ours:.2f}x)", flush=True)
