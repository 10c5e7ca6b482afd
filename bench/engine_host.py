"""`python -m bench.engine_host`: where an eager step's host time goes, per kind of op, and its
device time per kernel.

The engine is built as `ppd bench engine` builds it (Llama-3.1-8B's configuration with random
weights on a GPU). After warm-up, three eager steps run under torch.profiler (CPU activities, and
CUDA's on a GPU): a decode step (32 sequences at context 1K), an append of 256 new tokens over 4K
cached, and `ppd bench engine`'s mixed step (64 decodes at context 1K beside that append). Each
step's host time, until it is queued on the device, is split by what it was spent in, an op counted
once at its outermost:
- triton: each Triton launch, by kernel (its launcher's Python included), whether through the JIT or
  relaunched by the step's Launches (engine/kernels/launch.py) after the first layer;
- gemm: aten's matmuls (cuBLAS on a GPU);
- alloc: aten::empty and its kin;
- copy: aten::copy_, to, clone, contiguous and the runtime's memcpy calls;
- other ops: every other op the profiler sees;
- outside ops: Python between ops (the engine's own host code, and on the CPU its ctypes kernels).
  The profiler's own cost inflates every share, so the same steps are also timed without it
  ("plain"), as `ppd bench engine` times them. On a GPU each step's device time is also listed per
  kernel, each kernel once and grouped (bench/device_time.py), with its GEMMs by weight shape; then
  the runner captures its CUDA graphs and one replay of each step is profiled the same way, where
  the profiler sees the graph's kernels. On the CPU (gpu_check's rehearsal) the steps run on the
  CPU's attention backend (Triton runs there only in its interpreter), with no device table and no
  graphs. Results: OUT/engine-host.{json,md}, written after each step.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity, profile, record_function

from bench import device_time
from bench.engine import (
    Grid,
    device_slug,
    engine_config,
    model_folder,
    run_meta,
    start_engine,
    write_results,
)
from engine.config import ModelConfig
from engine.engine import Engine, device_info
from engine.model_runner import StepInput
from engine.step_timing import (
    Blocks,
    add_model_args,
    chosen_device,
    chosen_model,
    release_engine,
    sync_device,
    time_step,
)
from profiles import results_dir

STEP = "ppd::step"  # the profiler range around the step's forward
TRITON = "triton::"  # prefix of the range around each launch through a step's Launches
# prefix of the range around each launch through the JIT (inside the first, or alone)
TRITON_JIT = "triton-jit::"
RANGES = (STEP, TRITON, TRITON_JIT)
GEMM = {
    "aten::linear",
    "aten::matmul",
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::_scaled_mm",
    "mkldnn::_linear_pointwise",
}  # the last: torch's linear on the CPU
ALLOC = {
    "aten::empty",
    "aten::empty_strided",
    "aten::empty_like",
    "aten::new_empty",
    "aten::new_empty_strided",
}
COPY = {
    "aten::copy_",
    "aten::to",
    "aten::_to_copy",
    "aten::clone",
    "aten::contiguous",
    "aten::index_select",
}
LAUNCH = {
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
}  # device launches
KINDS = ("triton", "gemm", "alloc", "copy", "other ops", "outside ops")
COUNTS = ("triton", "triton relaunched", "gemm", "alloc", "copy", "device launches")
TOP_OTHERS = 8  # "other ops" named in the report
NO_GRAPH_NODES = "graph nodes not visible to the profiler"


@dataclass(frozen=True)
class Shapes:
    decode: tuple[int, int]  # (sequences, context)
    append: tuple[int, int]  # (new tokens, cached tokens)
    mixed: tuple[
        int, int, int, int
    ]  # (decodes, their context, the append's new tokens, its cached)


FULL = Shapes(
    decode=(32, 1024), append=(256, 4096), mixed=(64, 1024, 256, 4096)
)  # as `ppd bench engine`'s GPU grid
QUICK = Shapes(decode=(4, 64), append=(16, 128), mixed=(4, 64, 16, 128))


@dataclass
class StepHost:
    """One eager step's host time: under the profiler, split by kind, and without it; and its device
    time."""

    step: str
    shape: dict
    host_ms: float  # under the profiler, until the step was queued
    per_layer_ms: float
    by_kind_ms: dict[str, float]  # KINDS -> ms; sums to host_ms
    triton_ms: dict[str, float]  # kernel -> ms of its launches
    counts: dict[str, int]  # COUNTS -> per step (device launches: the runtime's, CUDA only)
    device_ms: float | None  # CUDA: the step's kernels and copies on the device, each once, summed
    plain_host_ms: float  # without the profiler: median host time
    plain_ms: (
        float  # without the profiler: median wall time, the sampler's copy to the host included
    )
    triton_launches: dict[str, int] = field(default_factory=dict)  # kernel -> launches
    other_ms: dict[str, float] = field(
        default_factory=dict
    )  # the costliest ops of no kind -> their own ms
    device: dict | None = None  # CUDA: device_time.DeviceTime of the step


def kind_of(name: str) -> str | None:
    if name.startswith((TRITON, TRITON_JIT)):
        return "triton"
    if name in GEMM:
        return "gemm"
    if name in ALLOC:
        return "alloc"
    if name in COPY or name.startswith("cudaMemcpy"):
        return "copy"
    return None


def kernel_of(name: str) -> str:
    """The kernel a Triton range is named for."""
    return name.split("::", 1)[1]


@dataclass
class Split:
    """A step's host time (us) by kind, its Triton launches and other ops by name, and its counts of
    ops."""

    host_us: float
    by_kind: Counter
    triton_us: Counter  # kernel -> us
    triton_launches: Counter  # kernel -> launches
    other_us: Counter  # op of no kind -> its own us
    counts: Counter  # COUNTS -> how many


def step_range(events: list[FunctionEvent]) -> FunctionEvent:
    """The profile's last STEP range (on the CPU: its device-side copy is an annotation)."""
    steps = [e for e in events if e.name == STEP and e.device_type == torch.autograd.DeviceType.CPU]
    if not steps:
        raise RuntimeError(f"the profile has no {STEP} range")
    return steps[-1]


