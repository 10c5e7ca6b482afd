"""A/B in one process: engine decode steps with RoPE in our kernel (CpuOps) or in PyTorch's ops (TorchOps).
Usage: python abr.py MODEL [ROUNDS]."""
import os, statistics, sys, time
from pathlib import Path
ROOT = Path(__file__).resolve().parents[4]; sys.path.insert(0, str(ROOT))
from bench.engine import Blocks, _step
from engine.attention import cpu_linear
from engine.engine import Engine, EngineConfig
from engine.model_runner import StepInput
from engine.ops import TorchOps

model, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5
variants = {"kernel": cpu_linear.CpuOps.__dict__["apply_rope"], "torch": staticmethod(TorchOps.apply_rope)}
shapes = [(1, 1024), (8, 1024), (32, 1024)]
cfg = EngineConfig(model=model, dtype="bfloat16", load_format="dummy", device="cpu", attention_backend="cpu",
                   block_size=16, max_model_len=2100, max_num_seqs=32, max_num_batched_tokens=2048,
                   num_kv_blocks=32 * 130 + 8, shares_device=False)
engine = Engine.create(cfg, (f"abr-{os.getpid()}-w", f"abr-{os.getpid()}-kv"))
res = {}
for rnd in range(rounds):
    for name in (["kernel", "torch"] if rnd % 2 == 0 else ["torch", "kernel"]):
        cpu_linear.CpuOps.apply_rope = variants[name]
        for batch, context in shapes:
            blocks = Blocks(engine.num_kv_blocks, 16)
            inputs = [StepInput([1], context, blocks.table(context + 1)) for _ in range(batch)]
            _step(engine, inputs)
            ts = []
            for _ in range(9):
                t = time.perf_counter(); _step(engine, inputs); ts.append((time.perf_counter() - t) * 1e3)
            res.setdefault((batch, context, name), []).append(statistics.median(ts))
for batch, context in shapes:
    a, b = (statistics.median(res[(batch, context, n)]) for n in ("torch", "kernel"))
    print(f"decode batch {batch}, context {context}: RoPE in torch {a:.2f} ms, in the kernel {b:.2f} ms, ratio {b / a:.3f}")
