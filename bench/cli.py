"""`ppd bench` (one load against a running server) and `ppd bench compare` (policies and peers side by side)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from scheduler.config import POLICIES

if TYPE_CHECKING:
    from bench.client import Conversation, RequestRecord

# The client, workloads and report (aiohttp, matplotlib) are imported where used: `ppd serve` parses these flags too.

SERVER_START_TIMEOUT_S = 300


class BenchError(Exception):
    """A bad command line or an unreachable server: printed, exit code 2."""


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", default="synthetic", choices=["synthetic", "sharegpt", "mt-bench"])
    g.add_argument("--profile", default="mixed", choices=["decode-heavy", "balanced", "prefill-heavy", "mixed"],
                   help="synthetic: the turn-2+ shape (PPD paper)")
    g.add_argument("--turn1", default="mixed", choices=["short", "long", "mixed"], help="synthetic: turn-1 length")
    g.add_argument("--turns", type=int, default=2, help="synthetic: turns per conversation")
    g.add_argument("--scale", type=float, default=1.0, help="synthetic: multiply every length (e.g. 0.0625 for the CPU demo)")
    g.add_argument("--dataset", default=None, help="sharegpt / mt-bench: a file (default: the packaged one)")
    g.add_argument("--max-input-tokens", type=int, default=None,
                   help="sharegpt: end a conversation before a turn whose prompt would pass this (default: fits the "
                        "server's max_model_len)")
    g.add_argument("--max-output-tokens", type=int, default=1024, help="sharegpt: cap on each answer's max_tokens")
    g.add_argument("--num-conversations", type=int, default=200, help="distinct conversations (cycled if the run is longer)")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer folder for exact text lengths (default: the served model's folder when it is local)")
    g.add_argument("--api", default="chat", choices=["chat", "completions"],
                   help="completions sends token ids (exact lengths, needs return_token_ids for later turns)")
    g.add_argument("--seed", type=int, default=0)
    load = p.add_argument_group("load")
    load.add_argument("--duration", type=float, default=60.0, help="seconds; no new turn is sent after it")
    load.add_argument("--timeout", type=float, default=300.0, help="seconds; a slower request counts as failed")
    load.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS",
                      help="SLOs for goodput, e.g. ttft:500 tpot:50 (milliseconds)")
    load.add_argument("--objective", default="1,10", metavar="W_TTFT,W_TPOT",
                      help="weights of the turn-2+ objective w_ttft*TTFT p50 + w_tpot*TPOT p50 in the report "
                           "(default 1,10: the ppd policy's)")
    load.add_argument("--out", default=None, help="folder for summary.json, report.md, records and plots")
    load.add_argument("--no-progress", action="store_true")


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="an OpenAI-compatible server (no /v1)")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--qps", type=float, default=None, help="conversation arrivals per second (Poisson)")
    rate.add_argument("--concurrency", type=int, default=None, help="closed loop: conversations in flight")
    add_workload_args(p)
    sub = p.add_subparsers(dest="bench_command")
    compare = sub.add_parser("compare", help="run the same workload on each policy (or server) over a sweep of rates")
    compare.add_argument("--policies", default=",".join(POLICIES), help="our policies to start a server for (comma list; '' for none)")
    compare.add_argument("--server", action="append", default=[], metavar="NAME=URL",
                         help="also measure a running server (e.g. vllm=http://host:8000); repeatable")
    compare.add_argument("--serve-args", default="", help="extra arguments for each `ppd serve` (e.g. \"--model /m --units 2\")")
    compare.add_argument("--repeat", type=int, default=1,
                         help="runs per point (distinct conversations); the report gives each figure's median")
    compare.add_argument("--interleave", action="store_true",
                         help="run the repeats as rounds: each server once per point per round (a fresh server each "
                              "round), so that a slow drift of the machine falls on all of them alike")
    rates = compare.add_mutually_exclusive_group()
    rates.add_argument("--qps", dest="qps_list", default=None, help="comma list of conversation arrival rates")
    rates.add_argument("--concurrency", dest="concurrency_list", default=None, help="comma list of closed-loop concurrencies")
    add_workload_args(compare)
    from bench.engine import add_engine_args
    add_engine_args(sub.add_parser("engine", help="the engine alone on one device, every figure beside its hardware floor"))


def main(args: argparse.Namespace) -> None:
    if getattr(args, "bench_command", None) == "engine":
        from bench.engine import main as engine_main
        engine_main(args)
        return
    from bench.report import parse_goodput, parse_weights

    try:
        goodput = parse_goodput(args.goodput)
        args.weights = parse_weights(args.objective)
    except ValueError as exc:
        raise BenchError(str(exc)) from exc
    if getattr(args, "bench_command", None) == "compare":
        compare(args, goodput)
    else:
        run_one(args, goodput)


def run_one(args: argparse.Namespace, goodput: dict[str, float]) -> None:
    if args.qps is None and args.concurrency is None:
        raise BenchError("give the load: --qps RATE (Poisson conversation arrivals) or --concurrency N (closed loop)")
    from bench.report import markdown_table, write_report

    model, served = _server_model(args.url, args.model)
    conversations = _workload(args, served, args.seed)
    out = Path(args.out or _default_out("bench"))
    summary, records = _measure(args, args.url, model, conversations, args.qps, args.concurrency, goodput,
                                {"server": args.url, "qps": args.qps, "concurrency": args.concurrency})
    if summary.get("interrupted"):
        print("\ninterrupted: reporting what was measured", file=sys.stderr)
    write_report([summary], out, {"run": records})
    print(markdown_table([summary]))
    print(f"\nwritten to {out}", file=sys.stderr)


def compare(args: argparse.Namespace, goodput: dict[str, float]) -> None:
    from bench.report import markdown_table, median_of_runs, write_report

    points = _sweep(args)
    policies = [p for p in args.policies.split(",") if p]
    if bad := [p for p in policies if p not in POLICIES]:
        raise BenchError(f"unknown policy {', '.join(bad)}; choose from {', '.join(POLICIES)}")
    peers = []
    for item in args.server:
        name, sep, url = item.partition("=")
        if not sep or not url.startswith("http"):
            raise BenchError(f"--server {item!r}: expected NAME=URL, e.g. vllm=http://127.0.0.1:8001")
        peers.append((name, url))
    if not policies and not peers:
        raise BenchError("nothing to compare: give --policies and/or --server NAME=URL")
    out = Path(args.out or _default_out("compare"))
    targets = [(f"ppd:{p}", None, p) for p in policies] + [(n, u, None) for n, u in peers]
    # Interleaved: every server gets one run per point per round, the rounds in turn, so that a drift of the
    # machine's speed over the minutes of a comparison falls on every server alike.
    rounds, per_round = (args.repeat, 1) if args.interleave else (1, args.repeat)
    runs: dict[tuple[str, int], list[dict]] = {(t[0], i): [] for t in targets for i in range(len(points))}
    records: dict[str, list] = {}
    try:
        for rnd in range(rounds):
            for name, url, server in targets:
                proc = None
                if server:
                    log = out / (f"serve-{server}-round{rnd}.log" if args.interleave else f"serve-{server}.log")
                    proc = start_server(["--policy", server, *shlex.split(args.serve_args)], log)
                    print(f"started {server}: {proc[1]}", file=sys.stderr)
                try:
                    base = proc[1] if proc else url
                    model, served = _server_model(base, args.model)
                    for i, (qps, concurrency) in enumerate(points):
                        label = {"server": name, "qps": qps, "concurrency": concurrency}
                        for r in range(per_round):
                            run = rnd + r  # one of the two is 0
                            # A fresh seed per run: conversations of an earlier run must not hit this one's cache.
                            conversations = _workload(args, served, args.seed + 1000 * i + run)
                            summary, recs = _measure(args, base, model, conversations, qps, concurrency, goodput,
                                                     label)
                            runs[(name, i)].append(summary)
                            records[f"{name}-{qps or concurrency}-run{run}"] = recs
                            if summary.get("interrupted"):
                                raise KeyboardInterrupt
                finally:
                    if proc:
                        stop_server(proc[0])
    except KeyboardInterrupt:
        print("\ninterrupted: reporting what was measured", file=sys.stderr)
    summaries = [median_of_runs(runs[(t[0], i)]) for t in targets for i in range(len(points)) if runs[(t[0], i)]]
    if summaries:
        write_report(summaries, out, records)
        print(markdown_table(summaries))
        print(f"\nwritten to {out}", file=sys.stderr)


def _measure(args, url: str, model: str, conversations: list[Conversation], qps: float | None, concurrency: int | None,
             goodput: dict[str, float], label: dict) -> tuple[dict, list[RequestRecord]]:
    """One load run; Ctrl-C ends it early and the summary covers what completed."""
    from bench.client import LoadConfig, run_load
    from bench.report import summarize

    cfg = LoadConfig(base_url=url, model=model, api=args.api, qps=qps, concurrency=concurrency, duration=args.duration,
                     timeout=args.timeout, seed=args.seed)
    records: list[RequestRecord] = []
    started = time.perf_counter()
    interrupted = False
    try:
        asyncio.run(run_load(cfg, conversations, progress=not args.no_progress, records=records))
    except KeyboardInterrupt:
        interrupted = True
    summary = summarize(records, time.perf_counter() - started, goodput, label, args.weights)
    if interrupted:
        summary["interrupted"] = True
    return summary, records


def _sweep(args: argparse.Namespace) -> list[tuple[float | None, int | None]]:
    try:
        if args.concurrency_list:
            return [(None, int(c)) for c in args.concurrency_list.split(",")]
        return [(float(q), None) for q in (args.qps_list or "1,2,4").split(",")]
    except ValueError as exc:
        raise BenchError(f"bad sweep list: {exc}; expected e.g. --qps 0.5,1,2") from exc


def _workload(args: argparse.Namespace, served: dict, seed: int) -> list[Conversation]:
    from bench.workloads import load_workload

    tokenizer = None
    root = served.get("root")
    folder = args.tokenizer or (root if root and os.path.isdir(root) else None)
    needs_tokenizer = args.workload == "synthetic" and args.api == "chat"
    if folder:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(folder)
    elif needs_tokenizer:
        raise BenchError("exact prompt lengths need the model's tokenizer: pass --tokenizer FOLDER (or --api completions)")
    if args.workload == "synthetic":
        options = dict(profile=args.profile, turn1=args.turn1, turns=args.turns, scale=args.scale, api=args.api)
    elif args.workload == "sharegpt":
        max_input = args.max_input_tokens
        if max_input is None and served.get("max_model_len"):
            # Room for the answer and for chat-template tokens, which the workload does not count.
            max_input = int(0.9 * served["max_model_len"]) - args.max_output_tokens
        options = dict(path=args.dataset, max_input_tokens=max_input, max_output_tokens=args.max_output_tokens)
    else:
        options = dict(path=args.dataset)
    try:
        return load_workload(args.workload, num_conversations=args.num_conversations, seed=seed, tokenizer=tokenizer, **options)
    except (OSError, ValueError) as exc:
        raise BenchError(str(exc)) from exc


def _server_model(url: str, model: str | None) -> tuple[str, dict]:
    """(model name, its /v1/models entry: 'root' and 'max_model_len' when the server reports them)."""
    try:
        data = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        raise BenchError(f"cannot list models at {url}/v1/models ({exc}); is the server running?") from exc
    by_id = {m["id"]: m for m in data}
    if model is None:
        if not data:
            raise BenchError(f"{url} serves no model")
        model = data[0]["id"]
    if model not in by_id:
        raise BenchError(f"{url} does not serve {model!r}; it serves {', '.join(by_id)}")
    return model, by_id[model]


def start_server(serve_args: list[str], log: Path, env: dict[str, str] | None = None,
                 timeout: float = SERVER_START_TIMEOUT_S) -> tuple[subprocess.Popen, str]:
    """`ppd serve <serve_args>` on a free port, returned once /health says ready; its output goes to log."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "server.cli", "serve", "--port", str(port), *serve_args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"`{shlex.join(cmd)}` exited with {proc.returncode}:\n{log.read_text()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        time.sleep(0.1)
    stop_server(proc)
    raise BenchError(f"`{shlex.join(cmd)}` not ready after {timeout}s:\n{log.read_text()}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _default_out(kind: str) -> str:
    return os.path.join("bench", "results", f"{kind}-{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}")
