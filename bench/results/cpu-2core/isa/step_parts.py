"""Where an engine step's wall time goes (issue 23's model, dummy weights, the pool as `ppd bench engine` sizes it):
our kernels and each linear layer timed by wrapping them, 10 steps after 3 warm-ups; `rest` is everything else
(embedding, sampling, Python). Usage: [MODEL=FOLDER] python step_parts.py DTYPE BATCH CONTEXT [NEW_TOKENS]
(MODEL: another model folder, e.g. SmolLM2's converted one)"""
import collections, os, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
import torch
from bench.engine import CPU_GRID, engine_config, start_engine
from engine.step_timing import Blocks, greedy_step, release_engine
from engine.attention import cpu_kernel, cpu_linear
from engine.model_runner import StepInput

spent, calls = collections.defaultdict(float), collections.Counter()


def timed(name, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        spent[name(*args) if callable(name) else name] += time.perf_counter() - t
        calls[name(*args) if callable(name) else name] += 1
        return out
    return wrapper


for kernel in ("paged_decode", "paged_prefill", "rms_norm", "silu_mul", "rope"):
    setattr(cpu_kernel.CpuKernels, kernel, timed(kernel, getattr(cpu_kernel.CpuKernels, kernel)))
cpu_linear.CpuOps.linear = staticmethod(timed(lambda x, w, *_: f"linear {x.shape[0]} x {w.shape[1]} -> {w.shape[0]}",
                                              cpu_linear.CpuOps.linear))
dtype, batch, context = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
new = int(sys.argv[4]) if len(sys.argv) > 4 else 1
engine = start_engine(engine_config(os.environ.get("MODEL") or str(Path(__file__).resolve().parents[3] / "models" / "llama-1b-cpu"),
                                    torch.device("cpu"), CPU_GRID, dtype))
try:
    blocks = Blocks(engine.num_kv_blocks, engine.plan.block_size)
    inputs = [StepInput([1] * new, context, blocks.table(context + new)) for _ in range(batch)]
    for _ in range(3):
        greedy_step(engine, inputs)
    spent.clear(), calls.clear()
    t = time.perf_counter()
    for _ in range(10):
        greedy_step(engine, inputs)
    total = (time.perf_counter() - t) / 10 * 1e3
    print(f"{dtype}, batch {batch}, context {context}, {new} new: step {total:.1f} ms")
    for name, s in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {name}: {s / 10 * 1e3:.1f} ms ({calls[name] // 10} calls)")
    print(f"  rest: {total - sum(spent.values()) / 10 * 1e3:.1f} ms")
finally:
    release_engine(engine)
