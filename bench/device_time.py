"""A profiled step's device time per kernel (`python -m bench.engine_host`): each kernel, copy and
memset once, grouped by what it computes, and the GEMMs by weight shape.

torch.profiler lists a step's device work as FunctionEvents of device type CUDA: its kernels, copies
and memsets, and beside them a device-side copy of each record_function range around them (a
"gpu_user_annotation" from the first to the last kernel launched inside it). Summing every CUDA
event counts the step's kernels once more inside the ppd::step range, which spans the whole step,
and again inside each Triton launch's range: more than the step's kernels take. Here a device event
counts when it is a kernel, copy or memset (not an annotation), starts at or after the step's range
began (nothing of a warm-up; the sync after the step launches nothing) and is not the same event
listed twice (name, start, end, device and stream). The table's times are the per-event sums; the
busy time (the union of the events' intervals: kernels that overlap on several streams count once)
and the span (first start to last end, gaps between host-bound launches included) stand beside them.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

GROUPS = ("gemm", "attention", "merge", "norm", "rope-store", "silu", "other")
# Words of a kernel's name, first match wins: our Triton kernels (engine/kernels/*.py, and a fused
# kernel added later whose name has the same word), then cuBLAS's and CUTLASS's GEMMs (gemv at a few
# rows, split-K's reduction).
GROUP_WORDS = (
    ("merge", ("merge_splits",)),
    ("attention", ("attention", "fmha", "flash")),
    ("norm", ("rms_norm", "layer_norm")),
    ("rope-store", ("rope", "store_kv")),
    ("silu", ("silu", "act_and_mul")),
    ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "splitkreduce")),
)
WORK = {
    "kernel",
    "gpu_memcpy",
    "gpu_memset",
}  # activity types that are device work (torch >= 2.12 names them)
COPY_NAMES = ("Memcpy", "Memset")  # kineto's names of copies and memsets
GEMM_OPS = {
    "aten::linear",
    "aten::matmul",
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::_scaled_mm",
}
TOP_KERNELS = 15  # kernels named in the report


def group_of(name: str) -> str:
    low = name.lower()
    for group, words in GROUP_WORDS:
        if any(w in low for w in words):
            return group
    return "other"


@dataclass
class DeviceTime:
    """A step's device work, each kernel, copy and memset once."""

    kernels: int  # kernels counted
    copies: int  # copies and memsets counted
    sum_ms: float  # their durations summed: what the groups' shares are of
    busy_ms: float  # the union of their intervals
    span_ms: float  # from the first one's start to the last one's end
    groups: dict[str, dict]  # GROUPS -> {"count", "ms"}
    by_kernel: dict[str, dict]  # name -> {"group", "count", "ms"}, the TOP_KERNELS costliest
    all_events_ms: float = (
        0.0  # every CUDA event of the profile summed, annotations and all: the old device total
    )
    gemm_shapes: list[dict] = field(
        default_factory=list
    )  # {"weight", "m", "n", "k", "count", "ms", "kernel"}
    dropped: dict[str, int] = field(default_factory=dict)  # why events were not counted -> how many
    note: str | None = None


def _is_work(e: Any, ranges: tuple[str, ...]) -> bool:
    """A kernel, copy or memset: by its activity type where the profiler gives it, else not an
    annotation (by the flag, and by the names of the ranges the caller opened)."""
    kind = getattr(e, "activity_type", None)
    if kind:
        return kind in WORK
    return not getattr(e, "is_user_annotation", False) and not e.name.startswith(ranges)


def _is_copy(e: Any) -> bool:
    kind = getattr(e, "activity_type", None)
    return kind in ("gpu_memcpy", "gpu_memset") if kind else e.name.startswith(COPY_NAMES)


def step_work(
    events: list[Any], start_us: float, ranges: tuple[str, ...] = ()
) -> tuple[list[Any], Counter]:
    """The device work of a step whose range began at start_us, each event once, and what was
    dropped, by why."""
    kept, seen, dropped = [], set(), Counter()
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if not _is_work(e, ranges):
            dropped["annotations"] += 1
            continue
        if e.time_range.start < start_us:
            dropped["before the step"] += 1
            continue
        key = (
            e.name,
            e.time_range.start,
            e.time_range.end,
            getattr(e, "device_index", 0),
            getattr(e, "device_resource_id", 0),
        )
        if key in seen:
            dropped["duplicates"] += 1
            continue
        seen.add(key)
        kept.append(e)
    return kept, dropped


