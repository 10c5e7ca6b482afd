"""`ppd profile partition`: what a share of the device (cores on the CPU, SMs on a GPU) buys each worker.

It times the engine directly (as `ppd bench engine` does) on each share:
- decode steps alone, by batch and context: the median and 90th percentile step time;
- prefills alone, by prompt length (prompts batched up to about `prefill_tokens` per step): tokens/s;
- interference: decode's mean step time (TPOT) while 0, 1 or 4 prefills run beside it on their own share, as one
  batched prefill step repeated, of full prompts of `new_tokens` or of `new_tokens` appended over the decode's
  context (the PPD paper's Figures 2, 6 and 7).
On the CPU share s is the first s allowed cores, and every measurement runs in child processes pinned to their
cores before they build the engine; in an interference pair decode has the first d cores and prefill the next p,
or the same cores when p is the whole CPU (time-sliced), the prefill process mapping the decode process's weights
and KV pool as the server's prefill worker does. On a GPU everything runs in this process, each share a
green-context stream whose decode steps replay CUDA graphs captured there (bench/partition_gpu.py), and where torch
can set cuBLAS's SM target, a prefill GEMM is timed on each share with and without it (the profile's meta keeps
what it found). After every point the raw results are saved to <out>.partial.json, so an interrupted run
resumes where it stopped. Output: profiles/<device>__<model>.json (partition/profile.py), .md and .png beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import shlex
import signal
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from tqdm import tqdm

from bench.common import BenchError, file_out, write_json
from bench.engine import LLAMA_8B, add_model_args, chosen_device
from bench.partition_gpu import GpuBench, sm_carveout_available
from bench.partition_timer import Timer
from engine.config import ModelConfig
from engine.demo import DEMO_MODEL, demo_model_path
from engine.engine import Engine, EngineConfig, device_info
from engine.shared_memory import remove_leftover
from partition.cpu import available_cores, pin_to_cores
from partition.green import SM_GRANULARITY
from partition.profile import DecodePoint, InterferencePoint, PartitionProfile, PrefillPoint, profile_path
from profiles import cpu_device_name

KINDS = ("full", "append")
BLOCK_SIZE = 16
SLO_LADDER_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


@dataclass(frozen=True)
class Grid:
    shares: tuple[int, ...]  # cores or SMs, ascending
    batches: tuple[int, ...]  # decode sequences per step
    contexts: tuple[int, ...]  # tokens cached per decode sequence
    prompts: tuple[int, ...]  # prefill prompt lengths
    prefill_tokens: int  # prompts are batched up to about this many tokens per prefill step
    pairs: tuple[tuple[int, int], ...]  # (decode share, prefill share) of each interference measurement
    concurrent: tuple[int, ...]  # prefills beside decode (decode alone is always measured too)
    new_tokens: int  # tokens of each full prefill, or new tokens of each append
    steps: int  # timed decode steps per point
    prefill_repeat: int  # timed prefill steps per point (the median is kept)
    rounds: int = 1  # passes over the whole grid; each figure is the median of its rounds
    gemm_tokens: int = 0  # rows of the prefill GEMM timed on each share with and without cuBLAS's SM carveout (0: none)


def cpu_grid(total: int, quick: bool) -> Grid:
    """Shares 1, 2, 4, ... and the whole CPU; interference with decode on half the cores and prefill on the other
    half, and both on all of them."""
    shares = tuple(sorted({2**i for i in range(total.bit_length()) if 2**i < total} | {total}))
    pairs = ((total // 2, total - total // 2), (total, total)) if total > 1 else ((1, 1),)
    if quick:
        return Grid(shares, (1, 8), (128,), (128,), 512, pairs, (1, 4), 64, 10, 2)
    # Three rounds: the 2-core VM this was tuned on ran the same decode step up to 2x slower from one minute to the
    # next; the median of rounds a minute or more apart is steadier than any one measurement.
    return Grid(shares, (1, 4, 16), (128, 512, 1024), (32, 128, 512, 2048), 2048, pairs, (1, 4), 128, 30, 3, 3)


def gpu_grid(total: int, quick: bool) -> Grid:
    """SM shares in multiples of 8 and the whole GPU; interference with decode on about half the SMs (64 of 132)
    and prefill on the rest."""
    # unverified on a GPU: the sizes (batch 200 at 2,048 tokens of Llama-8B KV is about 53 GB) and the run time.
    half = total // 2 // SM_GRANULARITY * SM_GRANULARITY
    pairs = ((half, total - half),)
    if quick:
        shares = tuple(s for s in (32, 64) if s < total) + (total,)
        return Grid(shares, (1, 64), (1024,), (1024,), 8192, pairs, (1, 4), 1024, 20, 3, gemm_tokens=8192)
    shares = tuple(s for s in (8, 16, 32, 64, 96, 128) if s < total) + (total,)
    return Grid(shares, (1, 16, 64, 128, 200), (512, 2048), (512, 2048, 8192), 8192, pairs, (1, 4), 1024, 30, 5,
                gemm_tokens=8192)


def engine_setup(folder: str, grid: Grid, device: str, dtype: str) -> tuple[EngineConfig, int]:
    """The engine every measurement runs, and how many of its KV blocks decodes use (prefills get the rest)."""
    def blocks(tokens: int) -> int:
        return -(-tokens // BLOCK_SIZE)

    decode = max(b * blocks(c + 1) for b in grid.batches for c in grid.contexts)
    prefill = max([max(1, grid.prefill_tokens // p) * blocks(p) for p in grid.prompts]
                  + [max(grid.concurrent) * blocks(c + grid.new_tokens) for c in grid.contexts])
    longest = max([c + 1 for c in grid.contexts] + list(grid.prompts) + [c + grid.new_tokens for c in grid.contexts])
    positions = ModelConfig.from_folder(folder).max_position_embeddings
    if longest > positions:
        raise BenchError(f"the grid needs sequences of {longest} tokens, the model has {positions} positions; "
                         "lower --contexts, --prompts or --new-tokens")
    step_tokens = max(grid.prefill_tokens, *grid.prompts, max(grid.concurrent) * grid.new_tokens, *grid.batches)
    # enforce_eager: on a GPU the bench captures a graph set per share, on that share's stream (partition_gpu.py).
    cfg = EngineConfig(model=folder, dtype=dtype, load_format="dummy", device=device, block_size=BLOCK_SIZE,
                       num_kv_blocks=decode + prefill, max_model_len=longest, max_num_seqs=max(grid.batches),
                       max_num_batched_tokens=step_tokens, enforce_eager=True, shares_device=False)
    return cfg, decode


class Bench(Protocol):
    """Measures on shares of one device; `profile` asks it for each point."""

    unit: str
    total: int
    decode_graphs: bool  # decode steps replay CUDA graphs captured on each share's stream

    def decode(self, share: int, batch: int, context: int, steps: int) -> list[float]: ...
    def prefill(self, share: int, prompt: int, total: int, repeat: int) -> float: ...
    def interference(self, decode_share: int, prefill_share: int, batch: int, context: int, kind: str,
                     concurrent: int, new_tokens: int, steps: int) -> list[float]: ...
    def gemm(self, share: int, tokens: int, repeat: int) -> dict: ...  # only asked where grid.gemm_tokens > 0
    def close(self) -> None: ...


# ---- the CPU: child processes pinned to their cores --------------------------------------------------


class CpuBench:
    """Share s is the first s allowed cores. Each decode share has a child process that owns an engine; an
    interference pair adds a child on the prefill cores that maps the owner's weights and KV pool."""

    unit = "cores"
    decode_graphs = False

    def __init__(self, cfg: EngineConfig, decode_blocks: int) -> None:
        self.cfg, self.decode_blocks = cfg, decode_blocks
        self.cores = available_cores()
        self.total = len(self.cores)
        self.ctx = mp.get_context("spawn")
        self.start, self.stop = self.ctx.Barrier(2), self.ctx.Event()
        self.owners: dict[int, _Child] = {}
        self.peers: dict[tuple[int, int], _Child] = {}

    def decode(self, share: int, batch: int, context: int, steps: int) -> list[float]:
        return self._owner(share).call("decode", batch=batch, context=context, steps=steps)

    def prefill(self, share: int, prompt: int, total: int, repeat: int) -> float:
        return self._owner(share).call("prefill", prompt=prompt, total=total, repeat=repeat)

    def interference(self, decode_share: int, prefill_share: int, batch: int, context: int, kind: str,
                     concurrent: int, new_tokens: int, steps: int) -> list[float]:
        owner = self._owner(decode_share)
        if concurrent == 0:
            return owner.call("decode", batch=batch, context=context, steps=steps)
        peer = self._peer(decode_share, prefill_share)
        peer.send("prefill_until", kind=kind, concurrent=concurrent, new_tokens=new_tokens, context=context, sync=True)
        owner.send("decode", batch=batch, context=context, steps=steps, sync=True)
        results, errors = [], []
        for child in (peer, owner):  # both answer, whichever failed: a failure aborts the other's wait
            try:
                results.append(child.receive())
            except BenchError as exc:
                errors.append(str(exc))
        self.stop.clear()
        if errors:
            raise BenchError("\n".join(errors))
        return results[-1]

    def close(self) -> None:
        for child in [*self.peers.values(), *self.owners.values()]:
            child.close()
        for share in self.owners:
            for name in self._names(share):
                remove_leftover(name)

    def _owner(self, share: int) -> _Child:
        if share not in self.owners:
            self.owners[share] = _Child(self, self.cores[:share], self._names(share), None)
        return self.owners[share]

    def _peer(self, decode_share: int, prefill_share: int) -> _Child:
        if (decode_share, prefill_share) not in self.peers:
            first = 0 if prefill_share == self.total else decode_share
            if first + prefill_share > self.total:
                raise BenchError(f"decode on {decode_share} and prefill on {prefill_share} of {self.total} cores: "
                                 "the prefill share must fit beside decode, or be every core")
            owner = self._owner(decode_share)
            self.peers[(decode_share, prefill_share)] = _Child(self, self.cores[first:first + prefill_share], None,
                                                               owner.shared)
        return self.peers[(decode_share, prefill_share)]

    def _names(self, share: int) -> tuple[str, str]:
        return f"ppd-partition-{os.getpid()}-{share}-weights", f"ppd-partition-{os.getpid()}-{share}-kv"


