"""`ppd profile partition`'s command line: its flags, the grid they choose, and the run that writes
the profile and its report (what is measured: partition/profiler.py)."""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import torch

from engine.demo import DEMO_MODEL, demo_model_path
from engine.engine import device_info
from engine.step_timing import LLAMA_8B, add_model_args, chosen_device
from partition.cpu import available_cores
from partition.green import SM_GRANULARITY
from partition.profile import profile_path
from partition.profile_report import markdown, plot
from partition.profiler import (
    BLOCK_SIZE,
    Bench,
    Grid,
    ProfilerError,
    cpu_grid,
    engine_setup,
    file_out,
    gpu_grid,
    profile,
)
from partition.profiler_cpu import CpuBench
from partition.profiler_gpu import GpuBench, sm_carveout_available
from profiles import cpu_device_name, model_name, user_profiles_dir


def add_partition_args(p: argparse.ArgumentParser) -> None:
    """The flags of `ppd profile partition`."""
    add_model_args(p)
    p.add_argument(
        "--out",
        default=None,
        help="the profile (default: $PPD_CACHE_DIR/profiles/<device>__<model>.json, "
        "which ppd serve reads before the shipped profiles); a folder: that "
        "file name in it",
    )
    p.add_argument(
        "--quick", action="store_true", help="a small grid (the CPU demo: under 2 minutes)"
    )
    p.add_argument(
        "--shares",
        default=None,
        help="comma list of shares: cores on the CPU, SMs on a GPU (multiples "
        "of 8)" + _defaults("shares"),
    )
    p.add_argument(
        "--batches", default=None, help="comma list of decode batch sizes" + _defaults("batches")
    )
    p.add_argument(
        "--contexts",
        default=None,
        help="comma list of decode context lengths (tokens)" + _defaults("contexts"),
    )
    p.add_argument(
        "--prompts",
        default=None,
        help="comma list of prefill prompt lengths (tokens)" + _defaults("prompts"),
    )
    p.add_argument(
        "--new-tokens",
        type=int,
        default=None,
        help="tokens of each prefill beside decode: a full prompt, or new tokens appended over its "
        "context" + _defaults("new_tokens"),
    )
    p.add_argument(
        "--steps", type=int, default=None, help="timed decode steps per point" + _defaults("steps")
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="passes over the grid, a point's figure the median of its rounds"
        + _defaults("rounds"),
    )
    p.add_argument(
        "--gemm-tokens",
        type=int,
        default=None,
        help="GPU: rows of a prefill GEMM timed on each share alone and with cuBLAS's SM carveout "
        "set to "
        "the SMs outside the share, where torch can set it; 0: not timed"
        + _defaults("gemm_tokens"),
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _busy_cores(seconds: float = 1.0) -> float:
    """Cores kept busy over the next `seconds` (Linux's /proc/stat): work beside the profile skews
    it."""

    def sample() -> tuple[int, int]:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(ticks), ticks[3] + ticks[4]  # all, idle + iowait

    total0, idle0 = sample()
    time.sleep(seconds)
    total1, idle1 = sample()
    return round((os.cpu_count() or 1) * (1 - (idle1 - idle0) / max(1, total1 - total0)), 2)


def _defaults(name: str) -> str:
    def text(grid: Grid) -> str:
        value = getattr(grid, name)
        return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)

    cores = len(available_cores())
    return (
        f" (default: CPU {text(cpu_grid(cores, False))}, H100 {text(gpu_grid(132, False))}; "
        "--quick: CPU "
        f"{text(cpu_grid(cores, True))}, H100 {text(gpu_grid(132, True))})"
    )


