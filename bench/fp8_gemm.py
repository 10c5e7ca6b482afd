"""`python -m bench.fp8_gemm --out DIR [--sms N] [--rehearse]`: FP8 linear layers
(engine/kernels/fp8.py) against bfloat16's F.linear at Llama-3.1-8B's four weight shapes (qkv
4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096; bench/gemm_shares.py's
model_shapes) and M from 1 to 512 rows.

Columns: `bf16` (F.linear, cuBLAS); `fp8 channel` (fp8_linear, W8A8 with a scale per output row:
the quantizer, then torch._scaled_mm's row-wise scaling on a Hopper); `fp8 channel triton` (the same
weight through the Triton GEMM, fp8_gemm: the path float16 and odd shapes take); `fp8 block128`
(fp8_linear over 128-column groups, DeepSeek-style block checkpoints: the Triton GEMM); `w8a16
channel` (activations left in bfloat16). Each fp8 cell also checks its output against float64 math
on the same e4m3 operands (max error over max |result|; bfloat16's rounding alone is up to 2^-8
of a value).

Timing: each cell a CUDA graph of back-to-back calls cycling through copies of the weight (so none
is read from L2), replayed on the stream (bench/gemm_shares.py's captured_ms); the median replay.
With --sms N the stream is a green context's of N SMs (partition/green.py). Floors: memory = the
bytes a call must move (weight with its scales, x, the output) over --bandwidth-gbs; compute = its
FLOPs over the dense tensor-core rate of its dot (bf16 or fp8), scaled to the share's SMs.
--rehearse runs tiny shapes on the CPU (the kernels under Triton's interpreter, timed by the host
clock), to prove the script before a GPU runs it. Writes DIR/fp8-gemm.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.gemm_shares import MODEL, Shape, captured_ms, model_shapes
from partition.green import GreenError, StreamSplits

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
BLOCK = 128  # a block checkpoint's group
H200_BANDWIDTH_GBS = 4800.0
H200_TFLOPS = {"bf16": 989.0, "fp8": 1979.0}  # dense tensor-core rates (SXM)
ROTATE_BYTES = 256 << 20  # weights cycled through: five times an H200's 50 MB L2
LOOP_BYTES = 4 << 30  # bytes one captured loop moves: about a millisecond
MAX_REPS = 256
# Llama-3.1-8B's over 64 (gate_up's N and down's K over 128), with groups of 32 (the last of down's
# K ragged), so that every path of the kernels runs
REHEARSAL_SHAPES = [
    Shape("qkv", 96, 64),
    Shape("o", 64, 64),
    Shape("gate_up", 224, 64),
    Shape("down", 64, 112),
]
REHEARSAL_ROWS = (1, 3)
REHEARSAL_BLOCK = 32


@dataclass(frozen=True)
class Variant:
    """One column: the weight's format and the call that multiplies it."""

    name: str
    group: int | None  # None: bfloat16; 0: one group (a scale per output row)
    activations: str = "dynamic"
    triton: bool = False  # fp8_gemm rather than fp8_linear

    @property
    def dot(self) -> str:
        return "fp8" if self.group is not None and self.activations == "dynamic" else "bf16"


@dataclass
class Cell:
    shape: str
    m: int
    variant: str
    ms: float | None = None
    memory_ms: float = 0.0
    compute_ms: float = 0.0
    error: float | None = None  # max |out - float64| / max |float64|
    failure: str = ""


def variants(block: int) -> list[Variant]:
    return [
        Variant("bf16", None),
        Variant("fp8 channel", 0),
        Variant("fp8 channel triton", 0, triton=True),
        Variant(f"fp8 block{block}", block),
        Variant("w8a16 channel", 0, "none"),
    ]


def call_bytes(shape: Shape, m: int, v: Variant) -> int:
    """What one call must move: the weight (and its float32 scales), x and the output in bf16."""
    if v.group is None:
        weight = 2 * shape.n * shape.k
    else:
        weight = shape.n * shape.k + 4 * shape.n * (math.ceil(shape.k / v.group) if v.group else 1)
    return weight + 2 * m * (shape.k + shape.n)


def floors(shape: Shape, m: int, v: Variant, gbs: float, tflops: dict[str, float]) -> tuple:
    """(memory floor, compute floor) in ms."""
    return call_bytes(shape, m, v) / gbs / 1e6, 2 * m * shape.n * shape.k / tflops[v.dot] / 1e9