class _Child:
    """One pinned child process running Timer methods on request."""

    def __init__(self, bench: CpuBench, cores: list[int], names: tuple[str, str] | None, attach: Any) -> None:
        self.conn, theirs = bench.ctx.Pipe()
        self.process = bench.ctx.Process(target=_child_main, daemon=True, name=f"ppd-profile-{cores}",
                                         args=(tuple(cores), bench.cfg, bench.decode_blocks, names, attach, theirs,
                                               bench.start, bench.stop))
        self.process.start()
        theirs.close()
        self.shared = self.receive()  # (weights handle, KV handle, KV blocks, max_model_len) once it is ready

    def send(self, method: str, **kwargs: Any) -> None:
        self.conn.send((method, kwargs))

    def receive(self) -> Any:
        try:
            ok, value = self.conn.recv()
        except EOFError:
            raise BenchError(f"the profiling child {self.process.name} died (exit code {self.process.exitcode})") \
                from None
        if not ok:
            raise BenchError(f"the profiling child {self.process.name} failed:\n{value}")
        return value

    def call(self, method: str, **kwargs: Any) -> Any:
        self.send(method, **kwargs)
        return self.receive()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.process.join(timeout=5)
        if self.process.is_alive():  # busy in a step (Ctrl-C): its result is not wanted
            self.process.terminate()
            self.process.join()


