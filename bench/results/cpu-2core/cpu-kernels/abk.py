"""A/B in one process: engine decode steps with the attention kernels built from a git revision's sources (A) or
the working tree's (B). Usage: python abk.py MODEL REV [ROUNDS]."""
import sys
from ab_decode import ab_decode, decode_engine, kernels_at

model, rev, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 5
old_lib, new_lib = kernels_at(rev)
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