def make_weight(w: torch.Tensor, v: Variant) -> Any:
    """w [N, K] bfloat16 in v's format."""
    from engine.quant import Fp8Weight, quantize

    if v.group is None:
        return w
    group = v.group or w.shape[1]
    data, scale = quantize(w, group)
    return Fp8Weight(data, scale, group, v.activations)


def layer(v: Variant) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    from engine.kernels.fp8 import fp8_gemm, fp8_linear

    if v.group is None:
        return F.linear
    return fp8_gemm if v.triton else fp8_linear


def max_error(out: torch.Tensor, x: torch.Tensor, w: Any) -> float:
    """out against float64 math on the operands the kernels multiply (x quantized as the
    quantizer does for W8A8)."""
    from engine.quant import expand_scale, quantize

    k = x.shape[1]
    if w.activations == "dynamic":
        xq, xs = quantize(x, w.group)
        xd = xq.double() * expand_scale(xs, w.group, k).double()
    else:
        xd = x.double()
    exact = xd @ (w.data.double() * expand_scale(w.scale, w.group, k).double()).T
    return ((out.double() - exact).abs().max() / exact.abs().max()).item()


def measure(
    shapes: list[Shape],
    rows: tuple[int, ...],
    columns: list[Variant],
    timer: Callable[[Callable[[int], object], int], float] | None,
    device: str,
    gbs: float,
    tflops: dict[str, float],
    rotate_bytes: int = ROTATE_BYTES,
) -> list[Cell]:
    """Every (shape, M, column): its time, floors and error; a failure is recorded, not raised.
    timer(call(i), reps): ms of a call, calls cycling through copies of the weight (rotate_bytes
    of them at least); None: the host time of the first call (the rehearsal's clock: no GPU)."""
    gen = torch.Generator(device).manual_seed(0)
    cells = []
    for shape in shapes:
        base = torch.randn(shape.n, shape.k, generator=gen, device=device) / shape.k**0.5
        base = base.to(torch.bfloat16)
        for v in columns:
            w0 = make_weight(base, v)
            size = call_bytes(shape, 0, v)
            weights = [w0] + [make_weight(base, v) for _ in range(-(-rotate_bytes // size) - 1)]
            fn = layer(v)
            for m in rows:
                x = torch.randn(m, shape.k, generator=gen, device=device).to(torch.bfloat16)
                cell = Cell(shape.label, m, v.name)
                cell.memory_ms, cell.compute_ms = floors(shape, m, v, gbs, tflops)
                reps = min(MAX_REPS, max(8, LOOP_BYTES // call_bytes(shape, m, v)))
                try:
                    started = time.perf_counter()
                    out = fn(x, w0)
                    cell.ms = (time.perf_counter() - started) * 1e3
                    if v.group is not None:
                        cell.error = max_error(out, x, w0)
                    if timer is not None:
                        cell.ms = timer(lambda i, x=x, ws=weights: fn(x, ws[i % len(ws)]), reps)
                except Exception as exc:  # noqa: BLE001 - a cell that fails is a finding
                    cell.failure = f"{type(exc).__name__}: {exc}"
                cells.append(cell)
                print(
                    f"{shape.label:20s} M={m:<4d} {v.name:20s} "
                    + (f"{cell.ms:.4f} ms" if cell.ms is not None else cell.failure),
                    flush=True,
                )
            del weights, w0
    return cells


def markdown(meta: dict[str, Any], columns: list[Variant], cells: list[Cell]) -> str:
    """One row per shape and M: each column's ms and x its floor (the larger of memory and
    compute); then the largest error per shape and column."""
    lines = [
        f"# FP8 linear layers against bfloat16: {meta['device']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}, {meta['sms']}. Floors: bytes over "
        f"{meta['bandwidth_gbs']:,.0f} GB/s, FLOPs over "
        + ", ".join(f"{t:,.0f} ({dot})" for dot, t in meta["tflops"].items())
        + f" TFLOP/s. {meta['timing']}",
        "",
        "Each cell: ms per call (x its floor).",
        "",
        "| shape | M | " + " | ".join(c.name for c in columns) + " |",
        "|---|---:|" + "---:|" * len(columns),
    ]
    by_key = {(c.shape, c.m, c.variant): c for c in cells}
    shapes = list(dict.fromkeys(c.shape for c in cells))
    rows = list(dict.fromkeys(c.m for c in cells))
    for shape in shapes:
        for m in rows:
            row = []
            for v in columns:
                c = by_key[shape, m, v.name]
                floor = max(c.memory_ms, c.compute_ms)
                row.append("failed" if c.ms is None else f"{c.ms:.4f} ({c.ms / floor:.1f}x)")
            lines.append(f"| {shape} | {m} | " + " | ".join(row) + " |")
    fp8 = [v for v in columns if v.group is not None]
    lines += [
        "",
        "Largest error over M (max |out - float64| / max |float64|, the same e4m3 operands):",
        "",
        "| shape | " + " | ".join(v.name for v in fp8) + " |",
        "|---|" + "---:|" * len(fp8),
    ]
    for shape in shapes:
        errors = []
        for v in fp8:
            found = [by_key[shape, m, v.name].error for m in rows]
            known = [e for e in found if e is not None]
            errors.append(f"{max(known):.1e}" if len(known) == len(found) else "failed")
        lines.append(f"| {shape} | " + " | ".join(errors) + " |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> dict[str, Any]:
    import triton

    tflops = {"bf16": args.bf16_tflops, "fp8": args.fp8_tflops}
    if args.rehearse:
        shapes, rows, block, device = REHEARSAL_SHAPES, REHEARSAL_ROWS, REHEARSAL_BLOCK, "cpu"
        columns = variants(block)
        cells = measure(shapes, rows, columns, None, device, args.bandwidth_gbs, tflops, 0)
        name, sms, timing = "CPU rehearsal (Triton's interpreter)", "all cores", "Host clock."
    else:
        shapes, rows, columns = model_shapes(args.model), ROWS, variants(BLOCK)
        name = torch.cuda.get_device_name()
        total = torch.cuda.get_device_properties(0).multi_processor_count
        splits, sms, stream = None, f"{total} SMs", torch.cuda.Stream()
        if args.sms:
            splits = StreamSplits.green([args.sms])
            key = next(k for k in splits.keys if splits.sms("decode", k) == args.sms)
            stream, sms = splits.stream("decode", key), f"a green context of {args.sms} SMs"
            tflops = {k: t * args.sms / total for k, t in tflops.items()}
        try:
            cells = measure(
                shapes,
                rows,
                columns,
                lambda fn, reps: captured_ms(stream, fn, reps, args.replays),
                "cuda",
                args.bandwidth_gbs,
                tflops,
            )
        finally:
            torch.cuda.synchronize()
            if splits is not None:
                splits.destroy()
        timing = "CUDA graphs of back-to-back calls over rotating weights, median replay."
    meta = {
        "device": name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "sms": sms,
        "bandwidth_gbs": args.bandwidth_gbs,
        "tflops": tflops,
        "timing": timing,
    }
    return {
        **meta,
        "shapes": [asdict(s) for s in shapes],
        "rows": list(rows),
        "columns": [asdict(v) for v in columns],
        "cells": [asdict(c) for c in cells],
        "markdown": markdown(meta, columns, cells),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fp8_gemm", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for fp8-gemm.json and .md")
    p.add_argument("--model", default=str(MODEL), help="a model folder whose config gives shapes")
    p.add_argument("--sms", type=int, default=0, help="run on a green context of this many SMs")
    p.add_argument(
        "--bandwidth-gbs",
        type=float,
        default=H200_BANDWIDTH_GBS,
        help="memory bandwidth for the floors (default the H200's 4800)",
    )
    p.add_argument(
        "--bf16-tflops",
        type=float,
        default=H200_TFLOPS["bf16"],
        help="dense bf16 tensor-core TFLOP/s of the whole device (default H200's)",
    )
    p.add_argument(
        "--fp8-tflops",
        type=float,
        default=H200_TFLOPS["fp8"],
        help="dense fp8 tensor-core TFLOP/s of the whole device (default H200's)",
    )
    p.add_argument("--replays", type=int, default=5, help="graph replays per cell (median)")
    p.add_argument(
        "--rehearse",
        action="store_true",
        help="tiny shapes on the CPU under Triton's interpreter: proves the script",
    )
    args = p.parse_args(argv)
    if args.rehearse:  # read when a kernel is decorated: before engine.kernels is imported
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        print("bench.fp8_gemm needs a CUDA GPU (or --rehearse); none is visible.", file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        result = run(args)
    except (GreenError, ValueError) as exc:  # no green context of --sms SMs: says why
        print(f"bench.fp8_gemm: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fp8-gemm.md").write_text(result.pop("markdown"))
    (args.out / "fp8-gemm.json").write_text(json.dumps(result, indent=1) + "\n")
    print((args.out / "fp8-gemm.md").read_text())
    print(f"wrote {args.out}/fp8-gemm.{{json,md}} in {time.monotonic() - started:.0f} s")
    failed = [c for c in result["cells"] if c["ms"] is None]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
