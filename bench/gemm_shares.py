"""`python -m bench.gemm_shares --out DIR [--quick]`: decode's GEMMs on the whole GPU and on
green-context shares of its SMs, each with and without cuBLAS's SM count target, beside what each
share's memory system and tensor cores can do.

Until CUDA 13.3 cuBLAS's heuristics ignore a green context: inside one of 64 SMs a GEMM may still
take the tile grid it would take on all 132 and end in a starved last wave. This measures it per
GEMM. The shapes are the model's four weight shapes as engine/model.py multiplies them (q, k and v
fused into one weight, gate and up into one; from the model folder's config.json, Llama-3.1-8B's by
default), at M = 1, 16, 64, 256 and 320 rows, in bfloat16, through torch.nn.functional.linear as
TritonOps.linear calls it. Each runs, per share (the whole GPU on an ordinary stream, and
green-context streams of 96 and 64 SMs made as a one-process unit makes them, StreamSplits.green),
in up to four variants (columns):
- `N`: torch's default BLAS library, as the engine runs today;
- `N +target`: the same with torch._C._set_sm_carveout_experimental(total - N): torch hands the
  target to cuBLASLt only (its cuBLAS path, cublasGemmEx, takes no SM count), so this column shows
  whether it reaches the default path;
- `N Lt`: cuBLASLt (torch.backends.cuda.preferred_blas_library), no target;
- `N Lt+target`: cuBLASLt with the target: what `ppd serve --cublas-sm-target` captures
  (engine/cuda_graphs.py). The settings are made before the GEMM's first call on that share and put
  back after its timing; torch reads the carveout at every call and builds cuBLASLt's descriptor
  with it, so nothing torch caches keeps an earlier choice (cuBLASLt keeps a heuristics cache of its
  own, presumably keyed by the whole descriptor, target included; where the kernel pass below finds
  the target changed nothing, --no-heuristics-cache runs with that cache off, to tell a target
  masked by the cache from one that changes no choice).

Timing: each GEMM is captured as a CUDA graph of back-to-back launches on the share's own stream (a
graph keeps the partition of the stream it was captured on; triton.testing.do_bench_cudagraph
captures on a new ordinary stream, which would drop it) and replayed there; the host clock brackets
each replay and its stream sync, the loop is long enough (a few ms) that launch and wake-up cost
under a few percent, and the median replay over its launches is the GEMM's time. The launches cycle
through copies of the weight (at least ROTATE_BYTES), so no weight is read from L2.

Floors, per share and measured on its stream in the same run: read bandwidth (a row-wise sum over a
1 GiB bfloat16 tensor, a grid of many waves so no SM count matters), copy bandwidth (read + write of
512 MiB through an elementwise kernel, for comparison with other figures), and the bf16 matmul rate
(8192^3). A GEMM's floor is the larger of its bytes (weight, input and output, each once) over the
read bandwidth and its FLOPs over the matmul rate; each cell is ms and x its floor.

Then one pass under torch.profiler names the kernel cuBLAS chose for each cell, so "did the target
change the algorithm" is read, not inferred. Results: OUT/gemm-shares.{json,md}. Without CUDA it
reads the shapes, prints them, says there is nothing to measure and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine.config import ModelConfig

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "bench" / "models" / "llama-3.1-8b"
ROWS = (1, 16, 64, 256, 320)
QUICK_ROWS = (1, 64, 320)
SHARES = (96, 64)
DT = torch.bfloat16
DEVICE = "cuda"
ROTATE_BYTES = (
    256 << 20
)  # weights cycled through in a loop: five times an H100's or H200's 50 MB L2
LOOP_BYTES = 6 << 30  # bytes one captured loop moves: a few ms at 2-4 TB/s
MAX_REPS = 512
READ_BYTES = 1 << 30
READ_ROW = (
    8192  # elements each output of the read kernel sums: 131,072 outputs, many waves on any share
)
MATMUL_N = 8192


@dataclass(frozen=True)
class Shape:
    """One weight of a layer: y [M, n] = x [M, k] @ w [n, k]^T."""

    name: str
    n: int
    k: int

    @property
    def label(self) -> str:
        return f"{self.name} {self.k}->{self.n}"


@dataclass(frozen=True)
class Variant:
    """One column: the share (its SMs), the BLAS library (None: torch's default) and the carveout
    (None: unset)."""

    name: str
    sms: int
    library: str | None
    carveout: int | None


@dataclass(frozen=True)
class Share:
    """What one share's stream measured: the floors of its GEMMs."""

    name: str
    sms: int
    read_gbps: float
    copy_gbps: float
    matmul_tflops: float


@dataclass
class Cell:
    shape: str
    m: int
    variant: str
    ms: float | None  # None: it failed (error says why)
    floor_ms: float | None = None
    error: str = ""


def model_shapes(folder: str | Path = MODEL) -> list[Shape]:
    """The four weights of a layer as engine/model.py multiplies them: qkv (q, k and v stacked), o,
    gate_up (gate and up stacked), down."""
    cfg = ModelConfig.from_folder(folder)
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return [
        Shape("qkv", q + 2 * kv, h),
        Shape("o", h, q),
        Shape("gate_up", 2 * cfg.intermediate_size, h),
        Shape("down", h, cfg.intermediate_size),
    ]


def gemm_bytes(shape: Shape, m: int, itemsize: int = 2) -> int:
    """Bytes a GEMM must move once: its weight and input read, its output written."""
    return (shape.n * shape.k + m * shape.k + m * shape.n) * itemsize


def gemm_flops(shape: Shape, m: int) -> int:
    return 2 * m * shape.n * shape.k


def floor_ms(shape: Shape, m: int, share: Share) -> float:
    """The GEMM's least time on share: its bytes over the read bandwidth, or its FLOPs over the
    matmul rate."""
    memory = gemm_bytes(shape, m) / (share.read_gbps * 1e9)
    return max(memory, gemm_flops(shape, m) / (share.matmul_tflops * 1e12)) * 1e3


def variants(total: int, shares: Sequence[int]) -> list[Variant]:
    """The columns: the whole device with the default library and with cuBLASLt (a target of every
    SM is no target), then for each share the default library and cuBLASLt, each without and with
    the carveout total - share."""
    columns = [
        Variant(f"{total}", total, None, None),
        Variant(f"{total} Lt", total, "cublaslt", None),
    ]
    for sms in shares:
        columns += [
            Variant(f"{sms}", sms, None, None),
            Variant(f"{sms} +target", sms, None, total - sms),
            Variant(f"{sms} Lt", sms, "cublaslt", None),
            Variant(f"{sms} Lt+target", sms, "cublaslt", total - sms),
        ]
    return columns


def kernel_changes(
    kernels: dict[str, list[str]],
    shapes: Sequence[Shape],
    rows: Sequence[int],
    shares: Sequence[int],
) -> list[dict[str, Any]]:
    """Per shape and M, for each share and library: whether the target changed the kernel cuBLAS
    chose (True, False, or None where either was not seen). Keys of kernels: label(shape, m,
    variant name)."""
    out = []
    for shape in shapes:
        for m in rows:
            row: dict[str, Any] = {"shape": shape.label, "m": m}
            for sms in shares:
                pairs = (
                    ("Lt", f"{sms} Lt", f"{sms} Lt+target"),
                    ("default", f"{sms}", f"{sms} +target"),
                )
                for lib, plain, target in pairs:
                    a, b = kernels.get(label(shape, m, plain)), kernels.get(label(shape, m, target))
                    row[f"{sms} {lib}"] = None if not a or not b else a != b
            out.append(row)
    return out


def label(shape: Shape, m: int, variant: str) -> str:
    return f"{shape.name}|{m}|{variant}"


def markdown(
    meta: dict[str, Any],
    shares: Sequence[Share],
    columns: Sequence[Variant],
    shapes: Sequence[Shape],
    rows: Sequence[int],
    cells: Sequence[Cell],
    changes: Sequence[dict[str, Any]] | None,
) -> str:
    """The report: the shares' floors, then one row per shape and M with each column's ms and x its
    floor, then whether the target changed the kernel."""
    lines = [
        f"# cuBLAS on green-context shares: {meta['device']}",
        "",
        f"torch {meta['torch']}, CUDA {meta['cuda']}, default BLAS library {meta['default_blas']}; "
        f"{meta['total_sms']} SMs; cuBLASLt heuristics cache capacity: "
        f"{meta.get('heuristics_cache_capacity', 'not recorded')}. {meta['timing']}",
        "",
    ]
    if meta.get("green_error"):
        lines += [f"No green contexts ({meta['green_error']}): the whole device only.", ""]
    lines += [
        "| share | SMs | read GB/s | copy GB/s (read + write) | bf16 matmul TFLOP/s |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {s.name} | {s.sms} | {s.read_gbps:,.0f} | {s.copy_gbps:,.0f} | {s.matmul_tflops:,.0f} |"
        for s in shares
    ]
    lines += [
        "",
        "Each cell: ms per GEMM (x its floor on that share: bytes / read bandwidth or FLOPs / "
        "matmul rate, "
        "the larger). `+target`: cuBLAS told the share's SMs (the carveout); `Lt`: through "
        "cuBLASLt.",
        "",
        "| shape | M | " + " | ".join(c.name for c in columns) + " |",
        "|---|---:|" + "---:|" * len(columns),
    ]
    by_key = {(c.shape, c.m, c.variant): c for c in cells}
    for shape in shapes:
        for m in rows:
            row = []
            for col in columns:
                c = by_key.get((shape.label, m, col.name))
                if c is None or c.ms is None:
                    row.append("failed" if c is not None else "")
                else:
                    row.append(
                        f"{c.ms:.4f}" + (f" ({c.ms / c.floor_ms:.2f}x)" if c.floor_ms else "")
                    )
            lines.append(f"| {shape.label} | {m} | " + " | ".join(row) + " |")
    if changes:
        keys = [k for k in changes[0] if k not in ("shape", "m")]
        mark = {True: "changed", False: "same", None: "?"}
        lines += [
            "",
            "Did the target change the kernel cuBLAS chose (`Lt`: `N Lt` against `N Lt+target`; "
            "`default`: "
            "`N` against `N +target`)?",
            "",
            "| shape | M | " + " | ".join(keys) + " |",
            "|---|---:|" + "---|" * len(keys),
        ]
        lines += [
            f"| {r['shape']} | {r['m']} | " + " | ".join(mark[r[k]] for k in keys) + " |"
            for r in changes
        ]
    return "\n".join(lines) + "\n"


# ---- on the GPU ----------------------------------------------------------------------------------


@contextlib.contextmanager
def blas(library: str | None, carveout: int | None) -> Iterator[None]:
    """Within: GEMMs through library (None: as they are) with the SM carveout (None: unset); both
    put back after."""
    before = torch.backends.cuda.preferred_blas_library(), torch._C._get_sm_carveout_experimental()
    try:
        if library is not None:
            torch.backends.cuda.preferred_blas_library(library)
        torch._C._set_sm_carveout_experimental(carveout)
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before[0])
        torch._C._set_sm_carveout_experimental(before[1])


