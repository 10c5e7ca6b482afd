import sys, time, torch
ROOT = __import__("pathlib").Path(__file__).resolve().parents[4]; sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "engine")]
from engine.attention import cpu_kernel
K = cpu_kernel.load()
import os
B, L, H, Hkv, D, bs = 32, int(os.environ.get("L", 1024)), 16, 8, 64, 16
nb = B * L // bs + 8
kc = torch.randn(nb * bs, Hkv, D).to(torch.bfloat16); vc = torch.randn(nb * bs, Hkv, D).to(torch.bfloat16)
perm = torch.randperm(nb)[:B * L // bs].view(B, L // bs).to(torch.int32) if len(sys.argv) > 1 else torch.arange(B * L // bs).view(B, L // bs).to(torch.int32)
lens = torch.full((B,), L, dtype=torch.int32)
q = torch.randn(B, H, D).to(torch.bfloat16)
def t(f, n=20):
    f(); ts = []
    for _ in range(n):
        a = time.perf_counter(); f(); ts.append(time.perf_counter() - a)
    return sorted(ts)[n // 2] * 1e3
ms = t(lambda: K.paged_decode(q, kc, vc, perm, lens, 0.125, bs))
gb = 2 * B * L * Hkv * D * 2 / 1e9
print(f"decode kernel {ms:.2f} ms = {gb / ms * 1e3:.1f} GB/s")
big = torch.randn(2 * B * L * Hkv * D // 2).to(torch.float32)  # same bytes
ms2 = t(lambda: big.sum())
print(f"torch sum same bytes {ms2:.2f} ms = {gb / ms2 * 1e3:.1f} GB/s")
torch.set_num_threads(1)
ms = t(lambda: K.paged_decode(q, kc, vc, perm, lens, 0.125, bs))
print(f"1 thread: decode kernel {ms:.2f} ms = {gb / ms * 1e3:.1f} GB/s")
ms2 = t(lambda: big.sum())
print(f"1 thread: torch sum same bytes {ms2:.2f} ms = {gb / ms2 * 1e3:.1f} GB/s")
