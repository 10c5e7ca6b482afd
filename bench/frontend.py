"""`ppd bench frontend`: how many streamed tokens per second the API server itself can deliver.

The server runs with the stub engine (`ppd serve --stub-engine MS`: a token per running request
every MS milliseconds, no model), so the engine is never the limit. For each count of concurrent
streams, every stream asks for the same number of tokens at once; the run reports what the clients
received (tokens/s, chunks/s, the inter-chunk delay's median and p99, which a perfect front end
keeps at MS) and what the API server process spent (its CPU seconds, read from /proc, per thousand
tokens: the front end's cost, whatever the client's).

On a small machine the client shares the cores with the server; the API server's CPU per token is
then the figure to compare, and its ceiling is one core's worth of it (a single event loop uses one
core).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from time import perf_counter

import aiohttp
import httpx
import msgspec

from bench.servers import start_server, stop_server
from profiles import results_dir

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


class _Choice(msgspec.Struct):
    token_ids: list[int] = []


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []


def add_frontend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--streams", default="64,256,1024", help="concurrent stream counts, comma-separated"
    )
    p.add_argument("--tokens", type=int, default=256, help="tokens per stream")
    p.add_argument(
        "--step-ms",
        type=float,
        default=20.0,
        help="the stub engine's step (one token per stream each)",
    )
    p.add_argument(
        "--rounds", type=int, default=3, help="runs per stream count (figures are medians)"
    )
    p.add_argument(
        "--serve-args", default="", help="more `ppd serve` arguments, e.g. '--api-server-count 4'"
    )
    p.add_argument(
        "--client-procs",
        type=int,
        default=1,
        help="client processes sharing the streams (on a many-core host one client process is a "
        "limit)",
    )
    p.add_argument("--out", default=None, help="folder for results.json and results.md")


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of processes, in seconds."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def api_server_pids(pid: int, url: str) -> list[int]:
    """The API-server processes of a server: its main process and its children that are no unit's
    worker (--api-server-count)."""
    workers = {
        w["pid"]
        for unit in httpx.get(f"{url}/health", timeout=5).json()["units"]
        for w in unit["workers"]
    }
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return [pid, *(c for c in children if c not in workers and _is_api_server(c))]


def _is_api_server(pid: int) -> bool:
    """An API server by its title (ppd::api-N), or a child started by multiprocessing's spawn where
    setproctitle is missing (an API server or a worker), not its resource tracker."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return False
    return cmdline.startswith(b"ppd::api-") or b"spawn_main" in cmdline


async def one_stream(
    session: aiohttp.ClientSession, url: str, tokens: int, gaps: list[float], counts: list[int]
) -> None:
    decode = msgspec.json.Decoder(_Chunk).decode
    body = {
        "model": "demo",
        "prompt": PROMPT,
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    last = None
    got = 0
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            now = perf_counter()
            n = sum(len(c.token_ids) for c in decode(line[6:]).choices)
            if not n:
                continue
            if last is not None:
                gaps.append(now - last)
            last, got = now, got + n
    counts.append(got)


async def load(url: str, streams: int, tokens: int) -> dict:
    gaps: list[float] = []
    counts: list[int] = []
    connector = aiohttp.TCPConnector(limit=streams)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None)
    ) as session:
        started = perf_counter()
        results = await asyncio.gather(
            *(one_stream(session, url, tokens, gaps, counts) for _ in range(streams)),
            return_exceptions=True,
        )
        seconds = perf_counter() - started
    errors = [r for r in results if isinstance(r, BaseException)]
    return {
        "seconds": seconds,
        "tokens": sum(counts),
        "chunks": len(gaps) + len(counts),
        "errors": len(errors),
        "short_streams": sum(1 for c in counts if c != tokens),
        "error": repr(errors[0]) if errors else None,
        "gaps": gaps,
    }


def _load_in_process(url: str, streams: int, tokens: int) -> dict:
    return asyncio.run(load(url, streams, tokens))


