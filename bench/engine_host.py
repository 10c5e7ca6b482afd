"""`python -m bench.engine_host`: where an eager step's host time goes, per kind of op.

The engine is built as `ppd bench engine` builds it (Llama-3.1-8B's configuration with random weights on a GPU),
eager. After warm-up, one decode step (32 sequences at context 1K) and one append of 256 new tokens over 4K cached
run under torch.profiler (CPU activities, and CUDA's on a GPU), and each step's host time, until it is queued on
the device, is split by what it was spent in, an op counted once at its outermost:
- triton: each Triton kernel's launch, by kernel (its launcher's Python included);
- gemm: aten's matmuls (cuBLAS on a GPU);
- alloc: aten::empty and its kin;
- copy: aten::copy_, to, clone, contiguous and the runtime's memcpy calls;
- other ops: every other op the profiler sees;
- outside ops: Python between ops (the engine's own host code, and on the CPU its ctypes kernels).
The profiler's own cost inflates every share, so the same steps are also timed without it ("plain"), as
`ppd bench engine` times them. On the CPU (gpu_check's rehearsal) the step runs on the CPU's attention backend:
Triton runs there only in its interpreter. Results: OUT/engine-host.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity, profile, record_function

from bench.engine import Grid, device_slug, engine_config, model_folder, run_meta, start_engine, write_results
from engine.config import ModelConfig
from engine.engine import Engine, device_info
from engine.model_runner import StepInput
from engine.step_timing import (Blocks, add_model_args, chosen_device, chosen_model, release_engine, sync_device,
                                time_step)
from profiles import results_dir

STEP = "ppd::step"  # the profiler range around the step's forward
TRITON = "triton::"  # prefix of the range around each Triton launch
GEMM = {"aten::linear", "aten::matmul", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm",
        "mkldnn::_linear_pointwise"}  # the last: torch's linear on the CPU
ALLOC = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::new_empty_strided"}
COPY = {"aten::copy_", "aten::to", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::index_select"}
LAUNCH = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"}  # device launches
KINDS = ("triton", "gemm", "alloc", "copy", "other ops", "outside ops")
TOP_OTHERS = 8  # "other ops" named in the report


@dataclass(frozen=True)
class Shapes:
    decode: tuple[int, int]  # (sequences, context)
    append: tuple[int, int]  # (new tokens, cached tokens)


FULL = Shapes(decode=(32, 1024), append=(256, 4096))
QUICK = Shapes(decode=(4, 64), append=(16, 128))


@dataclass
class StepHost:
    """One step's host time: under the profiler, split by kind, and without it."""

    step: str
    shape: dict
    host_ms: float  # under the profiler, until the step was queued
    per_layer_ms: float
    by_kind_ms: dict[str, float]  # KINDS -> ms; sums to host_ms
    triton_ms: dict[str, float]  # kernel -> ms of its launches
    counts: dict[str, int]  # triton launches, gemms, allocations, copies, device launches (CUDA)
    device_ms: float | None  # CUDA: the step's kernels and copies on the device, summed
    plain_host_ms: float  # without the profiler: median host time
    plain_ms: float  # without the profiler: median wall time, the sampler's copy to the host included
    triton_launches: dict[str, int] = field(default_factory=dict)  # kernel -> launches
    other_ms: dict[str, float] = field(default_factory=dict)  # the costliest ops of no kind -> their own ms


def kind_of(name: str) -> str | None:
    if name.startswith(TRITON):
        return "triton"
    if name in GEMM:
        return "gemm"
    if name in ALLOC:
        return "alloc"
    if name in COPY or name.startswith("cudaMemcpy"):
        return "copy"
    return None


@dataclass
class Split:
    """A step's host time (us) by kind, its Triton launches and other ops by name, and its counts of ops."""

    host_us: float
    by_kind: Counter
    triton_us: Counter  # kernel -> us
    triton_launches: Counter  # kernel -> launches
    other_us: Counter  # op of no kind -> its own us
    counts: Counter  # kind -> ops of that kind; "device launches" -> the runtime's kernel launches


