"""One decode step's wall time (median of 20 after 5 warm-ups) of the engine in the checkout TREE, so that two
checkouts (a `git worktree` of an earlier commit and this one) can be run in alternation on the same model. MODEL: a
model folder, e.g. SmolLM2's converted one, or a 30-layer model of tiny widths whose step is nearly all host time:
  python -c "from tests.tiny_models import write_tiny_model; write_tiny_model('/tmp/tiny30', 'llama',
    num_hidden_layers=30, hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
    head_dim=64, max_position_embeddings=4096)"
Usage: TREE=CHECKOUT MODEL=FOLDER python steptime.py DTYPE BATCH CONTEXT"""
import os, sys, time
sys.path.insert(0, os.environ["TREE"])
import torch
from bench.engine import CPU_GRID, engine_config, start_engine
from engine.step_timing import Blocks, greedy_step, release_engine
from engine.model_runner import StepInput

dtype, batch, context = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
engine = start_engine(engine_config(os.environ["MODEL"], torch.device("cpu"), CPU_GRID, dtype))
try:
    blocks = Blocks(engine.num_kv_blocks, engine.plan.block_size)
    inputs = [StepInput([1], context, blocks.table(context + 1)) for _ in range(batch)]
    for _ in range(5):
        greedy_step(engine, inputs)
    times = []
    for _ in range(20):
        t = time.perf_counter()
        greedy_step(engine, inputs)
        times.append(time.perf_counter() - t)
    print(f"{os.environ['TREE']} {dtype} {batch}x{context}: {sorted(times)[10] * 1e3:.2f} ms")
finally:
    release_engine(engine)
