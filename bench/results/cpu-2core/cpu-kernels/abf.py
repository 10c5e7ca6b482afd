"""A/B in one process: fused norm/silu (CpuOps) vs torch's composition."""
import os, sys, time, statistics, torch
ROOT = __import__("pathlib").Path(__file__).resolve().parents[4]; sys.path.insert(0, str(ROOT))
from engine.step_timing import Blocks, greedy_step
from engine.engine import Engine, EngineConfig
from engine.model_runner import StepInput
from engine.attention import cpu_linear
from engine.ops import TorchOps
fused = {n: cpu_linear.CpuOps.__dict__[n] for n in ("rms_norm", "add_rms_norm", "silu_and_mul")}
plain = {n: staticmethod(getattr(TorchOps, n)) if n != "add_rms_norm" else staticmethod(lambda x, r, w, e: TorchOps.add_rms_norm(x, r, w, e)) for n in fused}
shapes = [("prefill", 2048, 0, 1), ("append", 64, 2048, 1), ("decode", 1, 1024, 32), ("decode", 1, 256, 8)]
cfg = EngineConfig(model=sys.argv[1], dtype="bfloat16", load_format="dummy", device="cpu", attention_backend="cpu",
                   block_size=16, max_model_len=4096, max_num_seqs=64, max_num_batched_tokens=2048,
                   num_kv_blocks=2400, shares_device=False)
engine = Engine.create(cfg, (f"ab-{os.getpid()}-w", f"ab-{os.getpid()}-kv"))
res = {}
for rnd in range(3):
    for variant in (["fused", "plain"] if rnd % 2 == 0 else ["plain", "fused"]):
        for n, f in (fused if variant == "fused" else plain).items():
            setattr(cpu_linear.CpuOps, n, f)
        for kind, new, cached, n in shapes:
            blocks = Blocks(engine.num_kv_blocks, 16)
            inputs = [StepInput([1] * new, cached, blocks.table(new + cached)) for _ in range(n)]
            greedy_step(engine, inputs)
            ts = []
            for _ in range(3 if kind != "decode" else 10):
                t = time.perf_counter(); greedy_step(engine, inputs); ts.append((time.perf_counter() - t) * 1e3)
            res.setdefault((kind, new, cached, n, variant), []).append(statistics.median(ts))
for kind, new, cached, n in shapes:
    a = statistics.median(res[(kind, new, cached, n, "fused")]); b = statistics.median(res[(kind, new, cached, n, "plain")])
    print(f"{kind} {n}x{new} over {cached}: fused {a:.1f} ms, plain {b:.1f} ms, ratio {a/b:.3f}")
