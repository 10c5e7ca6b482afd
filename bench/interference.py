"""`ppd bench interference`: decode TPOT while a long prefill runs beside it, and the prefill's time
beside decode against its time alone, per way of sharing the device.

Issue 9's first target, measured through the server as a user sees it. For every configuration (a
`ppd serve` command line) in one run, on one server:

- prefill_alone_ms: the long prompts' time to their first token with nothing else running (after one
  unmeasured prompt that warms the prefill path), median over the rounds;
- tpot_alone_ms: then a batch of streams decodes (all past their first token), their time per output
  token alone;
- tpot_beside_ms: the same during each of several long prompts sent one after another (from its
  request to its answer), median over the rounds;
- ratio: tpot_beside / tpot_alone (the target is 1.2 or less at batch 64 beside a 4K-token prompt);
- prefill_ms: the long prompts' time to their first token beside the decoding streams, median over
  the rounds; prefill_ratio: prefill_ms / prefill_alone_ms (the target: each prefill within 2x of
  its time alone);
- gpu: on a GPU, NVML's readings in each window (prefill alone, decode alone, beside:
  bench/gpu_sampler.py): SM clock, memory busy, DRAM bandwidth (GPM), power, temperature; where
  there is no NVML, why.

A window's TPOT is its length times the batch over the tokens all streams received in it, so a
stream that is stalled counts as slow rather than dropping out. Configurations by default:
aggregated (chunked prefill in the decode batch), pd with time-slicing (none), and each way of
overlapping this device offers: on the CPU pinned cores (cpu) and one process with a prefill thread
(thread); on a GPU mps and green. Each server logs to <out>/<name>.log; a configuration that
measured nothing is reported with why, and makes the command exit 1.

On a GPU, --only also reaches static configurations that take SM loss and contention apart:
green-static-64 and green-static-96 fix decode on a green context of 64 or 96 SMs, alone and beside
the prefill (no share manager), so their TPOT alone against none's (decode alone on every SM) is
what the SMs cost decode, and their ratio is what the prefill's contention on the rest costs it; the
-smtarget ones do the same with cuBLAS told to size its GEMMs for the SMs of the split each graph
set is captured on (--cublas-sm-target); mps-40 caps the prefill worker at 40% of the SMs. The
report says what decode had in each configuration, and the share the server reported (/health) while
it decoded alone and beside.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench import gpu_sampler
from bench.common import BenchError, fail_unless_measured, one_line, results_out
from bench.gpu_sampler import GpuSampler
from bench.servers import local_model, option_value, start_server, stop_server, with_model_args
from profiles import write_json


@dataclass(frozen=True)
class Config:
    """One way of sharing the device: its own `ppd serve` arguments, and what decode has under
    it."""

    args: str
    decode: str = ""


CPU_CONFIGS = {
    "aggregated": Config("--policy aggregated", "every core; the prefill's chunks join its steps"),
    "none": Config(
        "--policy pd --partition none", "every core, time-sliced with the prefill worker's process"
    ),
    "cpu": Config(
        "--policy pd --partition cpu", "its own cores, fixed (the prefill worker on the others)"
    ),
    "thread": Config(
        "--policy pd --partition none --prefill-worker thread",
        "every core, shared with the prefill thread",
    ),
}
GPU_CONFIGS = {
    "aggregated": Config(
        "--policy aggregated --partition none", "every SM; the prefill's chunks join its steps"
    ),
    "none": Config(
        "--policy pd --partition none", "every SM, time-sliced with the prefill worker's process"
    ),
    "mps": Config(
        "--policy pd --partition mps", "every SM (MPS cap 100%), the prefill capped at 80%"
    ),
    "green": Config("--policy pd --partition green", "the share manager's pick among green splits"),
    "green-static-64": Config(
        "--policy pd --partition green --green-decode-sms 64 --no-share-manager",
        "64 SMs (a green context), alone and beside; the prefill on the rest",
    ),
    "green-static-96": Config(
        "--policy pd --partition green --green-decode-sms 96 --no-share-manager",
        "96 SMs (a green context), alone and beside; the prefill on the rest",
    ),
    "mps-40": Config(
        "--policy pd --partition mps --mps-prefill-percent 40",
        "every SM (MPS cap 100%), the prefill capped at 40%",
    ),
    "green-static-96-smtarget": Config(
        "--policy pd --partition green --green-decode-sms 96 --no-share-manager --cublas-sm-target",
        "96 SMs (a green context), alone and beside, cuBLAS sized for them; the prefill on the "
        "rest",
    ),
    "green-static-64-smtarget": Config(
        "--policy pd --partition green --green-decode-sms 64 --no-share-manager --cublas-sm-target",
        "64 SMs (a green context), alone and beside, cuBLAS sized for them; the prefill on the "
        "rest",
    ),
}
GPU_DEFAULT = (
    "aggregated",
    "none",
    "mps",
    "green",
)  # the static ones are for --only: each is a server start
TARGET_RATIO = 1.2
PREFILL_TARGET_RATIO = 2.0  # each prefill beside decode within 2x its time alone
SHARE_SAMPLE_S = (
    0.25  # how often /health is read for decode's share while a configuration is measured
)


def add_interference_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--serve-args",
        default="",
        help='arguments for every `ppd serve` (e.g. "--model /m --device cuda")',
    )
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help="a configuration: a name and its own `ppd serve` arguments; repeatable (default: "
        "aggregated, "
        "none, and cpu and thread on the CPU, or mps and green with --device cuda)",
    )
    p.add_argument(
        "--only",
        default=None,
        help="comma list: measure only these of the configurations; on a GPU also the static ones, "
        f"{', '.join(n for n in GPU_CONFIGS if n not in GPU_DEFAULT)}",
    )
    p.add_argument("--batch", type=int, default=64, help="decoding streams")
    p.add_argument("--context", type=int, default=512, help="each stream's prompt tokens")
    p.add_argument("--prefill-tokens", type=int, default=4096, help="the long prompt's tokens")
    p.add_argument("--rounds", type=int, default=5, help="long prompts, one after another")
    p.add_argument("--alone-s", type=float, default=3.0, help="seconds of decoding alone measured")
    p.add_argument("--settle-s", type=float, default=1.0, help="seconds between two long prompts")
    p.add_argument(
        "--out",
        default=None,
        help="results folder (default: interference-<UTC time> in "
        "$PPD_RESULTS_DIR, else in ./ppd-results)",
    )


def main(args: argparse.Namespace) -> None:
    serve_args = shlex.split(args.serve_args)
    gpu = option_value(serve_args, "--device") != "cpu" and _cuda_available()
    configs = configurations(gpu, args.config, args.only)
    out = results_out(args.out, "interference")
    out.mkdir(parents=True, exist_ok=True)
    settings = {
        k: getattr(args, k)
        for k in ("batch", "context", "prefill_tokens", "rounds", "alone_s", "settle_s")
    }
    results = _earlier(out, settings)
    for name, config in configs.items():
        serve_args = with_model_args(
            [*shlex.split(args.serve_args), *shlex.split(config.args)], local_model(args.model)
        )
        print(f"{name}: ppd serve {shlex.join(serve_args)}", flush=True)
        results[name] = {
            "serve_args": serve_args,
            "decode": config.decode,
            **_run(serve_args, out / f"{name}.log", args, served_gpu(serve_args) if gpu else None),
        }
        print(f"  {_line(results[name])}", flush=True)
        _write(
            out, settings, results
        )  # after each: a run stopped by a time limit keeps what it measured
    print(f"wrote {out / 'interference.md'}")
    fail_unless_measured(
        {name: results[name]["error"] for name in configs if "error" in results[name]},
        len(configs),
        "configurations",
    )


def configurations(gpu: bool, custom: list[str], only: str | None) -> dict[str, Config]:
    """The configurations a run measures: --config's (NAME=ARGS), else this device's (on a GPU those
    of GPU_DEFAULT), narrowed to --only's names, which may be any this device knows; a name it
    does not know is a BenchError naming the known ones."""
    if custom:
        if bad := [c for c in custom if "=" not in c]:
            raise BenchError(f"--config {bad[0]}: give a name and its serve arguments, NAME=ARGS")
        known = {name: Config(extra) for name, extra in (c.split("=", 1) for c in custom)}
    else:
        known = GPU_CONFIGS if gpu else CPU_CONFIGS
    if not only:
        return {n: c for n, c in known.items() if custom or not gpu or n in GPU_DEFAULT}
    names = only.split(",")
    if unknown := [n for n in names if n not in known]:
        raise BenchError(
            f"--only {only}: no configuration {unknown[0]!r} (there are {', '.join(known)})"
        )
    return {n: known[n] for n in names}


def served_gpu(serve_args: list[str]) -> str:
    """The GPU a one-unit server serves on, as a CUDA_VISIBLE_DEVICES entry: --gpus's first index
    into the visible GPUs (the first visible one without it)."""
    visible = [
        n.strip() for n in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if n.strip()
    ]
    index = int((option_value(serve_args, "--gpus") or "0").split(",")[0])
    return visible[index] if index < len(visible) else str(index)


def _run(serve_args: list[str], log: Path, args: argparse.Namespace, gpu: str | None) -> dict:
    """One configuration's measurement, or {"error": why} when its server did not start or it
    measured nothing."""
    try:
        proc, url = start_server(serve_args, log)
    except BenchError as exc:
        return {"error": one_line(exc)}
    try:
        return measure(url, args, gpu)
    except (BenchError, httpx.HTTPError) as exc:
        return {"error": f"{one_line(exc)} (log {log})"}
    finally:
        stop_server(proc)


def _earlier(out: Path, settings: dict) -> dict:
    """The results an earlier run left in out with the same settings (a later run measures the
    configurations it did not get to, and the table shows them all); none when the settings
    differ."""
    path = out / "interference.json"
    if not path.exists():
        return {}
    earlier = json.loads(path.read_text())
    return earlier["results"] if earlier.get("settings") == settings else {}


def _write(out: Path, settings: dict, results: dict) -> None:
    write_json(out / "interference.json", {"settings": settings, "results": results})
    (out / "interference.md").write_text(report(settings, results))


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def measure(url: str, args: argparse.Namespace, gpu: str | None = None) -> dict:
    """Time the long prompts alone, then start the streams, wait until each decodes, and time them
    alone and beside each long prompt; on a GPU (gpu: its CUDA_VISIBLE_DEVICES entry) read NVML all
    along."""
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
    max_len = model.get("max_model_len") or 4096
    max_tokens = max_len - args.context - 1
    if max_tokens < 16 or args.prefill_tokens >= max_len:
        raise BenchError(
            f"max_model_len {max_len} leaves no room: lower --context or --prefill-tokens"
        )
    rng = random.Random(0)
    arrivals: list[list[float]] = [[] for _ in range(args.batch)]
    ended: list[float | None] = [None] * args.batch
    refusals: list[str] = []  # what a stream answered other than 200, for the error
    stop = threading.Event()

    def long_prompts(rounds: int) -> tuple[list[tuple[float, float]], list[float]]:
        """rounds long prompts one after another, each fresh (no prefix cached): their windows and
        times (ms)."""
        windows, times = [], []
        for _ in range(rounds):
            prompt = [rng.randrange(3, 250) for _ in range(args.prefill_tokens)]
            began = time.monotonic()
            resp = httpx.post(
                f"{url}/v1/completions",
                timeout=600,
                headers={"x-ppd-route": "prefill"},
                json={"model": model["id"], "prompt": prompt, "max_tokens": 1},
            )
            done = time.monotonic()
            if resp.status_code != 200:
                raise BenchError(f"the long prompt got {resp.status_code}: {resp.text[:200]}")
            windows.append((began, done))
            times.append(1000 * (done - began))
            time.sleep(args.settle_s)
        return windows, times

    def stream(i: int) -> None:
        body = {
            "model": model["id"],
            "prompt": [rng.randrange(3, 250) for _ in range(args.context)],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as resp:
                if resp.status_code != 200:
                    refusals.append(
                        f"{resp.status_code}: {resp.read().decode(errors='replace')[:200]}"
                    )
                    return
                for line in resp.iter_lines():
                    if stop.is_set():
                        return  # leaving closes the connection: the server aborts the request
                    if line.startswith("data: {"):
                        now = time.monotonic()
                        tokens = json.loads(line[6:])["choices"][0].get("token_ids") or [0]
                        arrivals[i] += [now] * len(tokens)
        finally:
            ended[i] = time.monotonic()

    sampler = GpuSampler(gpu) if gpu is not None else None
    shares = None
    try:
        long_prompts(1)  # warms the prefill path: its first prompt is no measure of its time alone
        prefill_windows, prefill_alone_ms = long_prompts(args.rounds)
        threads = [
            threading.Thread(target=stream, args=(i,), daemon=True) for i in range(args.batch)
        ]
        for t in threads:
            t.start()
        shares = Shares(url)
        deadline = time.monotonic() + 600
        while not all(arrivals) and time.monotonic() < deadline:
            if any(e is not None for e in ended):
                said = f"; one was answered {refusals[0]}" if refusals else ""
                raise BenchError(
                    f"a stream ended before every stream was decoding{said} (see the server's log)"
                )
            time.sleep(0.05)
        time.sleep(args.settle_s)
        start = time.monotonic()
        time.sleep(args.alone_s)
        alone = (start, time.monotonic())
        beside, prefill_ms = long_prompts(args.rounds)
        if any(e is not None and e < beside[-1][1] for e in ended):
            raise BenchError(
                "a stream ended before the measurement did: lower --context, --rounds or the "
                "settle time"
            )
    finally:
        stop.set()
        if shares:
            shares.close()
        if sampler:
            sampler.close()
    for t in threads:
        t.join(timeout=30)
    tpot_alone = _tpot(arrivals, *alone)
    if tpot_alone == float("inf"):
        raise BenchError(
            f"no stream received a token in the {args.alone_s} s alone: the server stalled"
        )
    tpots = [_tpot(arrivals, a, b) for a, b in beside]
    tpot_beside = statistics.median(tpots)
    return {
        "tpot_alone_ms": tpot_alone,
        "tpot_beside_ms": tpot_beside,
        "tpot_beside_each_ms": tpots,
        "ratio": tpot_beside / tpot_alone,
        "prefill_ms": statistics.median(prefill_ms),
        "prefill_each_ms": prefill_ms,
        "prefill_alone_ms": statistics.median(prefill_alone_ms),
        "prefill_alone_each_ms": prefill_alone_ms,
        "prefill_ratio": statistics.median(prefill_ms) / statistics.median(prefill_alone_ms),
        "decode_share_alone": shares.during(*alone),
        "decode_share_beside": sorted(set().union(*(shares.during(*window) for window in beside))),
        "gpu": gpu_sampler.readings(
            sampler, {"prefill alone": prefill_windows, "decode alone": [alone], "beside": beside}
        ),
    }


class Shares:
    """Decode's share of the device (SMs, or cores) as the server reports it on /health, read every
    SHARE_SAMPLE_S while a configuration is measured. A server reports it where it splits the device
    (green, cpu), not under mps, none or aggregated: there the configuration's description says what
    decode had."""

    def __init__(self, url: str) -> None:
        self.url, self.samples, self.stop = url, [], threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while not self.stop.wait(SHARE_SAMPLE_S):
            try:
                partition = httpx.get(f"{self.url}/health", timeout=2).json()["units"][0][
                    "partition"
                ]
            except (httpx.HTTPError, ValueError, KeyError, IndexError):
                continue
            if "decode_share" in partition:
                self.samples.append((time.monotonic(), int(partition["decode_share"])))

    def during(self, start: float, end: float) -> list[int]:
        """The distinct shares read in [start, end), ascending."""
        return sorted({share for t, share in self.samples if start <= t < end})

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def _tpot(arrivals: list[list[float]], start: float, end: float) -> float:
    """Milliseconds per output token of every stream in [start, end): the window times the streams
    over the tokens they received in it."""
    tokens = sum(sum(1 for t in times if start <= t < end) for times in arrivals)
    if tokens == 0:
        return float("inf")  # nothing arrived: the streams stalled for the whole window
    return 1000 * (end - start) * len(arrivals) / tokens


def _line(result: dict) -> str:
    if "error" in result:
        return f"error: {result['error']}"
    return (
        f"TPOT alone {result['tpot_alone_ms']:.2f} ms, beside the prefill "
        f"{result['tpot_beside_ms']:.2f} ms "
        f"({result['ratio']:.2f}x); prefill alone {result['prefill_alone_ms']:.0f} ms, beside "
        f"{result['prefill_ms']:.0f} ms ({result['prefill_ratio']:.2f}x)"
    )


def report(settings: dict, results: dict) -> str:
    whole = results.get("none", {}).get("tpot_alone_ms")  # decode alone on the whole device
    lines = [
        "# Decode TPOT beside a long prefill, and the prefill beside decode",
        "",
        f"{settings['batch']} streams of {settings['context']}-token prompts decoding; "
        f"{settings['rounds']} "
        f"prompts of {settings['prefill_tokens']} tokens sent one after another (`ppd bench "
        "interference`). "
        "TPOT beside is the median over the prompts. ratio: TPOT beside over TPOT alone in the "
        "same "
        "configuration (where decode's share is the same in both, what the prefill's contention "
        "costs decode). "
        "Against none's TPOT alone (decode alone on the whole device): TPOT alone, what decode's "
        "share costs it "
        f"(SM loss); TPOT beside, the target measure, {TARGET_RATIO} or less"
        + ("" if whole else " (none was not measured with these settings)")
        + ". Prefill: the prompts' time "
        "to their first token, median, alone (the same server before the streams start, after one "
        "unmeasured "
        f"prompt) and beside the streams; the target is beside / alone {PREFILL_TARGET_RATIO} or "
        "less. "
        "Decode's share: what the server reported on /health while decode ran alone / beside the "
        "prefills "
        "(SMs on a GPU, cores on the CPU; -: not reported).",
        "",
        "| config | decode had | decode's share alone / beside | TPOT alone (ms) | TPOT beside the "
        "prefill (ms) "
        "| ratio | alone / none alone | beside / none alone | prefill alone (ms) | prefill beside "
        "(ms) "
        "| prefill beside / alone | serve arguments |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, r in results.items():
        args = f"`{shlex.join(r['serve_args'])}`"
        head = f"| {name} | {r.get('decode', '')} |"
        if "error" in r:
            lines.append(f"{head} | | | | | | | | | | {args}: {r['error']} |")
            continue
        shares = " / ".join(
            ", ".join(map(str, r.get(k) or [])) or "-"
            for k in ("decode_share_alone", "decode_share_beside")
        )
        against = (
            f"{r['tpot_alone_ms'] / whole:.2f} | {r['tpot_beside_ms'] / whole:.2f}"
            if whole
            else " | "
        )
        alone = r.get("prefill_alone_ms")  # none in a table an earlier version wrote
        prefill = (
            f"{alone:.0f} | {r['prefill_ms']:.0f} | {r['prefill_ratio']:.2f}"
            if alone
            else f" | {r['prefill_ms']:.0f} | "
        )
        lines.append(
            f"{head} {shares} | {r['tpot_alone_ms']:.2f} | {r['tpot_beside_ms']:.2f} | "
            f"{r['ratio']:.2f} | "
            f"{against} | {prefill} | {args} |"
        )
    return (
        "\n".join(
            lines + gpu_sampler.markdown({n: r["gpu"] for n, r in results.items() if "gpu" in r})
        )
        + "\n"
    )
