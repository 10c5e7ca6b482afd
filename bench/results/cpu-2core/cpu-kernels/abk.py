"""A/B in one process: engine decode steps with the attention kernels built from a git revision's sources (A) or
the working tree's (B). Usage: python abk.py MODEL REV [ROUNDS]."""
import os, shutil, statistics, subprocess, sys, tempfile, time
from pathlib import Path
ROOT = Path(__file__).resolve().parents[4]; sys.path.insert(0, str(ROOT))
from bench.engine import Blocks, _step
from engine.attention import cpu_kernel
from engine.engine import Engine, EngineConfig
from engine.model_runner import StepInput

model, rev, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 5
old = Path(tempfile.mkdtemp())
for src in (*cpu_kernel.SOURCES, *cpu_kernel.HEADERS):
    rel = src.relative_to(ROOT)
    (old / src.name).write_bytes(subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=ROOT, capture_output=True, check=True).stdout)
new_lib = cpu_kernel.CpuKernels(cpu_kernel.build())
saved = cpu_kernel.SOURCES, cpu_kernel.HEADERS
cpu_kernel.SOURCES, cpu_kernel.HEADERS = [old / s.name for s in saved[0]], [old / h.name for h in saved[1]]
old_lib = cpu_kernel.CpuKernels(cpu_kernel.build())
cpu_kernel.SOURCES, cpu_kernel.HEADERS = saved
shutil.rmtree(old)
shapes = [(1, 1024), (1, 2048), (8, 1024), (8, 2048), (32, 1024)]
cfg = EngineConfig(model=model, dtype="bfloat16", load_format="dummy", device="cpu", attention_backend="cpu",
                   block_size=16, max_model_len=2100, max_num_seqs=32, max_num_batched_tokens=2048,
                   num_kv_blocks=32 * 130 + 8, shares_device=False)
engine = Engine.create(cfg, (f"abk-{os.getpid()}-w", f"abk-{os.getpid()}-kv"))
for chunk in engine.runner.kv_pool.view(-1).split(2**28):
    chunk.normal_(0.0, 1.0)
res = {}
for rnd in range(rounds):
    for name, lib in ([("A", old_lib), ("B", new_lib)] if rnd % 2 == 0 else [("B", new_lib), ("A", old_lib)]):
        engine.runner.backend.kernels = lib
        for batch, context in shapes:
            blocks = Blocks(engine.num_kv_blocks, 16)
            inputs = [StepInput([1], context, blocks.table(context + 1)) for _ in range(batch)]
            _step(engine, inputs)
            ts = []
            for _ in range(7):
                t = time.perf_counter(); _step(engine, inputs); ts.append((time.perf_counter() - t) * 1e3)
            res.setdefault((batch, context, name), []).append(statistics.median(ts))
for batch, context in shapes:
    a, b = (statistics.median(res[(batch, context, n)]) for n in "AB")
    print(f"decode batch {batch}, context {context}: {rev} {a:.1f} ms, working tree {b:.1f} ms, ratio {b / a:.3f}")