def union_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def gemm_shape(e: Any) -> tuple[int, int, int] | None:
    """(M, N, K) of a GEMM op from its recorded input shapes (record_shapes), or of the first op
    inside it that has them; None where none does."""
    shapes = [list(s) for s in (getattr(e, "input_shapes", None) or [])]
    if (
        e.name == "aten::linear"
        and len(shapes) >= 2
        and len(shapes[0]) >= 2
        and len(shapes[1]) == 2
    ):
        return math.prod(shapes[0][:-1]), shapes[1][0], shapes[1][1]
    operands = shapes[1:3] if e.name == "aten::addmm" else shapes[:2]
    if (
        e.name in ("aten::mm", "aten::matmul", "aten::addmm")
        and len(operands) == 2
        and all(len(s) == 2 for s in operands)
    ):
        return operands[0][0], operands[1][1], operands[0][1]
    for child in e.cpu_children:
        if found := gemm_shape(child):
            return found
    return None


def _kernels(e: Any) -> list[Any]:
    """The device kernels the profiler linked to e and the ops inside it."""
    return list(getattr(e, "kernels", [])) + [k for c in e.cpu_children for k in _kernels(c)]


def gemm_table(step: Any, weights: dict[tuple[int, int], str]) -> list[dict]:
    """The step's outermost GEMM ops by (weight, M, N, K): how many, their kernels' device time
    (through the profiler's link from an op to the kernels it launched) and their most frequent
    kernel. weights: (N, K) -> the weight's name."""
    found: dict[tuple, dict] = {}

    def visit(e: Any) -> None:
        if e.name not in GEMM_OPS:
            for child in e.cpu_children:
                visit(child)
            return
        m, n, k = gemm_shape(e) or (0, 0, 0)
        row = found.setdefault(
            (weights.get((n, k), ""), m, n, k), {"count": 0, "us": 0.0, "names": Counter()}
        )
        row["count"] += 1
        for kernel in _kernels(e):
            row["us"] += kernel.duration
            row["names"][kernel.name] += 1

    for child in step.cpu_children:
        visit(child)
    return [
        {
            "weight": w,
            "m": m,
            "n": n,
            "k": k,
            "count": r["count"],
            "ms": r["us"] / 1000,
            "kernel": r["names"].most_common(1)[0][0] if r["names"] else "",
        }
        for (w, m, n, k), r in sorted(found.items(), key=lambda kv: -kv[1]["us"])
    ]


def device_time(
    events: list[Any],
    step: Any,
    weights: dict[tuple[int, int], str] | None = None,
    ranges: tuple[str, ...] = (),
) -> DeviceTime:
    """The device work of the step whose CPU range is step (a FunctionEvent), from the profile's
    events; the GEMM shapes where weights is given (and the profiler recorded shapes). ranges: the
    names (prefixes) of the record_function ranges the caller opened, for a torch whose events carry
    no activity type."""
    work, dropped = step_work(events, step.time_range.start, ranges)
    groups = {g: {"count": 0, "ms": 0.0} for g in GROUPS}
    by_kernel: dict[str, dict] = {}
    for e in work:
        ms = e.time_range.elapsed_us() / 1000
        group = "other" if _is_copy(e) else group_of(e.name)
        groups[group]["count"] += 1
        groups[group]["ms"] += ms
        row = by_kernel.setdefault(e.name, {"group": group, "count": 0, "ms": 0.0})
        row["count"] += 1
        row["ms"] += ms
    copies = sum(1 for e in work if _is_copy(e))
    spans = [(e.time_range.start, e.time_range.end) for e in work]
    top = dict(sorted(by_kernel.items(), key=lambda kv: -kv[1]["ms"])[:TOP_KERNELS])
    found = DeviceTime(
        kernels=len(work) - copies,
        copies=copies,
        sum_ms=sum(g["ms"] for g in groups.values()),
        busy_ms=union_us(spans) / 1000,
        span_ms=(max(e for _, e in spans) - min(s for s, _ in spans)) / 1000 if spans else 0.0,
        groups=groups,
        by_kernel=top,
        dropped=dict(dropped),
        all_events_ms=sum(
            e.time_range.elapsed_us()
            for e in events
            if e.device_type == torch.autograd.DeviceType.CUDA
        )
        / 1000,
    )
    if weights is not None:
        found.gemm_shapes = gemm_table(step, weights)
        linked = sum(r["ms"] for r in found.gemm_shapes)
        if found.gemm_shapes and linked == 0 and groups["gemm"]["ms"] > 0:
            found.note = (
                "the profiler linked no GEMM kernel to its op: the shapes' times are missing"
            )
    return found