def split_host_time(events: list[FunctionEvent]) -> Split:
    """The last STEP range's host time: each op's time goes to the outermost op of a kind; an op of
    no kind keeps its own time as "other ops"; what no op covers is "outside ops". A count is an
    op with no ancestor of its kind (linear -> matmul -> mm is one GEMM; the allocation inside mm
    is one allocation; a launch through Launches and the JIT's range inside it are one launch,
    relaunched when it has no JIT range inside)."""
    step = step_range(events)
    split = Split(0.0, Counter({k: 0.0 for k in KINDS}), Counter(), Counter(), Counter(), Counter())
    by_kind, counts = split.by_kind, split.counts

    def span(e: FunctionEvent) -> float:
        return e.time_range.elapsed_us()

    def visit(e: FunctionEvent, above: frozenset[str]) -> None:
        """above: the kinds of e's ancestors in the step."""
        kind = kind_of(e.name)
        if (
            kind and kind not in above and "triton" not in above
        ):  # ops inside a launch are the interpreter's
            counts[kind] += 1
            if kind == "triton":
                split.triton_launches[kernel_of(e.name)] += 1
                if e.name.startswith(TRITON) and not any(
                    c.name.startswith(TRITON_JIT) for c in e.cpu_children
                ):
                    counts["triton relaunched"] += 1
        if not above and kind:
            by_kind[kind] += span(e)
            if kind == "triton":
                split.triton_us[kernel_of(e.name)] += span(e)
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
    # By time, not by nesting: the runtime's calls may be recorded on another thread id than the
    # ops'.
    inside = step.time_range
    counts["device launches"] = sum(
        1
        for e in events
        if e.name in LAUNCH
        and inside.start <= e.time_range.start
        and e.time_range.end <= inside.end
    )
    return split