def split_host_time(events: list[FunctionEvent]) -> Split:
    """The last STEP range's host time: each op's time goes to the outermost op of a kind; an op of no kind keeps
    its own time as "other ops"; what no op covers is "outside ops". A count is an op with no ancestor of its kind
    (linear -> matmul -> mm is one GEMM; the allocation inside mm is one allocation)."""
    steps = [e for e in events if e.name == STEP and e.device_type == torch.autograd.DeviceType.CPU]
    if not steps:
        raise RuntimeError(f"the profile has no {STEP} range")
    step = steps[-1]
    split = Split(0.0, Counter({k: 0.0 for k in KINDS}), Counter(), Counter(), Counter(), Counter())
    by_kind, counts = split.by_kind, split.counts

    def span(e: FunctionEvent) -> float:
        return e.time_range.elapsed_us()

    def visit(e: FunctionEvent, above: frozenset[str]) -> None:
        """above: the kinds of e's ancestors in the step."""
        kind = kind_of(e.name)
        if kind and kind not in above and "triton" not in above:  # ops inside a launch are the interpreter's
            counts[kind] += 1
            if kind == "triton":
                split.triton_launches[e.name[len(TRITON):]] += 1
        if not above and kind:
            by_kind[kind] += span(e)
            if kind == "triton":
                split.triton_us[e.name[len(TRITON):]] += span(e)
        elif not above:
            own = span(e) - sum(span(c) for c in e.cpu_children)
            by_kind["other ops"] += own
            split.other_us[e.name] += own
        for child in e.cpu_children:
            visit(child, above | {kind} if kind else above)

    for child in step.cpu_children:
        visit(child, frozenset())
    by_kind["outside ops"] += span(step) - sum(span(c) for c in step.cpu_children)
    split.host_us = span(step)
    # By time, not by nesting: the runtime's calls may be recorded on another thread id than the ops'.
    inside = step.time_range
    counts["device launches"] = sum(1 for e in events if e.name in LAUNCH
                                    and inside.start <= e.time_range.start and e.time_range.end <= inside.end)
    return split


@contextlib.contextmanager
def triton_ranges():
    """While open, each Triton launch (compiled or interpreted) runs inside a profiler range triton::<kernel>."""
    classes = []
    with contextlib.suppress(ImportError):
        from triton.runtime.jit import JITFunction

        classes.append(JITFunction)
    with contextlib.suppress(ImportError):
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    saved = {cls: cls.__dict__["run"] for cls in classes if "run" in cls.__dict__}

    def ranged(run):
        def launch(self, *args, **kwargs):
            with record_function(TRITON + getattr(getattr(self, "fn", None), "__name__", "kernel")):
                return run(self, *args, **kwargs)
        return launch

    for cls, run in saved.items():
        cls.run = ranged(run)
    try:
        yield
    finally:
        for cls, run in saved.items():
            cls.run = run


