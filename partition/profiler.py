"""`ppd profile partition`: what a share of the device (cores on the CPU, SMs on a GPU) buys each
worker.

It times the engine directly (as `ppd bench engine` does) on each share:
- decode steps alone, by batch and context: the median and 90th percentile step time;
- prefills alone, by prompt length (prompts batched up to about `prefill_tokens` per step):
  tokens/s;
- interference: decode's mean step time (TPOT) while 0, 1 or 4 prefills run beside it on their own
  share, as one batched prefill step repeated, of full prompts of `new_tokens` or of `new_tokens`
  appended over the decode's context (the PPD paper's Figures 2, 6 and 7). On the CPU share s is the
  first s allowed cores, and every measurement runs in child processes pinned to their cores before
  they build the engine (partition/profiler_cpu.py); in an interference pair decode has the first d
  cores and prefill the next p, or the same cores when p is the whole CPU (time-sliced), the prefill
  process mapping the decode process's weights and KV pool as the server's prefill worker does. On a
  GPU everything runs in this process, each share a green-context stream whose decode steps replay
  CUDA graphs captured there (partition/profiler_gpu.py), and where torch can set cuBLAS's SM
  target, a prefill GEMM is timed on each share with and without it (the profile's meta keeps what
  it found). This module is the sweep: the grid, its points, measuring them with resume, and the
  profile built from them. After every point the raw results are saved to <out>.partial.json, so an
  interrupted run resumes where it stopped. Output: $PPD_CACHE_DIR/profiles/<device>__<model>.json
  (partition/profile.py), .md and .png beside it (partition/profile_report.py); the command line is
  partition/profiler_cli.py.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from tqdm import tqdm

from engine.config import ModelConfig
from engine.engine import EngineConfig
from partition.green import SM_GRANULARITY
from partition.profile import DecodePoint, InterferencePoint, PartitionProfile, PrefillPoint
from profiles import write_json

KINDS = ("full", "append")
BLOCK_SIZE = 16


class ProfilerError(Exception):
    """A bad `ppd profile` command line, or a grid this model or device cannot run: printed, exit
    code 2."""


def names_folder(arg: str) -> bool:
    """Whether --out names a folder: an existing one, or a path ending in a separator."""
    return Path(arg).is_dir() or arg.endswith((os.sep, "/"))


def file_out(arg: str | None, default: Path) -> Path:
    """Where a `ppd profile` command writes the file whose default path is `default`: there without
    --out; into the folder --out names (an existing folder, or a path ending in a separator, made if
    missing) under the default's file name; else --out itself. A path that exists and is neither a
    file nor a folder is refused."""
    if arg is None:
        return default
    path = Path(arg)
    if names_folder(arg):
        path.mkdir(parents=True, exist_ok=True)
        return path / default.name
    if path.exists() and not path.is_file():
        raise ProfilerError(f"--out {arg}: neither a file nor a folder")
    return path


@dataclass(frozen=True)
class Grid:
    shares: tuple[int, ...]  # cores or SMs, ascending
    batches: tuple[int, ...]  # decode sequences per step
    contexts: tuple[int, ...]  # tokens cached per decode sequence
    prompts: tuple[int, ...]  # prefill prompt lengths
    prefill_tokens: int  # prompts are batched up to about this many tokens per prefill step
    pairs: tuple[
        tuple[int, int], ...
    ]  # (decode share, prefill share) of each interference measurement
    concurrent: tuple[int, ...]  # prefills beside decode (decode alone is always measured too)
    new_tokens: int  # tokens of each full prefill, or new tokens of each append
    steps: int  # timed decode steps per point
    prefill_repeat: int  # timed prefill steps per point (the median is kept)
    rounds: int = 1  # passes over the whole grid; each figure is the median of its rounds
    # rows of the prefill GEMM timed on each share with and without cuBLAS's SM carveout (0: none)
    gemm_tokens: int = 0


def cpu_grid(total: int, quick: bool) -> Grid:
    """Shares 1, 2, 4, ... and the whole CPU; interference with decode on half the cores and prefill
    on the other half, and both on all of them."""
    shares = tuple(sorted({2**i for i in range(total.bit_length()) if 2**i < total} | {total}))
    pairs = ((total // 2, total - total // 2), (total, total)) if total > 1 else ((1, 1),)
    if quick:
        return Grid(shares, (1, 8), (128,), (128,), 512, pairs, (1, 4), 64, 10, 2)
    # Three rounds: a shared machine's speed drifts from minute to minute, and the median of rounds
    # a minute or more apart is steadier than any one measurement
    # (docs/profiling.md#measurements-behind-the-code).
    return Grid(
        shares,
        (1, 4, 16),
        (128, 512, 1024),
        (32, 128, 512, 2048),
        2048,
        pairs,
        (1, 4),
        128,
        30,
        3,
        3,
    )


def gpu_grid(total: int, quick: bool) -> Grid:
    """SM shares in multiples of 8 and the whole GPU; interference with decode on about half the SMs
    (64 of 132) and prefill on the rest."""
    # unverified on a GPU: the sizes (batch 200 at 2,048 tokens of Llama-8B KV is about 53 GB) and
    # the run time.
    half = total // 2 // SM_GRANULARITY * SM_GRANULARITY
    pairs = ((half, total - half),)
    if quick:
        shares = tuple(s for s in (32, 64) if s < total) + (total,)
        return Grid(
            shares, (1, 64), (1024,), (1024,), 8192, pairs, (1, 4), 1024, 20, 3, gemm_tokens=8192
        )
    shares = tuple(s for s in (8, 16, 32, 64, 96, 128) if s < total) + (total,)
    return Grid(
        shares,
        (1, 16, 64, 128, 200),
        (512, 2048),
        (512, 2048, 8192),
        8192,
        pairs,
        (1, 4),
        1024,
        30,
        5,
        gemm_tokens=8192,
    )


def engine_setup(folder: str, grid: Grid, device: str, dtype: str) -> tuple[EngineConfig, int]:
    """The engine every measurement runs, and how many of its KV blocks decodes use (prefills get
    the rest)."""

    def blocks(tokens: int) -> int:
        return -(-tokens // BLOCK_SIZE)

    decode = max(b * blocks(c + 1) for b in grid.batches for c in grid.contexts)
    prefill = max(
        [max(1, grid.prefill_tokens // p) * blocks(p) for p in grid.prompts]
        + [max(grid.concurrent) * blocks(c + grid.new_tokens) for c in grid.contexts]
    )
    longest = max(
        [c + 1 for c in grid.contexts]
        + list(grid.prompts)
        + [c + grid.new_tokens for c in grid.contexts]
    )
    positions = ModelConfig.from_folder(folder).max_position_embeddings
    if longest > positions:
        raise ProfilerError(
            f"the grid needs sequences of {longest} tokens, the model has {positions} positions; "
            "lower --contexts, --prompts or --new-tokens"
        )
    step_tokens = max(
        grid.prefill_tokens, *grid.prompts, max(grid.concurrent) * grid.new_tokens, *grid.batches
    )
    # enforce_eager: on a GPU the bench captures a graph set per share, on that share's stream
    # (profiler_gpu.py).
    cfg = EngineConfig(
        model=folder,
        dtype=dtype,
        load_format="dummy",
        device=device,
        block_size=BLOCK_SIZE,
        num_kv_blocks=decode + prefill,
        max_model_len=longest,
        max_num_seqs=max(grid.batches),
        max_num_batched_tokens=step_tokens,
        enforce_eager=True,
        shares_device=False,
    )
    return cfg, decode


class Bench(Protocol):
    """Measures on shares of one device; `profile` asks it for each point."""

    unit: str
    total: int
    decode_graphs: bool  # decode steps replay CUDA graphs captured on each share's stream

    def decode(self, share: int, batch: int, context: int, steps: int) -> list[float]: ...
    def prefill(self, share: int, prompt: int, total: int, repeat: int) -> float: ...
    def interference(
        self,
        decode_share: int,
        prefill_share: int,
        batch: int,
        context: int,
        kind: str,
        concurrent: int,
        new_tokens: int,
        steps: int,
    ) -> list[float]: ...
    def gemm(
        self, share: int, tokens: int, repeat: int
    ) -> dict: ...  # only asked where grid.gemm_tokens > 0
    def close(self) -> None: ...


def points(grid: Grid) -> list[tuple]:
    """Every point of the grid, in the order measured: ("decode", share, batch, context),
    ("prefill", share, prompt), ("gemm", share) where grid.gemm_tokens, ("interference", decode
    share, prefill share, batch, context, kind, concurrent) with kind "alone" for 0."""
    out: list[tuple] = [
        ("decode", s, b, c) for s in grid.shares for b in grid.batches for c in grid.contexts
    ]
    out += [("prefill", s, p) for s in grid.shares for p in grid.prompts]
    out += [("gemm", s) for s in grid.shares if grid.gemm_tokens]
    for d, p in grid.pairs:
        for b in grid.batches:
            for c in grid.contexts:
                out.append(("interference", d, p, b, c, "alone", 0))
                out += [
                    ("interference", d, p, b, c, kind, n) for kind in KINDS for n in grid.concurrent
                ]
    return out


def jobs(grid: Grid) -> list[tuple[int, tuple]]:
    """(round, point): the whole grid once per round."""
    return [(r, point) for r in range(grid.rounds) for point in points(grid)]


def job_key(round_: int, point: tuple) -> str:
    return " ".join(str(x) for x in point) + f" #{round_}"


def measure(bench: Bench, grid: Grid, point: tuple) -> dict:
    """One point's raw result."""
    if point[0] == "decode":
        times = bench.decode(*point[1:], grid.steps)
        return {"step_ms": statistics.median(times), "step_p90_ms": float(np.percentile(times, 90))}
    if point[0] == "prefill":
        return {"tokens_per_s": bench.prefill(*point[1:], grid.prefill_tokens, grid.prefill_repeat)}
    if point[0] == "gemm":
        return bench.gemm(point[1], grid.gemm_tokens, grid.prefill_repeat)
    times = bench.interference(*point[1:], grid.new_tokens, grid.steps)
    return {"tpot_ms": statistics.fmean(times)}


