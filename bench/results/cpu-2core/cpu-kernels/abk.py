"""A/B in one process: engine decode steps with the attention kernels built from a git revision's sources (A) or
the working tree's (B). Usage: python abk.py MODEL REV [ROUNDS]."""
import shutil, subprocess, sys, tempfile
from pathlib import Path
from ab_decode import ROOT, ab_decode, decode_engine
from engine.attention import cpu_kernel

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
engine = decode_engine(model, "abk", random_kv=True)


def use(lib):
    def put() -> None:
        engine.runner.backend.kernels = lib
    return put


ms = ab_decode(engine, shapes, {"A": use(old_lib), "B": use(new_lib)}, rounds, steps=7)
for batch, context in shapes:
    a, b = ms[(batch, context, "A")], ms[(batch, context, "B")]
    print(f"decode batch {batch}, context {context}: {rev} {a:.1f} ms, working tree {b:.1f} ms, ratio {b / a:.3f}")
