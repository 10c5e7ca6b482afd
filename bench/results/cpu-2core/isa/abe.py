"""Engine decode steps (issue 23's model, random KV, contiguous blocks) with the attention kernels of REV's sources
(A) or the working tree's (B), alternating rounds; the minimum and the median over rounds of each round's median
step (the machine is shared: the minimum is the least disturbed). The linear layers and the elementwise kernels are
the working tree's in both. Usage: python abe.py REV DTYPE [rounds]"""
import os, statistics, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu-kernels"))
from ab_decode import ROOT, kernels_at
from engine.step_timing import Blocks, greedy_step
from engine.engine import Engine, EngineConfig
from engine.model_runner import StepInput
from engine.shared_memory import release_name

rev, dtype = sys.argv[1], sys.argv[2]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 6
libs = dict(zip("AB", kernels_at(rev)))
cfg = EngineConfig(model=str(ROOT / "bench" / "models" / "llama-1b-cpu"), dtype=dtype, load_format="dummy",
                   device="cpu", attention_backend="cpu", block_size=16, max_model_len=2100, max_num_seqs=32,
                   max_num_batched_tokens=2048, num_kv_blocks=32 * 130 + 8, shares_device=False)
engine = Engine.create(cfg, (f"abe-{os.getpid()}-w", f"abe-{os.getpid()}-kv"))
for chunk in engine.runner.kv_pool.view(-1).split(2**28):
    chunk.normal_(0.0, 1.0)
shapes = [(1, 2048), (8, 256), (8, 1024), (8, 2048), (32, 256), (32, 1024), (32, 2048)]
res = {}
try:
    for rnd in range(rounds):
        for name in ("AB" if rnd % 2 == 0 else "BA"):
            engine.runner.backend.kernels = libs[name]
            for batch, context in shapes:
                blocks = Blocks(engine.num_kv_blocks, 16)
                inputs = [StepInput([1], context, blocks.table(context + 1)) for _ in range(batch)]
                greedy_step(engine, inputs)
                ts = []
                for _ in range(7):
                    t = time.perf_counter(); greedy_step(engine, inputs); ts.append((time.perf_counter() - t) * 1e3)
                res.setdefault((batch, context, name), []).append(statistics.median(ts))
    for batch, context in shapes:
        a, b = res[(batch, context, "A")], res[(batch, context, "B")]
        print(f"decode batch {batch}, context {context}: min {rev} {min(a):.2f} ms, working tree {min(b):.2f} ms, "
              f"ratio {min(b) / min(a):.3f}; median ratio {statistics.median(b) / statistics.median(a):.3f}", flush=True)
finally:
    release_name(engine.weights_handle)
    release_name(engine.kv_handle)
