"""Median greedy decode-step time (ms) of the demo engine at batch 16, context 128, over 400 steps (one thread)."""
import os, statistics, sys, time
import torch
torch.set_num_threads(1)
from engine.demo import demo_model_path
from engine.engine import Engine, EngineConfig
from engine.model_runner import StepInput
from engine.sampling_params import SamplingParams
from engine.shared_memory import release_name
try:
    from engine.sampler import Row
except ImportError:
    Row = None
cfg = EngineConfig(model=str(demo_model_path()), num_kv_blocks=16 * 10, max_num_seqs=16)
e = Engine.create(cfg, (f"pb-{os.getpid()}-w", f"pb-{os.getpid()}-kv"))
greedy = SamplingParams(temperature=0.0)
inputs = [StepInput([1], 128, list(range(i * 10, i * 10 + 10))) for i in range(16)]
def step():
    if Row is None:
        e.step(inputs, [greedy] * 16, [0] * 16)
    else:
        e.step(inputs, [Row(greedy, [1, 1], 1, str(i)) for i in range(16)])
for _ in range(20):
    step()
times = []
for _ in range(400):
    t = time.perf_counter(); step(); times.append((time.perf_counter() - t) * 1000)
release_name(e.weights_handle); release_name(e.kv_handle)
with open(sys.argv[1], "a") as f:
    f.write(f"{statistics.median(times):.3f}\n")