def _name(kernel) -> str:
    return getattr(getattr(kernel, "fn", None), "__name__", None) or getattr(
        kernel, "__name__", "kernel"
    )


@contextlib.contextmanager
def triton_ranges():
    """While open, each Triton launch runs inside a profiler range named for its kernel:
    triton::<kernel> around each call of a step's Launches (engine/kernels/launch.py), which after a
    step's first layer relaunches the compiled kernel without the JIT, and triton-jit::<kernel>
    around each launch through the JIT (compiled or interpreted). The classes are put back on
    leaving: the unprofiled path runs as it was."""
    saved = []
    with contextlib.suppress(ImportError):
        from engine.kernels.launch import Launches

        saved.append((Launches, "__call__", TRITON))
    with contextlib.suppress(ImportError):
        from triton.runtime.jit import JITFunction

        saved.append((JITFunction, "run", TRITON_JIT))
    with contextlib.suppress(ImportError):
        from triton.runtime.interpreter import InterpretedFunction

        saved.append((InterpretedFunction, "run", TRITON_JIT))
    saved = [
        (cls, attr, prefix, cls.__dict__[attr])
        for cls, attr, prefix in saved
        if attr in cls.__dict__
    ]

    def ranged(call, prefix: str, launches: bool):
        def launch(self, *args, **kwargs):
            with record_function(prefix + _name(args[0] if launches else self)):
                return call(self, *args, **kwargs)

        return launch

    for cls, attr, prefix, call in saved:
        setattr(cls, attr, ranged(call, prefix, attr == "__call__"))
    try:
        yield
    finally:
        for cls, attr, _, call in saved:
            setattr(cls, attr, call)