def _child_main(cores: tuple[int, ...], cfg: EngineConfig, decode_blocks: int, names: tuple[str, str] | None,
                attach: Any, conn: Any, start: Any, stop: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops the children
    try:
        pin_to_cores(cores)  # before the engine exists, so torch's thread pool is the share's size
        if attach is None:
            engine = Engine.create(cfg, names)
        else:
            engine = Engine.attach(cfg, *attach)
        timer = Timer(engine, decode_blocks)
        conn.send((True, (engine.weights_handle, engine.kv_handle, engine.num_kv_blocks, engine.max_model_len)))
    except Exception:  # noqa: BLE001 - the parent reports it, with the traceback
        conn.send((False, traceback.format_exc()))
        return
    while (job := conn.recv()) is not None:
        method, kwargs = job
        if kwargs.pop("sync", False):
            kwargs.update(start=start, stop=stop)
        try:
            conn.send((True, getattr(timer, method)(**kwargs)))
        except Exception:  # noqa: BLE001 - likewise
            conn.send((False, traceback.format_exc()))


# ---- the sweep ---------------------------------------------------------------------------------------


def points(grid: Grid) -> list[tuple]:
    """Every point of the grid, in the order measured: ("decode", share, batch, context), ("prefill", share, prompt),
    ("gemm", share) where grid.gemm_tokens, ("interference", decode share, prefill share, batch, context, kind,
    concurrent) with kind "alone" for 0."""
    out: list[tuple] = [("decode", s, b, c) for s in grid.shares for b in grid.batches for c in grid.contexts]
    out += [("prefill", s, p) for s in grid.shares for p in grid.prompts]
    out += [("gemm", s) for s in grid.shares if grid.gemm_tokens]
    for d, p in grid.pairs:
        for b in grid.batches:
            for c in grid.contexts:
                out.append(("interference", d, p, b, c, "alone", 0))
                out += [("interference", d, p, b, c, kind, n) for kind in KINDS for n in grid.concurrent]
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


def profile(bench: Bench, grid: Grid, out: Path, device: str, model: str, meta: dict,
            progress: bool = True) -> PartitionProfile:
    """Measure every point not already in out's partial file (when its settings match), saving that file after each
    point; then write the profile to `out` and drop the partial file."""
    started, partial = time.monotonic(), partial_path(out)
    settings = _as_json({"device": device, "model": model, "unit": bench.unit, "total": bench.total,
                         "grid": asdict(grid), "engine": meta.get("settings", {})})
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
        print(f"\ninterrupted: {len(raw)} points kept in {partial}; the same command resumes", file=sys.stderr)
        raise
    finally:
        bar.close()
    meta = {**meta, "measured_s": round(time.monotonic() - started, 1), "points_measured": len(todo)}
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
    """data as it reads back from JSON (tuples become lists), so that settings compare equal after a save."""
    return json.loads(json.dumps(data))


def build_profile(grid: Grid, raw: dict, device: str, model: str, unit: str, total: int,
                  meta: dict) -> PartitionProfile:
    """The profile of a fully measured grid: each figure the median of its rounds."""
    def median(field: str, *point: Any) -> float:
        return statistics.median(raw[job_key(r, point)][field] for r in range(grid.rounds))

    decode, prefill, interference = [], [], []
    for s in grid.shares:
        for b in grid.batches:
            for c in grid.contexts:
                point = ("decode", s, b, c)
                decode.append(DecodePoint(s, b, c, median("step_ms", *point), median("step_p90_ms", *point)))
        prefill += [PrefillPoint(s, p, median("tokens_per_s", "prefill", s, p)) for p in grid.prompts]
    for d, p in grid.pairs:
        for b in grid.batches:
            for c in grid.contexts:
                alone = median("tpot_ms", "interference", d, p, b, c, "alone", 0)
                for kind in KINDS:
                    interference.append(InterferencePoint(d, p, b, c, kind, 0, grid.new_tokens, alone, alone))
                    for n in grid.concurrent:
                        tpot = median("tpot_ms", "interference", d, p, b, c, kind, n)
                        interference.append(InterferencePoint(d, p, b, c, kind, n, grid.new_tokens, tpot, alone))
    meta = {**meta, "grid": _as_json(asdict(grid))}
    if grid.gemm_tokens:
        meta["gemm_carveout"] = [{"share": s, "tokens": grid.gemm_tokens, "carveout": median("carveout", "gemm", s),
                                  "ms": median("ms", "gemm", s), "carveout_ms": median("carveout_ms", "gemm", s)}
                                 for s in grid.shares]
    return PartitionProfile(device, model, unit, total, list(grid.shares), decode, prefill, interference, meta)


# ---- report ------------------------------------------------------------------------------------------


def example_slos(result: PartitionProfile) -> list[float]:
    """Up to four round SLOs (ms) inside the range of measured decode steps: where the choice of share matters."""
    steps = [p.step_ms for p in result.decode]
    inside = [s for s in SLO_LADDER_MS if min(steps) <= s <= max(steps)] or [SLO_LADDER_MS[0]]
    return [inside[round(i * (len(inside) - 1) / 3)] for i in range(4)] if len(inside) > 4 else inside


def markdown(result: PartitionProfile) -> str:
    unit, grid = result.unit, result.meta.get("grid", {})
    batches, contexts = sorted({p.batch for p in result.decode}), sorted({p.context for p in result.decode})
    steps = {(p.share, p.batch, p.context): f"{p.step_ms:.2f} / {p.step_p90_ms:.2f}" for p in result.decode}
    prompts, rates = sorted({p.prompt for p in result.prefill}), {(p.share, p.prompt): p for p in result.prefill}
    slos = example_slos(result)
    return "\n".join([
        f"# Partition profile: {result.model} on {result.device}", "",
        (f"Made by `{result.meta.get('command', 'ppd profile partition')}` on {result.meta.get('created', '?')} "
         f"({result.meta.get('measured_s', 0):.0f} s measuring). A share is a number of {unit} of {result.total}."), "",
        (f"## Decode step (ms, median / p90), alone, by share ({unit}) x batch x context"
         + (", replaying CUDA graphs captured on each share" if result.meta.get("decode_graphs") else "")), "",
        *_table(["share", "batch", *(f"ctx {c}" for c in contexts)],
                [[str(s), str(b), *(steps[s, b, c] for c in contexts)] for s in result.shares for b in batches]), "",
        f"## Prefill tokens/s, alone, by share x prompt (prompts batched to ~{grid.get('prefill_tokens', '?')} tokens)",
        "",
        *_table(["share", *(f"prompt {p}" for p in prompts)],
                [[str(s), *(f"{rates[s, p].tokens_per_s:,.0f}" for p in prompts)] for s in result.shares]),
        *gemm_markdown(result),
        *interference_markdown(result), "",
        "## Smallest decode share meeting an ITL SLO (min_decode_share; -: none does)", "",
        *_table(["batch", "context", *(f"{slo:g} ms" for slo in slos)],
                [[str(b), str(c), *(str(result.min_decode_share(b, c, slo) or "-") for slo in slos)]
                 for b in batches for c in contexts]),
    ]) + "\n"


def gemm_markdown(result: PartitionProfile) -> list[str]:
    rows = result.meta.get("gemm_carveout")
    if not rows:
        return []
    title = (f"## A prefill GEMM ({rows[0]['tokens']} tokens, the MLP's up projection) on each share, alone and with "
             "cuBLAS's SM carveout set to the SMs outside the share (torch._C._set_sm_carveout_experimental; serving "
             "sets it only where this shows that it helps)")
    body = [[str(r["share"]), str(r["carveout"]), f"{r['ms']:.2f}",
             *((f"{r['carveout_ms']:.2f}", f"{r['carveout_ms'] / r['ms']:.2f}") if r["carveout"] else ("-", "-"))]
            for r in rows]
    return ["", title, "", *_table(["share", "carveout", "ms", "ms with the carveout", "ratio"], body)]


def interference_markdown(result: PartitionProfile) -> list[str]:
    busy = [p for p in result.interference if p.concurrent > 0]
    if not busy:
        return []
    cols = sorted({(p.kind, p.concurrent) for p in busy}, key=lambda k: (KINDS.index(k[0]), k[1]))
    rows: dict[tuple, dict] = {}
    for p in busy:
        rows.setdefault((p.decode_share, p.prefill_share, p.batch, p.context), {})[(p.kind, p.concurrent)] = p
    body = []
    for (d, ps, b, c), row in rows.items():
        alone = next(iter(row.values())).tpot_alone_ms
        body.append([f"{d} / {ps}", str(b), str(c), f"{alone:.2f}",
                     *(f"{row[k].tpot_ms / alone:.2f}" if k in row else "" for k in cols)])
    title = (f"## Decode TPOT beside prefills, as a ratio of TPOT alone ({busy[0].new_tokens} tokens a full prefill or "
             "an append; d / p: decode on d and prefill on p of the shares; when both are the whole device, the two "
             "are time-sliced)")
    header = ["decode / prefill share", "batch", "context", "alone (ms)", *(f"{k} x{n}" for k, n in cols)]
    return ["", title, "", *_table(header, body)]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + " ---: |" * len(header),
            *("| " + " | ".join(row) + " |" for row in rows)]