def choose_grid(args: argparse.Namespace, gpu: bool, total: int) -> Grid:
    """The grid the flags ask for on a device of `total` cores or SMs; ProfilerError naming the fix
    for one it cannot run."""
    base = (gpu_grid if gpu else cpu_grid)(total, args.quick)
    try:
        lists = {
            name: tuple(int(x) for x in value.split(","))
            for name in ("shares", "batches", "contexts", "prompts")
            if (value := getattr(args, name)) is not None
        }
    except ValueError as exc:
        raise ProfilerError(
            f"bad grid list: {exc}; expected e.g. --shares 1,2 --batches 1,8 --contexts 128,512"
        ) from exc
    gemm_tokens = base.gemm_tokens if args.gemm_tokens is None else args.gemm_tokens
    if gemm_tokens and not gpu:
        raise ProfilerError(
            "--gemm-tokens times cuBLAS on a GPU's SM shares; on the CPU leave it out"
        )
    if gemm_tokens and not sm_carveout_available():
        if args.gemm_tokens:
            raise ProfilerError(
                f"--gemm-tokens: torch {torch.__version__} cannot set cuBLAS's SM carveout "
                "(torch._C._set_sm_carveout_experimental); leave it out"
            )
        gemm_tokens = 0
    grid = replace(
        base,
        **lists,
        new_tokens=args.new_tokens or base.new_tokens,
        steps=args.steps or base.steps,
        rounds=args.rounds or base.rounds,
        gemm_tokens=gemm_tokens,
    )
    for name in ("shares", "batches", "contexts", "prompts"):
        values = getattr(grid, name)
        if not values or list(values) != sorted(set(values)) or values[0] < 1:
            raise ProfilerError(
                f"--{name} must be distinct, increasing and positive, not "
                f"{','.join(map(str, values))}"
            )
    if grid.shares[-1] > total:
        raise ProfilerError(f"--shares go up to {total} {'SMs' if gpu else 'cores'} on this device")
    if gpu and any(s % SM_GRANULARITY and s != total for s in grid.shares):
        raise ProfilerError(
            f"--shares on a GPU are multiples of {SM_GRANULARITY} SMs (or all {total})"
        )
    return grid


def main(args: argparse.Namespace) -> None:
    """Measure the grid on this device (resuming an interrupted run), then write the profile and its
    report."""
    gpu = chosen_device(args).type == "cuda"
    # --model demo (and no --model on the CPU): the built-in demo model, as everywhere else --model
    # is taken
    folder = str(
        demo_model_path()
        if args.model == DEMO_MODEL or (args.model is None and not gpu)
        else args.model or LLAMA_8B
    )
    model = model_name(folder)  # as ppd serve looks it up: the demo is "demo-v2"
    if gpu:
        cuda = torch.device("cuda")
        device, total = (
            device_info(cuda).name,
            torch.cuda.get_device_properties(cuda).multi_processor_count,
        )
    else:
        device, total = cpu_device_name(), len(available_cores())
    grid = choose_grid(args, gpu, total)
    out = file_out(args.out, profile_path(device, model, user_profiles_dir()))
    print(f"profiling {model} on {device} into {out}", file=sys.stderr)
    cfg, decode_blocks = engine_setup(folder, grid, "cuda" if gpu else "cpu", args.dtype)
    meta = {
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join(["ppd", *sys.argv[1:]]),
        "settings": {
            "model": args.model or ("demo" if not gpu else str(LLAMA_8B)),
            "dtype": args.dtype,
            "block_size": BLOCK_SIZE,
            "kv_blocks": cfg.num_kv_blocks,
        },
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host_cpus": os.cpu_count(),
        "notes": "concurrent prefills run as one batched prefill step, repeated while decode is "
        "timed; "
        "decode_share == prefill_share == total: both on the whole device (time-sliced)",
    }
    if not gpu:
        meta["busy_cores_at_start"] = busy = _busy_cores()
        if busy > 0.2:
            print(f"other work keeps {busy:.1f} cores busy: it skews the timings", file=sys.stderr)
    started = time.monotonic()
    bench: Bench = GpuBench(cfg, decode_blocks) if gpu else CpuBench(cfg, decode_blocks)
    meta["decode_graphs"] = bench.decode_graphs
    try:
        result = profile(bench, grid, out, device, model, meta, not args.no_progress)
    finally:
        bench.close()
    out.with_suffix(".md").write_text(markdown(result))
    plot(result, out.with_suffix(".png"))
    print(markdown(result))
    print(f"written {out} (+ .md, .png) in {time.monotonic() - started:.0f}s", file=sys.stderr)