def partial_path(out: Path) -> Path:
    return out.with_name(out.name + ".partial.json")


def profile(
    bench: Bench, grid: Grid, out: Path, device: str, model: str, meta: dict, progress: bool = True
) -> PartitionProfile:
    """Measure every point not already in out's partial file (when its settings match), saving that
    file after each point; then write the profile to `out` and drop the partial file."""
    started, partial = time.monotonic(), partial_path(out)
    settings = _as_json(
        {
            "device": device,
            "model": model,
            "unit": bench.unit,
            "total": bench.total,
            "grid": asdict(grid),
            "engine": meta.get("settings", {}),
        }
    )
    raw = _resume(partial, settings)
    todo = [job for job in jobs(grid) if job_key(*job) not in raw]
    bar = tqdm(todo, desc="partition profile", unit=" point", file=sys.stderr, disable=not progress)
    try:
        for round_, point in bar:
            key = job_key(round_, point)
            bar.set_postfix_str(key, refresh=True)
            raw[key] = measure(bench, grid, point)
            write_json(partial, {"settings": settings, "raw": raw})
    except KeyboardInterrupt:
        print(
            f"\ninterrupted: {len(raw)} points kept in {partial}; the same command resumes",
            file=sys.stderr,
        )
        raise
    finally:
        bar.close()
    meta = {
        **meta,
        "measured_s": round(time.monotonic() - started, 1),
        "points_measured": len(todo),
    }
    result = build_profile(grid, raw, device, model, bench.unit, bench.total, meta)
    result.save(out)
    partial.unlink(missing_ok=True)
    return result