def profiled(
    engine: Engine, inputs: list[StepInput], cuda: bool, record_shapes: bool = False
) -> list[FunctionEvent]:
    """The events of one step's forward (in a STEP range) and the wait for it, under
    torch.profiler."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=record_shapes) as prof:
        with record_function(STEP):
            engine.runner.forward(inputs)
        sync_device(engine.device)
    return prof.events()


def profile_step(
    engine: Engine,
    name: str,
    shape: dict,
    inputs: list[StepInput],
    cuda: bool,
    weights: dict[tuple[int, int], str],
    repeat: int = 10,
) -> StepHost:
    """Time the step eagerly without the profiler (it warms up), then profile it twice: the first
    run (which pays the profiler's own start-up) records shapes and gives the device table, the
    second the host split."""
    plain_ms, plain_host = time_step(engine, inputs, repeat, graphs=False)
    runner = engine.runner
    saved, runner.graphs = runner.graphs, None
    try:
        with triton_ranges():
            shaped = profiled(engine, inputs, cuda, record_shapes=cuda)
            events = profiled(engine, inputs, cuda)
    finally:
        runner.graphs = saved
    split = split_host_time(events)
    device = device_time.device_time(shaped, step_range(shaped), weights, RANGES) if cuda else None
    return StepHost(
        name,
        shape,
        host_ms=split.host_us / 1000,
        per_layer_ms=split.host_us / 1000 / engine.mcfg.num_layers,
        by_kind_ms={k: split.by_kind[k] / 1000 for k in KINDS},
        triton_ms={k: us / 1000 for k, us in split.triton_us.most_common()},
        counts={k: split.counts[k] for k in COUNTS},
        device_ms=device.sum_ms if device else None,
        plain_host_ms=plain_host,
        plain_ms=plain_ms,
        triton_launches=dict(split.triton_launches),
        other_ms={k: us / 1000 for k, us in split.other_us.most_common(TOP_OTHERS)},
        device=asdict(device) if device else None,
    )


def profile_replay(
    engine: Engine, name: str, shape: dict, inputs: list[StepInput], repeat: int = 10
) -> dict:
    """The step replayed from the runner's graph that fits it: timed without the profiler, then one
    replay's device time per kernel (none where the profiler shows no kernel of the graph)."""
    runner = engine.runner
    found = {"step": name, "shape": shape}
    if runner.graphs is None:
        return {**found, "skipped": "no CUDA graphs on this device/backend"}
    bucket = runner.graphs.bucket_for(runner.make_batch(inputs))
    if bucket is None:
        return {**found, "skipped": "no captured graph fits this step"}
    plain_ms, plain_host = time_step(engine, inputs, repeat, graphs=True)
    events = profiled(engine, inputs, cuda=True)
    device = device_time.device_time(events, step_range(events), ranges=RANGES)
    found.update(
        graph=f"decode batch {bucket.seqs}"
        if bucket.decode
        else f"{bucket.tokens} tokens, {bucket.seqs} sequences",
        plain_ms=plain_ms,
        plain_host_ms=plain_host,
    )
    if device.kernels == 0:
        return {**found, "device": None, "why": NO_GRAPH_NODES}
    return {**found, "device": asdict(device)}


def weight_names(cfg: ModelConfig) -> dict[tuple[int, int], str]:
    """(N, K) of each weight a GEMM multiplies by -> its name (fused or not; names of one shape
    joined by /)."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    names: dict[tuple[int, int], str] = {}
    for name, n, k in (
        ("qkv", q + 2 * kv, h),
        ("q", q, h),
        ("k/v", kv, h),
        ("o", h, q),
        ("gate_up", 2 * inter, h),
        ("gate/up", inter, h),
        ("down", h, inter),
        ("lm_head", cfg.vocab_rows, h),
    ):
        names[(n, k)] = f"{names[(n, k)]}/{name}" if (n, k) in names else name
    return names


def run(
    model: str,
    device: torch.device,
    shapes: Shapes = FULL,
    dtype: str = "auto",
    attention_backend: str = "auto",
    on_step: Callable[[dict], None] | None = None,
) -> dict:
    """The report; on_step(report so far) after each step (a step that takes the process down leaves
    the others)."""
    folder = model_folder(model)
    (batch, context), (new, cached) = shapes.decode, shapes.append
    grid = Grid(
        batches=(batch,),
        contexts=(context,),
        prompts=(),
        appends=((new, cached),),
        mixed=(shapes.mixed,),
        prefill_tokens=0,
        repeat=1,
    )
    cfg = engine_config(folder, device, grid, dtype, attention_backend, eager=True, exact_pool=True)
    engine = start_engine(cfg)
    try:
        cuda = device.type == "cuda"
        steps = [
            (
                name,
                shape,
                step_inputs(name, shape, Blocks(engine.num_kv_blocks, engine.plan.block_size)),
            )
            for name, shape in (
                ("decode", {"batch": batch, "context": context}),
                ("append", {"new": new, "cached": cached}),
                ("mixed", dict(zip(("decodes", "context", "new", "cached"), shapes.mixed))),
            )
        ]
        report = {
            "device": device_info(device).name,
            "device_type": device.type,
            "model": os.path.basename(folder.rstrip("/")),
            "layers": ModelConfig.from_folder(folder).num_layers,
            "dtype": str(engine.runner.kv_pool.dtype).split(".")[-1],
            "attention_backend": engine.runner.backend.name,
            "profiled": [
                a.name for a in [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            ],
            "meta": run_meta(engine, cfg),
            "steps": [],
            "replays": [],
        }
        weights = weight_names(engine.mcfg)
        for name, shape, inputs in steps:
            report["steps"].append(asdict(profile_step(engine, name, shape, inputs, cuda, weights)))
            if on_step:
                on_step(report)
        if cuda and engine.runner.backend.supports_cuda_graphs:
            started = time.monotonic()
            engine.runner.capture_graphs(cfg.max_num_seqs, max_tokens=cfg.max_graph_tokens)
            report["meta"]["graph_capture_s"] = round(time.monotonic() - started, 2)
        for name, shape, inputs in steps:
            try:
                report["replays"].append(profile_replay(engine, name, shape, inputs))
            except (
                RuntimeError
            ) as exc:  # the profiler and graphs: a finding, and the other replays still run
                report["replays"].append(
                    {"step": name, "shape": shape, "skipped": f"failed: {exc}"[:300]}
                )
            if on_step:
                on_step(report)
        return report
    finally:
        release_engine(engine)


def step_inputs(name: str, shape: dict, blocks: Blocks) -> list[StepInput]:
    """A step's inputs, each sequence on blocks of its own: decode (batch x context), append (new
    over cached), or mixed (decodes at context beside one append of new over cached)."""

    def decodes(n: int, context: int) -> list[StepInput]:
        return [StepInput([1], context, blocks.table(context + 1)) for _ in range(n)]

    def append(new: int, cached: int) -> list[StepInput]:
        return [StepInput([1] * new, cached, blocks.table(new + cached))]

    if name == "decode":
        return decodes(shape["batch"], shape["context"])
    if name == "append":
        return append(shape["new"], shape["cached"])
    return decodes(shape["decodes"], shape["context"]) + append(shape["new"], shape["cached"])


def markdown(report: dict) -> str:
    steps = report["steps"]
    names = [f"{s['step']} ({', '.join(f'{k} {v}' for k, v in s['shape'].items())})" for s in steps]
    lines = [
        f"# Eager step host time and device time per kernel: {report['model']} on "
        f"{report['device']}",
        "",
        f"Attention backend `{report['attention_backend']}`, {report['layers']} layers, profiled "
        "with "
        f"torch.profiler ({', '.join(report['profiled'])} activities), one step each after "
        "warm-up. Host time is "
        "until the step is queued on the device; each op's time goes to its outermost op of a "
        "kind; "
        "`outside ops` is Python between ops (on the CPU also its ctypes kernels). The profiler "
        "inflates every "
        "share: `plain` is the same step timed without it, as `ppd bench engine` does.",
        "",
        "| host ms | " + " | ".join(names) + " |",
        "| --- |" + " ---: |" * len(steps),
    ]

    def row(label: str, values: list[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(values) + " |")

    for kind in KINDS:
        row(
            kind,
            [
                f"{s['by_kind_ms'][kind]:.3f} ({s['by_kind_ms'][kind] / s['host_ms']:.0%})"
                for s in steps
            ],
        )
    row("**total, profiled**", [f"**{s['host_ms']:.3f}**" for s in steps])
    row("per layer, profiled", [f"{s['per_layer_ms']:.3f}" for s in steps])
    row("**total, plain** (median)", [f"**{s['plain_host_ms']:.3f}**" for s in steps])
    row("wall, plain (median)", [f"{s['plain_ms']:.3f}" for s in steps])
    if any(s["device_ms"] is not None for s in steps):
        row("device (kernels + copies, each once)", [f"{s['device_ms']:.3f}" for s in steps])
    lines += ["", "| per step | " + " | ".join(names) + " |", "| --- |" + " ---: |" * len(steps)]
    for key, label in (
        ("triton", "Triton launches"),
        ("triton relaunched", "of them relaunched (Launches)"),
        ("gemm", "GEMMs"),
        ("alloc", "allocations"),
        ("copy", "copies"),
        ("device launches", "device launches (runtime)"),
    ):
        row(label, [str(s["counts"].get(key, 0)) for s in steps])
    kernels = sorted(
        {k for s in steps for k in s["triton_ms"]},
        key=lambda k: -max(s["triton_ms"].get(k, 0) for s in steps),
    )
    if kernels:
        lines += [
            "",
            "| Triton kernel: launches, host ms | " + " | ".join(names) + " |",
            "| --- |" + " ---: |" * len(steps),
        ]
        for k in kernels:
            row(
                f"`{k}`",
                [
                    f"{s['triton_launches'].get(k, 0)}, {s['triton_ms'].get(k, 0):.3f}"
                    for s in steps
                ],
            )
    others = sorted(
        {k for s in steps for k in s["other_ms"]},
        key=lambda k: -max(s["other_ms"].get(k, 0) for s in steps),
    )
    if others:
        lines += [
            "",
            f"| other ops (the {TOP_OTHERS} costliest of each step), own host ms | "
            + " | ".join(names)
            + " |",
            "| --- |" + " ---: |" * len(steps),
        ]
        for k in others:
            row(f"`{k}`", [f"{s['other_ms'][k]:.3f}" if k in s["other_ms"] else "" for s in steps])
    return "\n".join(lines + [""] + device_markdown(report)) + "\n"


def device_markdown(report: dict) -> list[str]:
    """The device tables: each eager step, then each graph replay."""
    lines = ["## Device time per kernel", ""]
    if report["device_type"] != "cuda":
        return lines + ["No CUDA activity on this device: no device table, no graph replays."]
    columns = [(f"eager {s['step']}", s["device"], "") for s in report["steps"]]
    columns += [
        (f"graph {r['step']}", r.get("device"), r.get("skipped") or r.get("why") or "")
        for r in report.get("replays", [])
    ]
    lines += [
        "Each kernel, copy and memset of the step once (bench/device_time.py): not the device-side "
        "copies of "
        "the profiler's ranges around them, which made the old device total count the step's "
        "kernels twice "
        "or more. A cell: device ms (share of the kernels' sum), kernels. The shares are of the "
        "per-kernel "
        "sum; busy is the union of their intervals (overlapping kernels once), span from the first "
        "start to "
        "the last end (an eager step's gaps between host-bound launches included). GEMMs by "
        "weight: the "
        "outermost aten GEMM op's shape (record_shapes) and the kernels the profiler linked to it; "
        "in a graph "
        "replay no op runs on the host, so none.",
        "",
    ]
    itemsize = getattr(torch, report.get("dtype", "bfloat16"), torch.bfloat16).itemsize
    lines += device_time.markdown(columns, itemsize)
    replays = [r for r in report.get("replays", []) if "plain_ms" in r]
    if replays:
        lines += [
            "",
            "| graph replay | graph | wall, plain (median) | host, plain (median) |",
            "| --- | --- | ---: | ---: |",
        ]
        lines += [
            f"| {r['step']} | {r['graph']} | {r['plain_ms']:.3f} | {r['plain_host_ms']:.3f} |"
            for r in replays
        ]
    if "graph_capture_s" in report["meta"]:
        lines += [
            "",
            f"Graphs captured after the eager steps in {report['meta']['graph_capture_s']} s.",
        ]
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.engine_host", description=__doc__.split("\n")[0]
    )
    add_model_args(p)
    p.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "cpu", "triton"],
        help="auto: triton on CUDA, cpu on the CPU",
    )
    p.add_argument(
        "--out",
        default=None,
        help="folder for engine-host.{json,md} (default: $PPD_RESULTS_DIR, else ./ppd-results, "
        "/<device>)",
    )
    p.add_argument("--quick", action="store_true", help="small shapes (what the tests run)")
    args = p.parse_args(argv)
    device = chosen_device(args)
    out = Path(args.out or results_dir() / device_slug(device))

    def write(report: dict) -> tuple[Path, Path]:
        return write_results(out, "engine-host", report, markdown(report))

    report = run(
        chosen_model(args, device),
        device,
        QUICK if args.quick else FULL,
        args.dtype,
        args.attention_backend,
        on_step=write,
    )
    json_path, md_path = write(report)
    print(markdown(report))
    print(f"written to {json_path} and {md_path}")


if __name__ == "__main__":
    main()