def plot(result: PartitionProfile, path: Path) -> None:
    """Decode step vs batch per share (a line per context), prefill tokens/s vs prompt per share, and the
    interference ratios, full vs append."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_d, ax_p, ax_i) = plt.subplots(1, 3, figsize=(15, 4.2))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    contexts = sorted({p.context for p in result.decode})
    for i, share in enumerate(result.shares):
        for j, c in enumerate(contexts):
            pts = sorted((p.batch, p.step_ms) for p in result.decode if p.share == share and p.context == c)
            ax_d.plot(*zip(*pts), marker="o", color=colours[i % len(colours)], linestyle=("-", "--", ":", "-.")[j % 4],
                      label=f"{share} {result.unit}, ctx {c}")
        pts = sorted((p.prompt, p.tokens_per_s) for p in result.prefill if p.share == share)
        if pts:
            ax_p.plot(*zip(*pts), marker="o", color=colours[i % len(colours)], label=f"{share} {result.unit}")
    ax_d.set(xlabel="decode batch", ylabel="step (ms, median)", title="decode alone", xscale="log", yscale="log")
    ax_p.set(xlabel="prompt tokens", ylabel="tokens/s", title="prefill alone", xscale="log")
    for ax, ticks in ((ax_d, {p.batch for p in result.decode}), (ax_p, {p.prompt for p in result.prefill})):
        ax.set_xticks(sorted(ticks), [str(t) for t in sorted(ticks)], minor=False)
        ax.minorticks_off()
    ax_d.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax_d.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax_d.legend(fontsize=6)
    ax_p.legend(fontsize=7)
    busy = [p for p in result.interference if p.concurrent > 0]
    groups = sorted({(p.decode_share, p.prefill_share, p.batch, p.context) for p in busy})
    series = sorted({(p.kind, p.concurrent) for p in busy}, key=lambda k: (KINDS.index(k[0]), k[1]))
    width = 0.8 / max(1, len(series))
    for k, (kind, n) in enumerate(series):
        ratios = {(p.decode_share, p.prefill_share, p.batch, p.context): p.tpot_ms / p.tpot_alone_ms
                  for p in busy if (p.kind, p.concurrent) == (kind, n)}
        ax_i.bar([g + k * width for g in range(len(groups))], [ratios.get(g, 0) for g in groups], width,
                 color=colours[KINDS.index(kind)], alpha=0.5 + 0.5 * n / max(p.concurrent for p in busy),
                 hatch="" if kind == "full" else "//", label=f"{kind} x{n}")
    ax_i.axhline(1.0, color="grey", linewidth=0.8)
    ax_i.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))],
                    [f"{d}/{p} b{b} c{c}" for d, p, b, c in groups], rotation=90, fontsize=6)
    ax_i.set(ylabel="TPOT / TPOT alone", title="decode beside prefills (decode/prefill share)")
    ax_i.legend(fontsize=7)
    fig.suptitle(f"{result.model} on {result.device}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- command line ------------------------------------------------------------------------------------


def add_partition_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--out", default=None, help="the profile (default: profiles/<device>__<model>.json); a folder: "
                                               "that file name in it")
    p.add_argument("--quick", action="store_true", help="a small grid (the CPU demo: under 2 minutes)")
    p.add_argument("--shares", default=None, help="comma list of shares: cores on the CPU, SMs on a GPU (multiples "
                                                   "of 8)" + _defaults("shares"))
    p.add_argument("--batches", default=None, help="comma list of decode batch sizes" + _defaults("batches"))
    p.add_argument("--contexts", default=None,
                   help="comma list of decode context lengths (tokens)" + _defaults("contexts"))
    p.add_argument("--prompts", default=None,
                   help="comma list of prefill prompt lengths (tokens)" + _defaults("prompts"))
    p.add_argument("--new-tokens", type=int, default=None,
                   help="tokens of each prefill beside decode: a full prompt, or new tokens appended over its context"
                        + _defaults("new_tokens"))
    p.add_argument("--steps", type=int, default=None, help="timed decode steps per point" + _defaults("steps"))
    p.add_argument("--rounds", type=int, default=None,
                   help="passes over the grid, a point's figure the median of its rounds" + _defaults("rounds"))
    p.add_argument("--gemm-tokens", type=int, default=None,
                   help="GPU: rows of a prefill GEMM timed on each share alone and with cuBLAS's SM carveout set to "
                        "the SMs outside the share, where torch can set it; 0: not timed" + _defaults("gemm_tokens"))
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _busy_cores(seconds: float = 1.0) -> float:
    """Cores kept busy over the next `seconds` (Linux's /proc/stat): work beside the profile skews it."""
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
    return (f" (default: CPU {text(cpu_grid(cores, False))}, H100 {text(gpu_grid(132, False))}; --quick: CPU "
            f"{text(cpu_grid(cores, True))}, H100 {text(gpu_grid(132, True))})")


def choose_grid(args: argparse.Namespace, gpu: bool, total: int) -> Grid:
    base = (gpu_grid if gpu else cpu_grid)(total, args.quick)
    try:
        lists = {name: tuple(int(x) for x in value.split(",")) for name in ("shares", "batches", "contexts", "prompts")
                 if (value := getattr(args, name)) is not None}
    except ValueError as exc:
        raise BenchError(f"bad grid list: {exc}; expected e.g. --shares 1,2 --batches 1,8 --contexts 128,512") from exc
    gemm_tokens = base.gemm_tokens if args.gemm_tokens is None else args.gemm_tokens
    if gemm_tokens and not gpu:
        raise BenchError("--gemm-tokens times cuBLAS on a GPU's SM shares; on the CPU leave it out")
    if gemm_tokens and not sm_carveout_available():
        if args.gemm_tokens:
            raise BenchError(f"--gemm-tokens: torch {torch.__version__} cannot set cuBLAS's SM carveout "
                             "(torch._C._set_sm_carveout_experimental); leave it out")
        gemm_tokens = 0
    grid = replace(base, **lists, new_tokens=args.new_tokens or base.new_tokens, steps=args.steps or base.steps,
                   rounds=args.rounds or base.rounds, gemm_tokens=gemm_tokens)
    for name in ("shares", "batches", "contexts", "prompts"):
        values = getattr(grid, name)
        if not values or list(values) != sorted(set(values)) or values[0] < 1:
            raise BenchError(f"--{name} must be distinct, increasing and positive, not {','.join(map(str, values))}")
    if grid.shares[-1] > total:
        raise BenchError(f"--shares go up to {total} {'SMs' if gpu else 'cores'} on this device")
    if gpu and any(s % SM_GRANULARITY and s != total for s in grid.shares):
        raise BenchError(f"--shares on a GPU are multiples of {SM_GRANULARITY} SMs (or all {total})")
    return grid


def main(args: argparse.Namespace) -> None:
    gpu = chosen_device(args).type == "cuda"
    # --model demo (and no --model on the CPU): the built-in demo model, as everywhere else --model is taken
    folder = str(demo_model_path() if args.model == DEMO_MODEL or (args.model is None and not gpu)
                 else args.model or LLAMA_8B)
    model = os.path.basename(folder.rstrip("/"))  # as the policy table names it: the demo is "demo-v2"
    if gpu:
        cuda = torch.device("cuda")
        device, total = device_info(cuda).name, torch.cuda.get_device_properties(cuda).multi_processor_count
    else:
        device, total = cpu_device_name(), len(available_cores())
    grid = choose_grid(args, gpu, total)
    out = file_out(args.out, profile_path(device, model))
    cfg, decode_blocks = engine_setup(folder, grid, "cuda" if gpu else "cpu", args.dtype)
    meta = {"created": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": shlex.join(["ppd", *sys.argv[1:]]),
            "settings": {"model": args.model or ("demo" if not gpu else LLAMA_8B), "dtype": args.dtype,
                         "block_size": BLOCK_SIZE,
                         "kv_blocks": cfg.num_kv_blocks},
            "torch": torch.__version__, "python": platform.python_version(), "host_cpus": os.cpu_count(),
            "notes": "concurrent prefills run as one batched prefill step, repeated while decode is timed; "
                     "decode_share == prefill_share == total: both on the whole device (time-sliced)"}
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
