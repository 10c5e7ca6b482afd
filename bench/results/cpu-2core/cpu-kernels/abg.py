"""A/B in one process: engine decode steps with bfloat16 linears of few rows in cpu_gemv.c up to FEW_ROWS rows, for
each limit given, against oneDNN for all. Usage: python abg.py MODEL ROUNDS LIMIT [LIMIT ...]."""
import sys
from ab_decode import ab_decode, decode_engine
from engine.attention import cpu_linear

model, rounds, limits = sys.argv[1], int(sys.argv[2]), [0] + [int(a) for a in sys.argv[3:]]
shapes = [(1, 256), (1, 2048), (2, 1024), (3, 1024), (4, 1024)]
engine = decode_engine(model, "abg")


def use(limit):
    def put() -> None:
        cpu_linear.FEW_ROWS = limit
    return put


ms = ab_decode(engine, shapes, {limit: use(limit) for limit in limits}, rounds, steps=9)
for batch, context in shapes:
    base = ms[(batch, context, 0)]
    cells = ", ".join(f"up to {l} rows {ms[(batch, context, l)] / base:.3f}x" for l in limits[1:])
    print(f"decode batch {batch}, context {context}: oneDNN {base:.2f} ms; {cells}")