def _resume(partial: Path, settings: dict) -> dict:
    if not partial.exists():
        return {}
    try:
        saved = json.loads(partial.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        print(f"{partial} is unreadable ({exc}); starting over", file=sys.stderr)
        return {}
    if not isinstance(saved, dict) or saved.get("settings") != settings:
        print(f"{partial} was made with other settings; starting over", file=sys.stderr)
        return {}
    raw = dict(saved.get("raw", {}))
    print(f"resuming {partial}: {len(raw)} points already measured", file=sys.stderr)
    return raw


def _as_json(data: dict) -> dict:
    """data as it reads back from JSON (tuples become lists), so that settings compare equal after a
    save."""
    return json.loads(json.dumps(data))


def build_profile(
    grid: Grid, raw: dict, device: str, model: str, unit: str, total: int, meta: dict
) -> PartitionProfile:
    """The profile of a fully measured grid: each figure the median of its rounds."""

    def median(field: str, *point: Any) -> float:
        return statistics.median(raw[job_key(r, point)][field] for r in range(grid.rounds))

    decode, prefill, interference = [], [], []
    for s in grid.shares:
        for b in grid.batches:
            for c in grid.contexts:
                point = ("decode", s, b, c)
                decode.append(
                    DecodePoint(s, b, c, median("step_ms", *point), median("step_p90_ms", *point))
                )
        prefill += [
            PrefillPoint(s, p, median("tokens_per_s", "prefill", s, p)) for p in grid.prompts
        ]
    for d, p in grid.pairs:
        for b in grid.batches:
            for c in grid.contexts:
                alone = median("tpot_ms", "interference", d, p, b, c, "alone", 0)
                for kind in KINDS:
                    interference.append(
                        InterferencePoint(d, p, b, c, kind, 0, grid.new_tokens, alone, alone)
                    )
                    for n in grid.concurrent:
                        tpot = median("tpot_ms", "interference", d, p, b, c, kind, n)
                        interference.append(
                            InterferencePoint(d, p, b, c, kind, n, grid.new_tokens, tpot, alone)
                        )
    meta = {**meta, "grid": _as_json(asdict(grid))}
    if grid.gemm_tokens:
        meta["gemm_carveout"] = [
            {
                "share": s,
                "tokens": grid.gemm_tokens,
                "carveout": median("carveout", "gemm", s),
                "ms": median("ms", "gemm", s),
                "carveout_ms": median("carveout_ms", "gemm", s),
            }
            for s in grid.shares
        ]
    return PartitionProfile(
        device, model, unit, total, list(grid.shares), decode, prefill, interference, meta
    )