def captured_ms(stream: Any, launch: Callable[[int], object], reps: int, replays: int) -> float:
    """ms of one launch(i): a CUDA graph of launch(0..reps-1) captured on stream and replayed there,
    the median over replays of (host time of a replay and its stream sync) / reps. launch(0) runs
    once before, outside the graph."""
    # the inputs were made on the default stream: done before another stream reads them
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        launch(0)  # cuBLAS picks and loads its kernel here, not in the capture
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        for i in range(reps):
            launch(i)
    times = []
    with torch.cuda.stream(stream):
        graph.replay()
        stream.synchronize()
        for _ in range(replays):
            started = time.perf_counter()
            graph.replay()
            stream.synchronize()
            times.append(time.perf_counter() - started)
    del graph
    return statistics.median(times) * 1e3 / reps


def measure_share(name: str, sms: int, stream: Any, replays: int) -> Share:
    """The floors of a share, each timed on its stream."""
    x = torch.randn(READ_BYTES // 2, dtype=DT, device=DEVICE).view(-1, READ_ROW)
    read_ms = captured_ms(stream, lambda i, x=x: x.sum(dim=1), 4, replays)
    src = x.view(-1)[: x.numel() // 2]
    dst = torch.empty_like(src)
    # An elementwise kernel, not copy_: a contiguous copy_ is a cudaMemcpyAsync, which need not run
    # on the share's SMs.
    copy_ms = captured_ms(stream, lambda i, s=src, d=dst: torch.neg(s, out=d), 8, replays)
    del x, src, dst
    a, b = (torch.randn(MATMUL_N, MATMUL_N, dtype=DT, device=DEVICE) for _ in range(2))
    mm_ms = captured_ms(stream, lambda i: torch.matmul(a, b), 4, replays)
    return Share(
        name,
        sms,
        READ_BYTES / read_ms / 1e6,
        READ_BYTES / copy_ms / 1e6,
        2 * MATMUL_N**3 / mm_ms / 1e9,
    )


def time_cells(
    shapes: Sequence[Shape],
    rows: Sequence[int],
    columns: Sequence[Variant],
    streams: dict[int, Any],
    floors: dict[int, Share],
    replays: int,
) -> list[Cell]:
    """Every (shape, M, column)'s time on its share's stream; a failure is recorded, not raised."""
    cells = []
    for shape in shapes:
        weight = shape.n * shape.k * 2
        copies = max(2, -(-ROTATE_BYTES // weight))
        weights = [torch.randn(shape.n, shape.k, dtype=DT, device=DEVICE) for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, shape.k, dtype=DT, device=DEVICE)
            reps = min(MAX_REPS, max(8, math.ceil(LOOP_BYTES / gemm_bytes(shape, m))))
            for col in columns:
                cell = Cell(shape.label, m, col.name, None, floor_ms(shape, m, floors[col.sms]))
                try:
                    with blas(col.library, col.carveout):
                        cell.ms = captured_ms(
                            streams[col.sms],
                            lambda i, x=x, w=weights: F.linear(x, w[i % len(w)]),
                            reps,
                            replays,
                        )
                except Exception as exc:  # noqa: BLE001 - a column that fails is a finding; the others go on
                    cell.error = f"{type(exc).__name__}: {exc}"
                cells.append(cell)
            print(
                f"{shape.label:22s} M={m:<4d} "
                + " ".join(
                    f"{c.ms:.4f}" if c.ms is not None else "failed" for c in cells[-len(columns) :]
                ),
                flush=True,
            )
        del weights
    return cells


def kernel_names(
    shapes: Sequence[Shape],
    rows: Sequence[int],
    columns: Sequence[Variant],
    streams: dict[int, Any],
) -> dict[str, list[str]]:
    """The device kernels each (shape, M, column) launches: one eager call of each under
    torch.profiler, synced inside its labelled range."""
    from torch.profiler import ProfilerActivity, profile, record_function

    calls = []
    for shape in shapes:
        w = torch.randn(shape.n, shape.k, dtype=DT, device=DEVICE)
        for m in rows:
            calls += [
                (
                    label(shape, m, col.name),
                    col,
                    torch.randn(m, shape.k, dtype=DT, device=DEVICE),
                    w,
                )
                for col in columns
            ]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for name, col, x, w in calls:
            stream = streams[col.sms]
            with blas(col.library, col.carveout), record_function(name), torch.cuda.stream(stream):
                F.linear(x, w)
                stream.synchronize()
    wanted = {name for name, *_ in calls}
    ranges = [e for e in prof.events() if e.name in wanted]
    device = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    found = {}
    for e in ranges:
        names = _launched(e) or [
            d.name for d in device if e.time_range.start <= d.time_range.start <= e.time_range.end
        ]
        found[e.name] = names
    return found


def _launched(event: Any) -> list[str]:
    return [k.name for k in event.kernels] + [n for c in event.cpu_children for n in _launched(c)]


def run(folder: Path, shares: Sequence[int], rows: Sequence[int], replays: int) -> dict[str, Any]:
    from partition.green import WHOLE, GreenError, StreamSplits

    shapes = model_shapes(folder)
    total = torch.cuda.get_device_properties(0).multi_processor_count
    green_error = None
    try:
        splits = StreamSplits.green(shares)
    except (GreenError, ValueError) as exc:
        splits, green_error = StreamSplits.plain(), str(exc)
    try:
        streams = {total: splits.stream("decode", WHOLE)}
        streams |= {
            splits.sms("decode", k): splits.stream("decode", k) for k in splits.keys if k != WHOLE
        }
        floors = {
            sms: measure_share("whole" if sms == total else f"green {sms}", sms, stream, replays)
            for sms, stream in streams.items()
        }
        for s in floors.values():
            print(
                f"{s.name}: {s.sms} SMs, read {s.read_gbps:,.0f} GB/s, copy {s.copy_gbps:,.0f} "
                "GB/s, matmul "
                f"{s.matmul_tflops:,.0f} TFLOP/s",
                flush=True,
            )
        measured = [s for s in shares if s in streams]
        columns = variants(total, measured)
        cells = time_cells(shapes, rows, columns, streams, floors, replays)
        kernels, kernels_error = None, None
        try:
            kernels = kernel_names(shapes, rows, columns, streams)
        except Exception as exc:  # noqa: BLE001 - the timings stand without the names
            kernels_error = f"{type(exc).__name__}: {exc}"
    finally:
        torch.cuda.synchronize()
        splits.destroy()
    changes = kernel_changes(kernels, shapes, rows, measured) if kernels else None
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "default_blas": str(torch.backends.cuda.preferred_blas_library()).split(".")[-1],
        "total_sms": total,
        "green_error": green_error,
        "heuristics_cache_capacity": os.environ.get(
            "CUBLASLT_HEURISTICS_CACHE_CAPACITY", "cuBLASLt's default"
        ),
        "timing": "Times: CUDA graphs of back-to-back launches on each share's stream, median "
        "replay.",
    }
    return {
        **meta,
        "shares": [asdict(s) for s in floors.values()],
        "columns": [asdict(c) for c in columns],
        "shapes": [asdict(s) for s in shapes],
        "rows": list(rows),
        "cells": [asdict(c) for c in cells],
        "kernels": kernels,
        "kernels_error": kernels_error,
        "kernel_changes": changes,
        "markdown": markdown(meta, list(floors.values()), columns, shapes, rows, cells, changes),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.gemm_shares", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--out", type=Path, required=True, help="folder for gemm-shares.json and gemm-shares.md"
    )
    p.add_argument(
        "--model", default=str(MODEL), help="a model folder whose config.json gives the shapes"
    )
    p.add_argument(
        "--shares",
        default=",".join(map(str, SHARES)),
        help="green-context SM counts (default 96,64)",
    )
    p.add_argument("--quick", action="store_true", help=f"M in {QUICK_ROWS} only, fewer replays")
    p.add_argument(
        "--no-heuristics-cache",
        action="store_true",
        help="turn cuBLASLt's heuristics cache off (CUBLASLT_HEURISTICS_CACHE_CAPACITY=0): every "
        "call asks "
        "its heuristics afresh",
    )
    args = p.parse_args(argv)
    if (
        args.no_heuristics_cache
    ):  # read when cuBLASLt starts, which is after this (CUDA starts lazily)
        os.environ["CUBLASLT_HEURISTICS_CACHE_CAPACITY"] = "0"
    shapes = model_shapes(args.model)
    print(
        "shapes: " + ", ".join(f"{s.label} ({s.n * s.k * 2 / 2**20:.0f} MiB)" for s in shapes),
        flush=True,
    )
    if not torch.cuda.is_available():
        print("bench.gemm_shares needs a CUDA GPU; none is visible, nothing to measure.")
        return 0
    shares = tuple(int(s) for s in args.shares.split(","))
    started = time.monotonic()
    result = run(
        Path(args.model), shares, QUICK_ROWS if args.quick else ROWS, 3 if args.quick else 5
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemm-shares.md").write_text(result.pop("markdown"))
    (args.out / "gemm-shares.json").write_text(json.dumps(result, indent=1) + "\n")
    print((args.out / "gemm-shares.md").read_text())
    print(f"wrote {args.out}/gemm-shares.{{json,md}} in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
