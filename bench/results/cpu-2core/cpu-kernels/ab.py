"""A/B in one process: prefill/append rows through our prefill kernel vs SDPA (decode rows: our decode kernel)."""
import os, sys, time, statistics, torch
ROOT = __import__("pathlib").Path(__file__).resolve().parents[4]; sys.path.insert(0, str(ROOT))
from engine.step_timing import Blocks, greedy_step
from engine.engine import Engine, EngineConfig
from engine.model_runner import StepInput
from engine.attention import cpu_backend
from engine.attention.torch_backend import sdpa_attention, store_kv

orig = cpu_backend.CpuBackend.forward
def sdpa_forward(self, q, k, v, kc, vc, meta, scale):
    if meta.prefill is None:
        return orig(self, q, k, v, kc, vc, meta, scale)
    store_kv(k, v, kc, vc, meta.full.slot_mapping)
    return sdpa_attention(q, kc, vc, meta.full, scale)

shapes = [("prefill", 2048, 0, 1), ("prefill", 512, 0, 4), ("append", 300, 1200, 1), ("append", 64, 2048, 1), ("append", 256, 1024, 4)]
cfg = EngineConfig(model=sys.argv[1], dtype="bfloat16", load_format="dummy", device="cpu", attention_backend="cpu",
                   block_size=16, max_model_len=4096, max_num_seqs=32, max_num_batched_tokens=2048,
                   num_kv_blocks=1400, shares_device=False)
engine = Engine.create(cfg, (f"ab-{os.getpid()}-w", f"ab-{os.getpid()}-kv"))
res = {}
for rnd in range(int(sys.argv[2]) if len(sys.argv) > 2 else 3):
    for variant in (["kernel", "sdpa"] if rnd % 2 == 0 else ["sdpa", "kernel"]):
        cpu_backend.CpuBackend.forward = orig if variant == "kernel" else sdpa_forward
        for kind, new, cached, n in shapes:
            blocks = Blocks(engine.num_kv_blocks, 16)
            inputs = [StepInput([1] * new, cached, blocks.table(new + cached)) for _ in range(n)]
            greedy_step(engine, inputs)
            ts = []
            for _ in range(3):
                t = time.perf_counter(); greedy_step(engine, inputs); ts.append((time.perf_counter() - t) * 1e3)
            res.setdefault((kind, new, cached, n, variant), []).append(min(ts))
for kind, new, cached, n in shapes:
    a = statistics.median(res[(kind, new, cached, n, "kernel")]); b = statistics.median(res[(kind, new, cached, n, "sdpa")])
    print(f"{kind} {n}x{new} over {cached}: kernel {a:.1f} ms, sdpa {b:.1f} ms, ratio {a/b:.2f}")