def profile_step(engine: Engine, name: str, shape: dict, inputs: list[StepInput], cuda: bool,
                 repeat: int = 10) -> StepHost:
    """Time the step eagerly without the profiler (it warms up), then profile it twice and keep the second (the
    first pays the profiler's own start-up)."""
    plain_ms, plain_host = time_step(engine, inputs, repeat, graphs=False)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    runner = engine.runner
    saved, runner.graphs = runner.graphs, None
    try:
        with triton_ranges():
            for _ in range(2):
                with profile(activities=activities) as prof:
                    with record_function(STEP):
                        runner.forward(inputs)
                    sync_device(engine.device)
    finally:
        runner.graphs = saved
    events = prof.events()
    split = split_host_time(events)
    device_us = sum(e.time_range.elapsed_us() for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return StepHost(
        name, shape, host_ms=split.host_us / 1000, per_layer_ms=split.host_us / 1000 / engine.mcfg.num_layers,
        by_kind_ms={k: split.by_kind[k] / 1000 for k in KINDS},
        triton_ms={k: us / 1000 for k, us in split.triton_us.most_common()},
        counts={k: split.counts[k] for k in ("triton", "gemm", "alloc", "copy", "device launches")},
        device_ms=device_us / 1000 if cuda else None, plain_host_ms=plain_host, plain_ms=plain_ms,
        triton_launches=dict(split.triton_launches),
        other_ms={k: us / 1000 for k, us in split.other_us.most_common(TOP_OTHERS)})


def run(model: str, device: torch.device, shapes: Shapes = FULL, dtype: str = "auto",
        attention_backend: str = "auto") -> dict:
    folder = model_folder(model)
    (batch, context), (new, cached) = shapes.decode, shapes.append
    grid = Grid(batches=(batch,), contexts=(context,), prompts=(), appends=((new, cached),), mixed=(),
                prefill_tokens=0, repeat=1)
    cfg = engine_config(folder, device, grid, dtype, attention_backend, eager=True, exact_pool=True)
    engine = start_engine(cfg)
    try:
        blocks = Blocks(engine.num_kv_blocks, engine.plan.block_size)  # the two steps run apart: they may overlap
        decode = [StepInput([1], context, blocks.table(context + 1)) for _ in range(batch)]
        append = [StepInput([1] * new, cached, blocks.table(new + cached))]
        cuda = device.type == "cuda"
        steps = [profile_step(engine, "decode", {"batch": batch, "context": context}, decode, cuda),
                 profile_step(engine, "append", {"new": new, "cached": cached}, append, cuda)]
        return {"device": device_info(device).name, "device_type": device.type,
                "model": os.path.basename(folder.rstrip("/")), "layers": ModelConfig.from_folder(folder).num_layers,
                "attention_backend": engine.runner.backend.name, "profiled": [a.name for a in (
                    [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))],
                "meta": run_meta(engine, cfg), "steps": [asdict(s) for s in steps]}
    finally:
        release_engine(engine)


def markdown(report: dict) -> str:
    steps = report["steps"]
    names = [f"{s['step']} ({', '.join(f'{k} {v}' for k, v in s['shape'].items())})" for s in steps]
    lines = [f"# Eager step host time: {report['model']} on {report['device']}", "",
             f"Attention backend `{report['attention_backend']}`, {report['layers']} layers, profiled with "
             f"torch.profiler ({', '.join(report['profiled'])} activities), one step each after warm-up. Host time is "
             "until the step is queued on the device; each op's time goes to its outermost op of a kind; "
             "`outside ops` is Python between ops (on the CPU also its ctypes kernels). The profiler inflates every "
             "share: `plain` is the same step timed without it, as `ppd bench engine` does.", "",
             "| host ms | " + " | ".join(names) + " |", "| --- |" + " ---: |" * len(steps)]

    def row(label: str, values: list[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(values) + " |")

    for kind in KINDS:
        row(kind, [f"{s['by_kind_ms'][kind]:.3f} ({s['by_kind_ms'][kind] / s['host_ms']:.0%})" for s in steps])
    row("**total, profiled**", [f"**{s['host_ms']:.3f}**" for s in steps])
    row("per layer, profiled", [f"{s['per_layer_ms']:.3f}" for s in steps])
    row("**total, plain** (median)", [f"**{s['plain_host_ms']:.3f}**" for s in steps])
    row("wall, plain (median)", [f"{s['plain_ms']:.3f}" for s in steps])
    if any(s["device_ms"] is not None for s in steps):
        row("device (kernels + copies)", [f"{s['device_ms']:.3f}" for s in steps])
    lines += ["", "| per step | " + " | ".join(names) + " |", "| --- |" + " ---: |" * len(steps)]
    for key, label in (("triton", "Triton launches"), ("gemm", "GEMMs"), ("alloc", "allocations"),
                       ("copy", "copies"), ("device launches", "device launches (runtime)")):
        row(label, [str(s["counts"][key]) for s in steps])
    kernels = sorted({k for s in steps for k in s["triton_ms"]},
                     key=lambda k: -max(s["triton_ms"].get(k, 0) for s in steps))
    if kernels:
        lines += ["", "| Triton kernel: launches, host ms | " + " | ".join(names) + " |",
                  "| --- |" + " ---: |" * len(steps)]
        for k in kernels:
            row(f"`{k}`", [f"{s['triton_launches'].get(k, 0)}, {s['triton_ms'].get(k, 0):.3f}" for s in steps])
    others = sorted({k for s in steps for k in s["other_ms"]},
                    key=lambda k: -max(s["other_ms"].get(k, 0) for s in steps))
    if others:
        lines += ["", f"| other ops (the {TOP_OTHERS} costliest of each step), own host ms | " + " | ".join(names)
                  + " |", "| --- |" + " ---: |" * len(steps)]
        for k in others:
            row(f"`{k}`", [f"{s['other_ms'][k]:.3f}" if k in s["other_ms"] else "" for s in steps])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.engine_host", description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cpu", "triton"],
                   help="auto: triton on CUDA, cpu on the CPU")
    p.add_argument("--out", default=None, help="folder for engine-host.{json,md} (default: $PPD_RESULTS_DIR, else ./ppd-results, /<device>)")
    p.add_argument("--quick", action="store_true", help="small shapes (what the tests run)")
    args = p.parse_args(argv)
    device = chosen_device(args)
    report = run(chosen_model(args, device), device, QUICK if args.quick else FULL, args.dtype, args.attention_backend)
    out = Path(args.out or results_dir() / device_slug(device))
    md = markdown(report)
    json_path, md_path = write_results(out, "engine-host", report, md)
    print(md)
    print(f"written to {json_path} and {md_path}")


if __name__ == "__main__":
    main()
