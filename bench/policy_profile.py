"""`ppd profile policy`: the PPD policy's offline table (the paper's Algorithm 1), measured on a
running server.

For every cell of the grid (context x turn-2 shape x load) and for each route, it runs controlled
multi-turn traffic: closed-loop conversations of two turns, turn 1 of `context` tokens in all (input
+ output), turn 2 of the cell's shape, `load` conversations in flight, every append-prefill forced
to the route by the x-ppd-route request header. It records the turn-2 TTFT and TPOT (medians and
90th percentiles) and the prefill worker's mean queue delay (sampled from /metrics), then x* =
1[w_ttft * dTTFT - w_tpot * dTPOT > 0] per cell. After every run the table is written (atomically),
so an interrupted profile resumes where it stopped: runs already in the file are not repeated,
except those that measured nothing (no turn-2 request succeeded), which make the command exit 1,
each named with why. Output: $PPD_CACHE_DIR/profiles/<device>__<model>__policy.json, which `ppd
serve` reads before the shipped tables (see server/routing/policy_table.py for the schema), a
heatmap of x* beside it (.png), a markdown summary (.md) and the log of the server it starts
(.serve.log). The table is built from the runs beside its reader (PolicyTable.from_runs); what stays
here drives a server over HTTP with the benchmarks' load generator (bench/client.py, workloads.py,
servers.py), which is why this producer lives in bench/ while the partition profile's lives in
partition/.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import shlex
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import httpx
import numpy as np
from tqdm import tqdm

from bench.common import BenchError, fail_unless_measured
from bench.servers import (
    add_served_model_args,
    option_value,
    start_server,
    stop_server,
    with_model_args,
)
from partition.profiler import file_out, names_folder
from profiles import cpu_device_name, model_name, unit_device_name, user_profiles_dir
from server.routing.policy import DEFAULT_W_TPOT, DEFAULT_W_TTFT
from server.routing.policy_table import ROUTES, PolicyTable, TableError, run_key, table_path


@dataclass(frozen=True)
class Grid:
    contexts: tuple[int, ...]  # tokens cached when turn 2 arrives (turn 1's input + output)
    shapes: tuple[tuple[int, int], ...]  # turn 2's (new input tokens, output tokens)
    loads: tuple[int, ...]  # conversations in flight (closed loop) = requests in flight on the unit
    turn1_output: int
    duration: float  # seconds of traffic per run


# The CPU grids match the CPU demo evaluation (the synthetic workload at 1/8 scale); the GPU grid
# its full scale.
CPU_GRID = Grid((160, 544), ((8, 64), (32, 32), (128, 8)), (1, 3, 8), 32, 8.0)
QUICK_GRID = Grid((160, 544), ((8, 64), (32, 32), (128, 8)), (1, 4), 32, 3.0)
GPU_GRID = Grid((1280, 4352), ((64, 512), (256, 256), (1024, 64)), (4, 16, 64), 256, 30.0)
METRICS_INTERVAL_S = 0.2


def measure(
    url: str,
    model: str,
    context: int,
    shape: tuple[int, int],
    load: int,
    route: str,
    grid: Grid,
    seed: int,
) -> dict:
    """One run of one cell on one route: the summary the table keeps (times in ms)."""
    from bench.client import LoadConfig, run_load
    from bench.workloads import shaped

    first = (max(1, context - grid.turn1_output), grid.turn1_output)
    conversations = shaped(
        [[first, shape]],
        max(64, 8 * load),
        random.Random(seed),
        api="completions",
        id_prefix=f"profile-{seed}",
    )
    cfg = LoadConfig(
        base_url=url,
        model=model,
        api="completions",
        concurrency=load,
        duration=grid.duration,
        timeout=max(60.0, 10 * grid.duration),
        seed=seed,
        headers={"x-ppd-route": route},
    )
    sampler = QueueSampler(url)
    sampler.start()
    try:
        records = asyncio.run(run_load(cfg, conversations, progress=False))
    finally:
        queue_ms = sampler.stop()
    later = [r for r in records if r.turn >= 1 and r.success]
    ttft = [1000 * r.ttft for r in later if r.ttft is not None]
    tpot = [1000 * r.tpot for r in later if r.tpot is not None]
    return {
        "requests": len(records),
        "failed": sum(not r.success for r in records),
        "n": len(later),
        "ttft_p50_ms": _pct(ttft, 50),
        "ttft_p90_ms": _pct(ttft, 90),
        "tpot_p50_ms": _pct(tpot, 50),
        "tpot_p90_ms": _pct(tpot, 90),
        "queue_delay_ms": queue_ms,
        "routes": sorted({r.route for r in later if r.route}),
        "errors": dict(
            Counter((r.error or "")[:200] for r in records if not r.success).most_common(3)
        ),
    }


class QueueSampler:
    """Samples the prefill worker's queue delay (queued tokens over its speed) from /metrics while a
    run goes."""

    def __init__(self, url: str) -> None:
        self.url, self.samples, self.done = url, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> float:
        self.done.set()
        self.thread.join()
        return statistics.fmean(self.samples) if self.samples else 0.0

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self.done.wait(METRICS_INTERVAL_S):
                try:
                    values = _metrics(client.get(f"{self.url}/metrics").text)
                except httpx.HTTPError:
                    continue
                speed = values.get("ppd:prefill_tokens_per_second", 0.0)
                if speed > 0:
                    self.samples.append(1000 * values.get("ppd:prefill_queue_tokens", 0.0) / speed)


def measure_repeated(
    url: str,
    model: str,
    context: int,
    shape: tuple[int, int],
    load: int,
    route: str,
    grid: Grid,
    seed: int,
    repeat: int,
) -> dict:
    """`repeat` runs of one cell and route (distinct conversations): each statistic's median, the
    runs kept."""
    runs = [measure(url, model, context, shape, load, route, grid, seed + r) for r in range(repeat)]
    if repeat == 1:
        return runs[0]
    combined = {k: sum(run[k] for run in runs) for k in ("requests", "failed", "n")}
    for k in ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms", "queue_delay_ms"):
        values = [run[k] for run in runs if run[k] is not None]
        combined[k] = statistics.median(values) if values else None
    combined["routes"] = sorted({r for run in runs for r in run["routes"]})
    combined["errors"] = dict(sum((Counter(run.get("errors", {})) for run in runs), Counter()))
    combined["repeats"] = runs
    return combined


def profile(
    url: str,
    grid: Grid,
    out: Path,
    device: str,
    model: str,
    meta: dict,
    w_ttft: float,
    w_tpot: float,
    progress: bool = True,
    seed: int = 0,
    repeat: int = 1,
) -> PolicyTable:
    """Measure every run of the grid not already measured in `out` (resuming; a run there that
    measured nothing is measured again), writing the table after each run."""
    raw: dict = {}
    if out.exists():
        try:
            previous = PolicyTable.load(out)
        except TableError as exc:
            raise BenchError(f"{exc}; remove it or choose another --out") from exc
        if (previous.device, previous.model) != (device, model):
            raise BenchError(
                f"{out} holds a profile of {previous.model} on {previous.device}, not {model} on "
                f"{device}"
            )
        raw = dict(previous.raw)
    runs = [
        (c, s, ld, r)
        for c in grid.contexts
        for s in grid.shapes
        for ld in grid.loads
        for r in ROUTES
    ]
    todo = [run for run in runs if raw.get(run_key(*run), {}).get("n", 0) == 0]
    if len(todo) < len(runs):
        print(
            f"resuming {out}: {len(runs) - len(todo)} of {len(runs)} runs already measured",
            file=sys.stderr,
        )
    served = _served_model(url)

    def built() -> PolicyTable:
        return PolicyTable.from_runs(
            grid.contexts, grid.shapes, grid.loads, raw, w_ttft, w_tpot, device, model, meta
        )

    table = built()
    bar = tqdm(todo, desc="profile runs", unit=" run", file=sys.stderr, disable=not progress)
    for n, (context, shape, load, route) in enumerate(bar):
        bar.set_postfix_str(run_key(context, shape, load, route), refresh=True)
        raw[run_key(context, shape, load, route)] = measure_repeated(
            url, served, context, shape, load, route, grid, seed + 1000 * n, repeat
        )
        table = built()
        table.save(out)
    bar.close()
    table.save(out)
    return table


# ---- report --------------------------------------------------------------------------------------


def unmeasured(grid: Grid, raw: dict) -> dict[str, str]:
    """The runs of the grid that measured nothing (no turn-2 request succeeded), each with why."""
    missing = {}
    for key in (
        run_key(c, s, ld, r)
        for c in grid.contexts
        for s in grid.shapes
        for ld in grid.loads
        for r in ROUTES
    ):
        run = raw.get(key, {"requests": 0, "failed": 0, "n": 0})
        if run["n"] == 0:
            errors = "; ".join(
                f"{count} x {error}" for error, count in run.get("errors", {}).items()
            )
            missing[key] = (
                f"no turn-2 request succeeded; {run['failed']} of {run['requests']} failed"
                + (f" ({errors})" if errors else "")
            )
    return missing


def markdown(table: PolicyTable) -> str:
    lines = [
        f"# PPD policy table: {table.model} on {table.device}",
        "",
        f"Made by `{table.meta.get('command', 'ppd profile policy')}` on "
        f"{table.meta.get('created', '?')}. "
        f"x* for w_ttft = {table.w_ttft:g}, w_tpot = {table.w_tpot:g} (1 = the decode worker, "
        "inline). "
        "Turn-2 medians (ms); queue: the prefill worker's mean queue delay during the "
        "prefill-route run.",
        "",
        "| context | new in / out | load | prefill: TTFT / TPOT (queue) | decode: TTFT / TPOT | x* "
        "|",
        "| ---: | ---: | ---: | ---: | ---: | :---: |",
    ]
    for (i, j, k), cell in sorted(table.cells.items()):
        p, d = cell.routes.get("prefill"), cell.routes.get("decode")

        def fmt(s, q=False):
            if s is None:
                return "n/a"
            return f"{s.ttft_p50_ms:.1f} / {s.tpot_p50_ms:.2f}" + (
                f" ({s.queue_delay_ms:.1f})" if q else ""
            )

        n_in, n_out = table.shapes[j]
        lines.append(
            f"| {table.contexts[i]} | {n_in} / {n_out} | {table.loads[k]} | {fmt(p, True)} | "
            f"{fmt(d)} | "
            f"{'' if cell.x_star is None else cell.x_star} |"
        )
    return "\n".join(lines) + "\n"


def heatmap(table: PolicyTable, path: Path) -> None:
    """One panel per load: contexts down, shapes across; the colour is the objective's gain of the
    decode route."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1, len(table.loads), figsize=(3.2 * len(table.loads) + 1, 3.2), squeeze=False
    )
    for k, load in enumerate(table.loads):
        ax = axes[0][k]
        gain = np.full((len(table.contexts), len(table.shapes)), np.nan)
        for (i, j, kk), cell in table.cells.items():
            if kk == k and cell.x_star is not None:
                gain[i, j] = cell.objective("prefill", table.w_ttft, table.w_tpot) - cell.objective(
                    "decode", table.w_ttft, table.w_tpot
                )
        limit = np.nanmax(np.abs(gain)) if np.isfinite(gain).any() else 1.0
        ax.imshow(gain, cmap="coolwarm_r", vmin=-limit, vmax=limit)
        for (i, j), value in np.ndenumerate(gain):
            label = "?" if math.isnan(value) else ("decode" if value > 0 else "prefill")
            ax.text(j, i, label, ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(table.shapes)), [f"{a}/{b}" for a, b in table.shapes], fontsize=7)
        ax.set_yticks(range(len(table.contexts)), [str(c) for c in table.contexts], fontsize=7)
        ax.set_xlabel("turn-2 new input / output tokens", fontsize=8)
        ax.set_title(f"load {load}", fontsize=9)
    axes[0][0].set_ylabel("cached context tokens", fontsize=8)
    fig.suptitle(
        f"x* ({table.model} on {table.device}; w_ttft {table.w_ttft:g}, w_tpot {table.w_tpot:g})",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- command line --------------------------------------------------------------------------------


def add_policy_args(p: argparse.ArgumentParser) -> None:
    add_served_model_args(p)
    p.add_argument(
        "--serve-args",
        default="",
        help='more arguments for the `ppd serve` this starts (e.g. "--max-num-seqs 64")',
    )
    p.add_argument(
        "--url", default=None, help="profile a server already running here instead of starting one"
    )
    p.add_argument(
        "--out",
        default=None,
        help="the table (default: $PPD_CACHE_DIR/profiles/<device>__<model>__policy"
        ".json, which ppd serve reads before the shipped tables); a folder: "
        "that file name in it",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a small grid with short runs (the CPU demo: under 3 minutes)",
    )
    p.add_argument("--contexts", default=None, help="comma list of cached-context lengths (tokens)")
    p.add_argument(
        "--shapes", default=None, help="comma list of turn-2 shapes NEWxOUT, e.g. 64x512,1024x64"
    )
    p.add_argument("--loads", default=None, help="comma list of conversations in flight")
    p.add_argument("--duration", type=float, default=None, help="seconds of traffic per run")
    p.add_argument(
        "--repeat", type=int, default=1, help="runs per cell and route (medians are kept)"
    )
    p.add_argument(
        "--w-ttft", type=float, default=DEFAULT_W_TTFT, help="weight of TTFT for the stored x*"
    )
    p.add_argument(
        "--w-tpot", type=float, default=DEFAULT_W_TPOT, help="weight of TPOT for the stored x*"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the traffic")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def choose_grid(args: argparse.Namespace, gpu: bool) -> Grid:
    base = QUICK_GRID if args.quick else (GPU_GRID if gpu else CPU_GRID)
    try:
        contexts = (
            tuple(int(c) for c in args.contexts.split(",")) if args.contexts else base.contexts
        )
        shapes = (
            tuple(tuple(int(x) for x in s.split("x")) for s in args.shapes.split(","))
            if args.shapes
            else base.shapes
        )
        loads = tuple(int(x) for x in args.loads.split(",")) if args.loads else base.loads
    except ValueError as exc:
        raise BenchError(
            f"bad grid list: {exc}; expected e.g. --contexts 160,544 --shapes 8x64,128x8 --loads "
            "1,4"
        ) from exc
    if (
        any(len(s) != 2 for s in shapes)
        or sorted(set(contexts)) != list(contexts)
        or sorted(set(loads)) != list(loads)
    ):
        raise BenchError(
            "--shapes are NEWxOUT pairs; --contexts and --loads distinct and increasing"
        )
    return Grid(contexts, shapes, loads, base.turn1_output, args.duration or base.duration)


def main(args: argparse.Namespace) -> None:
    proc = None
    try:
        url = args.url
        if url is not None and (
            given := [
                f
                for f, v in (
                    ("--model", args.model),
                    ("--dtype", args.dtype),
                    ("--load-format", args.load_format),
                )
                if v is not None
            ]
        ):
            raise BenchError(
                f"{', '.join(given)} describe the server this command starts; with --url it is "
                "running "
                "already: leave them out"
            )
        if url is None:
            # Beside the table. Where the table's name waits for the server's device and model (no
            # --out, or --out a folder), the log starts under a placeholder name and is renamed
            # then.
            named = args.out is not None and not names_folder(args.out)
            log = (
                Path(args.out).with_suffix(".serve.log")
                if named
                else file_out(args.out, user_profiles_dir() / "policy-profile.serve.log")
            )
            serve_args = with_model_args(
                shlex.split(args.serve_args), args.model, args.dtype, args.load_format
            )
            proc, url = start_server(["--policy", "pd", *serve_args], log)
        device, model, gpu = _describe(url, serve_args if proc is not None else [])
        grid = choose_grid(args, gpu)
        out = file_out(args.out, table_path(device, model, user_profiles_dir()))
        print(f"profiling {model} on {device} into {out}", file=sys.stderr)
        if proc is not None:
            if not named:  # the server keeps writing to the file it opened
                log = log.rename(out.with_suffix(".serve.log"))
            print(f"started ppd serve at {url} (log {log})", file=sys.stderr)
        meta = {
            "created": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": shlex.join(["ppd", *sys.argv[1:]]),
            "settings": {
                "serve_args": args.serve_args,
                "turn1_output": grid.turn1_output,
                "duration_s": grid.duration,
                "repeat": args.repeat,
            },
        }
        started = time.monotonic()
        table = profile(
            url,
            grid,
            out,
            device,
            model,
            meta,
            args.w_ttft,
            args.w_tpot,
            not args.no_progress,
            args.seed,
            args.repeat,
        )
    finally:
        if proc is not None:
            stop_server(proc)
    out.with_suffix(".md").write_text(markdown(table))
    heatmap(table, out.with_suffix(".png"))
    print(markdown(table))
    print(f"written {out} (+ .md, .png) in {time.monotonic() - started:.0f}s", file=sys.stderr)
    runs = len(grid.contexts) * len(grid.shapes) * len(grid.loads) * len(ROUTES)
    fail_unless_measured(unmeasured(grid, table.raw), runs, "runs (cell and route)")


def _describe(url: str, serve_args: list[str]) -> tuple[str, str, bool]:
    """(device name, model name as the server looks its table up, whether it is a GPU) of the server
    at url, started with serve_args (empty: one already running)."""
    try:
        health = httpx.get(f"{url}/health", timeout=10).json()
        device = health["units"][0]["device"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise BenchError(f"cannot read {url}/health ({exc}); is it a ppd server?") from exc
    model = _model_name(_served(url), serve_args)
    tp = device.get(
        "tensor_parallel_size", 1
    )  # a multi-device unit's table is its own (profiles.unit_device_name)
    if device.get("kind") == "cuda":
        return unit_device_name(device.get("name") or "cuda", tp), model, True
    return unit_device_name(cpu_device_name(), tp), model, False


def _model_name(served: dict, serve_args: list[str]) -> str:
    """profiles.model_name of the folder the server loads: the --model this command gave the server
    it started, else the root the running server names (vLLM's is its model folder; ours its
    served name, which is the folder's name unless --served-model-name renamed it). `demo` stands
    for the demo's folder."""
    from engine.demo import DEMO_FOLDER, DEMO_MODEL

    name = option_value(serve_args, "--model") or served.get("root") or served["id"]
    if name == DEMO_MODEL:
        return model_name(DEMO_FOLDER)
    return model_name(os.path.abspath(name) if os.path.isdir(name) else name)


def _served(url: str) -> dict:
    try:
        return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise BenchError(f"cannot list models at {url}/v1/models ({exc})") from exc


def _served_model(url: str) -> str:
    return _served(url)["id"]


def _metrics(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.split("{")[0].split(" ")[0], float(line.rsplit(" ", 1)[1])
            values[name] = values.get(name, 0.0) + value
    return values


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None
