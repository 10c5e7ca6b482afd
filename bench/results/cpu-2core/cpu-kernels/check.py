import sys, time, torch
ROOT = __import__("pathlib").Path(__file__).resolve().parents[4]; sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "engine")]
from engine.attention import cpu_kernel
from engine.attention.torch_backend import AttentionMetadata, sdpa_attention
from test_cpu_attention import paged
K = cpu_kernel.load()

def case(lens, news, H, Hkv, D, dtype, bs=16, reps=0):
    k_cache, v_cache, tables = paged(lens, bs, Hkv, D, dtype, seed=H + D)
    qs = [0]
    for n in news: qs.append(qs[-1] + n)
    q = torch.randn(qs[-1], H, D).to(dtype)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.int64), qs, lens, tables, bs)
    ref = sdpa_attention(q.double(), k_cache.double(), v_cache.double(), meta, 0.125)
    width = max(map(len, tables))
    tt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    sl = torch.tensor(lens, dtype=torch.int32); qst = torch.tensor(qs, dtype=torch.int32)
    out = K.paged_prefill(q, k_cache, v_cache, tt, sl, qst, 0.125, bs)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    res = f"{lens} {news} H{H}/{Hkv} D{D} {dtype}: err {err:.2e}"
    if reps:
        for f, name in ((lambda: K.paged_prefill(q, k_cache, v_cache, tt, sl, qst, 0.125, bs), "ours"),
                        (lambda: sdpa_attention(q, k_cache, v_cache, meta, 0.125), "sdpa")):
            f(); ts = []
            for _ in range(reps):
                t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
            ts.sort(); ms = ts[len(ts)//2] * 1e3
            flop = sum(4 * n * (l - n + (n + 1) / 2) * H * D for l, n in zip(lens, news))
            res += f" | {name} {ms:.2f} ms {flop / ms / 1e6:.1f} GF/s"
    print(res, flush=True)

for dtype in (torch.float32, torch.bfloat16):
    case([17], [17], 4, 4, 64, dtype)
    case([100, 513, 40], [30, 513, 1], 16, 8, 64, dtype)
    case([300, 77], [5, 77], 8, 2, 128, dtype)
    case([200], [200], 28, 4, 128, dtype)   # G = 7
    case([50, 90], [50, 3], 6, 6, 48, dtype)  # odd head dim
    case([33], [20], 4, 1, 80, dtype, bs=32)
case([1500], [300], 16, 8, 64, torch.bfloat16, reps=7)
case([2048], [2048], 16, 8, 64, torch.bfloat16, reps=3)
case([1200]*4, [256]*4, 16, 8, 64, torch.bfloat16, reps=5)
