"""A/B in one process: engine decode steps with RoPE in our kernel (CpuOps) or in PyTorch's ops (TorchOps).
Usage: python abr.py MODEL [ROUNDS]."""
import sys
from ab_decode import ab_decode, decode_engine
from engine.attention import cpu_linear
from engine.ops import TorchOps

model, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5
ropes = {"kernel": cpu_linear.CpuOps.__dict__["apply_rope"], "torch": staticmethod(TorchOps.apply_rope)}
shapes = [(1, 1024), (8, 1024), (32, 1024)]
engine = decode_engine(model, "abr")


def use(name):
    def put() -> None:
        cpu_linear.CpuOps.apply_rope = ropes[name]
    return put


ms = ab_decode(engine, shapes, {name: use(name) for name in ropes}, rounds, steps=9)
for batch, context in shapes:
    a, b = ms[(batch, context, "torch")], ms[(batch, context, "kernel")]
    print(f"decode batch {batch}, context {context}: RoPE in torch {a:.2f} ms, in the kernel {b:.2f} ms, ratio {b / a:.3f}")
