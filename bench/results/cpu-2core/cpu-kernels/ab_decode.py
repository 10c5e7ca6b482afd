"""What abk.py, abr.py and abg.py share: an engine on issue 23's model sized for decode at batch 32 and context 2K,
and decode steps timed under each variant in alternating rounds (the order reversed every other round); and, for
abk.py and abp.py, the kernels built from a git revision's sources beside the working tree's."""
import os, shutil, statistics, subprocess, sys, tempfile, time
from pathlib import Path
ROOT = Path(__file__).resolve().parents[4]; sys.path.insert(0, str(ROOT))
from engine.step_timing import Blocks, greedy_step
from engine.engine import Engine, EngineConfig
from engine.attention import cpu_kernel
from engine.model_runner import StepInput


def kernels_at(rev: str) -> tuple[cpu_kernel.CpuKernels, cpu_kernel.CpuKernels]:
    """(the kernels built from rev's sources, the working tree's)."""
    old = Path(tempfile.mkdtemp())
    for src in (*cpu_kernel.SOURCES, *cpu_kernel.HEADERS):
        rel = src.relative_to(ROOT)
        (old / src.name).write_bytes(subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=ROOT, capture_output=True,
                                                    check=True).stdout)
    new_lib = cpu_kernel.CpuKernels(cpu_kernel.build())
    saved = cpu_kernel.SOURCES, cpu_kernel.HEADERS
    cpu_kernel.SOURCES, cpu_kernel.HEADERS = [old / s.name for s in saved[0]], [old / h.name for h in saved[1]]
    try:
        old_lib = cpu_kernel.CpuKernels(cpu_kernel.build())
    finally:
        cpu_kernel.SOURCES, cpu_kernel.HEADERS = saved
        shutil.rmtree(old)
    return old_lib, new_lib


def decode_engine(model: str, tag: str, random_kv: bool = False) -> Engine:
    cfg = EngineConfig(model=model, dtype="bfloat16", load_format="dummy", device="cpu", attention_backend="cpu",
                       block_size=16, max_model_len=2100, max_num_seqs=32, max_num_batched_tokens=2048,
                       num_kv_blocks=32 * 130 + 8, shares_device=False)
    engine = Engine.create(cfg, (f"{tag}-{os.getpid()}-w", f"{tag}-{os.getpid()}-kv"))
    if random_kv:
        for chunk in engine.runner.kv_pool.view(-1).split(2**28):
            chunk.normal_(0.0, 1.0)
    return engine


def ab_decode(engine: Engine, shapes: list[tuple[int, int]], variants: dict, rounds: int, steps: int) -> dict:
    """{(batch, context, name): the median over rounds of each round's median step ms}; variants: name -> a function
    that puts that variant in place."""
    res = {}
    for rnd in range(rounds):
        for name in (list(variants) if rnd % 2 == 0 else list(variants)[::-1]):
            variants[name]()
            for batch, context in shapes:
                blocks = Blocks(engine.num_kv_blocks, 16)
                inputs = [StepInput([1], context, blocks.table(context + 1)) for _ in range(batch)]
                greedy_step(engine, inputs)
                ts = []
                for _ in range(steps):
                    t = time.perf_counter(); greedy_step(engine, inputs); ts.append((time.perf_counter() - t) * 1e3)
                res.setdefault((batch, context, name), []).append(statistics.median(ts))
    return {key: statistics.median(v) for key, v in res.items()}