# ---- report --------------------------------------------------------------------------------------


def markdown(columns: list[tuple[str, dict | None, str]], itemsize: int) -> list[str]:
    """The device tables of the steps (columns: a label, a DeviceTime as a dict or None, why there
    is none)."""
    names = [label for label, _, _ in columns]
    lines = [
        "| device ms (share), count | " + " | ".join(names) + " |",
        "| --- |" + " ---: |" * len(columns),
    ]

    def row(label: str, cell) -> None:
        lines.append(
            f"| {label} | " + " | ".join(cell(d) if d else "" for _, d, _ in columns) + " |"
        )

    for g in GROUPS:
        row(
            g,
            lambda d, g=g: (
                f"{d['groups'][g]['ms']:.3f} ({d['groups'][g]['ms'] / d['sum_ms']:.0%}), "
                f"{d['groups'][g]['count']}"
                if d["sum_ms"]
                else ""
            ),
        )
    row(
        "**kernels + copies, summed**",
        lambda d: f"**{d['sum_ms']:.3f}**, {d['kernels']} + {d['copies']}",
    )
    row("busy (union of intervals)", lambda d: f"{d['busy_ms']:.3f}")
    row("span (first start to last end)", lambda d: f"{d['span_ms']:.3f}")
    row(
        "not counted",
        lambda d: ", ".join(f"{n} {why}" for why, n in d["dropped"].items()) or "none",
    )
    row("every CUDA event summed (the old total)", lambda d: f"{d['all_events_ms']:.3f}")
    lines.append(
        "| why none / note | "
        + " | ".join(why or (d or {}).get("note") or "" for _, d, why in columns)
        + " |"
    )
    kernels = sorted(
        {k for _, d, _ in columns if d for k in d["by_kernel"]},
        key=lambda k: -max(d["by_kernel"].get(k, {}).get("ms", 0) for _, d, _ in columns if d),
    )
    if kernels:
        lines += [
            "",
            f"| kernel (the {TOP_KERNELS} costliest of each step) | group | "
            + " | ".join(names)
            + " |",
            "| --- | --- |" + " ---: |" * len(columns),
        ]
        for k in kernels:
            group = next(
                d["by_kernel"][k]["group"] for _, d, _ in columns if d and k in d["by_kernel"]
            )
            cells = [
                f"{d['by_kernel'][k]['count']}, {d['by_kernel'][k]['ms']:.3f}"
                if d and k in d["by_kernel"]
                else ""
                for _, d, _ in columns
            ]
            lines.append(f"| `{_short(k)}` | {group} | " + " | ".join(cells) + " |")
    shapes = [(label, r) for label, d, _ in columns if d for r in d["gemm_shapes"]]
    if shapes:
        lines += [
            "",
            "| step | weight | M x N x K | GEMMs | device ms | us a GEMM | TFLOP/s | weight GB/s | "
            "kernel |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for label, r in shapes:
            each_s = r["ms"] / 1000 / r["count"] if r["count"] else 0
            known = each_s and r["m"]
            flops = f"{2 * r['m'] * r['n'] * r['k'] / each_s / 1e12:.1f}" if known else ""
            gbps = f"{r['n'] * r['k'] * itemsize / each_s / 1e9:.0f}" if known else ""
            shape = f"{r['m']} x {r['n']} x {r['k']}" if r["m"] else "not recorded"
            lines.append(
                f"| {label} | {r['weight']} | {shape} | {r['count']} | "
                f"{r['ms']:.3f} | {each_s * 1e6:.1f} | {flops} | {gbps} | `{_short(r['kernel'])}` |"
            )
    return lines


def _short(name: str, width: int = 72) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."
