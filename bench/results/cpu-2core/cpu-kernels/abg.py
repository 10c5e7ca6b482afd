"""A/B in one process: engine decode steps with bfloat16 linears of few rows in cpu_gemv.c up to FEW_ROWS rows, for
each limit given, against oneDNN for all. Usage: python abg.py MODEL ROUNDS LIMIT [LIMIT ...]."""
import os, statistics, sys, time
from pathlib import Path
ROOT = Path(__file__).resolve().parents[4]; sys.path.insert(0, str(ROOT))
from bench.engine import Blocks, _step
from engine.attention import cpu_linear
from engine.engine import Engine, EngineConfig
from engine.model_runner import StepInput

model, rounds, limits = sys.argv[1], int(sys.argv[2]), [0] + [int(a) for a in sys.argv[3:]]
shapes = [(1, 256), (1, 2048), (2, 1024), (3, 1024), (4, 1024)]
cfg = EngineConfig(model=model, dtype="bfloat16", load_format="dummy", device="cpu", attention_backend="cpu",
                   block_size=16, max_model_len=2100, max_num_seqs=32, max_num_batched_tokens=2048,
                   num_kv_blocks=32 * 130 + 8, shares_device=False)
engine = Engine.create(cfg, (f"abg-{os.getpid()}-w", f"abg-{os.getpid()}-kv"))
res = {}
for rnd in range(rounds):
    for limit in (limits if rnd % 2 == 0 else limits[::-1]):
        cpu_linear.FEW_ROWS = limit
        for batch, context in shapes:
            blocks = Blocks(engine.num_kv_blocks, 16)
            inputs = [StepInput([1], context, blocks.table(context + 1)) for _ in range(batch)]
            _step(engine, inputs)
            ts = []
            for _ in range(9):
                t = time.perf_counter(); _step(engine, inputs); ts.append((time.perf_counter() - t) * 1e3)
            res.setdefault((batch, context, limit), []).append(statistics.median(ts))
for batch, context in shapes:
    base = statistics.median(res[(batch, context, 0)])
    cells = ", ".join(f"up to {l} rows {statistics.median(res[(batch, context, l)]) / base:.3f}x" for l in limits[1:])
    print(f"decode batch {batch}, context {context}: oneDNN {base:.2f} ms; {cells}")