def run_load(url: str, streams: int, tokens: int, procs: int = 1) -> dict:
    """`streams` streams from `procs` client processes (one client process's core is a limit of its
    own on a many-core host), merged: the delays of all, the time of the slowest."""
    if procs <= 1:
        parts = [_load_in_process(url, streams, tokens)]
    else:
        shares = [streams // procs + (i < streams % procs) for i in range(procs)]
        with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) as pool:
            parts = list(pool.map(_load_in_process, [url] * procs, shares, [tokens] * procs))
    gaps = sorted(g for p in parts for g in p["gaps"])
    return {
        "seconds": max(p["seconds"] for p in parts),
        "tokens": sum(p["tokens"] for p in parts),
        "chunks": sum(p["chunks"] for p in parts),
        "errors": sum(p["errors"] for p in parts),
        "short_streams": sum(p["short_streams"] for p in parts),
        "error": next((p["error"] for p in parts if p["error"]), None),
        "gap_p50_ms": 1000 * gaps[len(gaps) // 2] if gaps else None,
        "gap_p99_ms": 1000 * gaps[int(len(gaps) * 0.99)] if gaps else None,
    }


def main(args: argparse.Namespace) -> dict:
    counts = [int(s) for s in args.streams.split(",")]
    most = max(counts)
    out = Path(args.out or results_dir() / "frontend")
    serve = [
        "--model",
        "demo",
        "--served-model-name",
        "demo",
        "--stub-engine",
        str(args.step_ms),
        "--max-num-seqs",
        str(most),
        "--max-num-batched-tokens",
        str(max(most, 2048)),
        "--max-waiting-requests",
        "0",
        "--max-queue-time-s",
        "0",
        *args.serve_args.split(),
    ]  # no 429: all stream
    proc, url = start_server(serve, out / "server.log")
    rows = []
    try:
        for streams in counts:
            runs = []
            for _ in range(args.rounds):
                pids = api_server_pids(proc.pid, url)
                cpu0 = cpu_seconds(pids)
                run = run_load(url, streams, args.tokens, args.client_procs)
                run["server_cpu_s"] = cpu_seconds(pids) - cpu0
                run["api_servers"] = len(pids)
                runs.append(run)
            rows.append(summarize(streams, args, runs))
            print(json.dumps(rows[-1]))
    finally:
        stop_server(proc)
    result = {
        "command": "ppd bench frontend "
        + " ".join(
            f"--{k.replace('_', '-')} {v}"
            for k, v in vars(args).items()
            if k in ("streams", "tokens", "step_ms", "rounds", "serve_args", "client_procs")
            and v not in ("", 1)
        ),
        "cpus": os.cpu_count(),
        "rows": rows,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "results.md").write_text(markdown(result))
    return result


def summarize(streams: int, args: argparse.Namespace, runs: list[dict]) -> dict:
    def med(key: str) -> float | None:
        values = [r[key] for r in runs if r[key] is not None]
        return statistics.median(values) if values else None

    return {
        "streams": streams,
        "tokens_per_stream": args.tokens,
        "step_ms": args.step_ms,
        "tokens_per_s": statistics.median(r["tokens"] / r["seconds"] for r in runs),
        "chunks_per_s": statistics.median(r["chunks"] / r["seconds"] for r in runs),
        "gap_p50_ms": med("gap_p50_ms"),
        "gap_p99_ms": med("gap_p99_ms"),
        "server_cores": statistics.median(r["server_cpu_s"] / r["seconds"] for r in runs),
        "server_cpu_ms_per_1k_tokens": statistics.median(
            1e6 * r["server_cpu_s"] / r["tokens"] for r in runs
        ),
        "errors": sum(r["errors"] for r in runs),
        "short_streams": sum(r["short_streams"] for r in runs),
        "first_error": next((r["error"] for r in runs if r["error"]), None),
        "api_servers": runs[0]["api_servers"],
        "rounds": len(runs),
    }


def markdown(result: dict) -> str:
    lines = [
        f"`{result['command']}` on {result['cpus']} CPUs; medians of the rounds.",
        "",
        "| streams | tokens/s | chunks/s | gap p50 ms | gap p99 ms | API server cores | server CPU "
        "ms / 1k tokens | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['streams']} | {r['tokens_per_s']:.0f} | {r['chunks_per_s']:.0f} | "
            f"{r['gap_p50_ms']:.1f} | "
            f"{r['gap_p99_ms']:.1f} | {r['server_cores']:.2f} | "
            f"{r['server_cpu_ms_per_1k_tokens']:.1f} | "
            f"{r['errors']} |"
        )
    return "\n".join(lines) + "\n"
