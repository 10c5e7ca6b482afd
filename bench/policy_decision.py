"""How long the ppd policy takes to decide a route, with a table loaded: `python -m
bench.policy_decision`.

Times PPDPolicy.route one call at a time (perf_counter_ns around each) over requests drawn across
the table's cells and live states, and, for context, the router's whole placement of a request
(prefix hashing of the prompt, unit choice, the decision), which grows with the prompt. Reports
medians and 99th percentiles in microseconds, and writes them as JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

from profiles import cpu_device_name
from server.routing.policy import Objective, PPDPolicy, UnitLive
from server.routing.policy_table import Cell, PolicyTable, RouteStats, table_path
from server.routing.router import Router


def synthetic_table() -> PolicyTable:
    """A table of the GPU grid's size with made-up latencies (the decision's cost does not depend on
    the values)."""
    rng = random.Random(0)
    contexts, shapes, loads = [1280, 4352], [(64, 512), (256, 256), (1024, 64)], [4, 16, 64]
    cells = {}
    for key in ((i, j, k) for i in range(2) for j in range(3) for k in range(3)):
        cells[key] = Cell(
            {
                r: RouteStats(
                    rng.uniform(50, 500),
                    rng.uniform(100, 900),
                    rng.uniform(10, 40),
                    rng.uniform(20, 80),
                    rng.uniform(0, 100),
                    100,
                )
                for r in ("prefill", "decode")
            }
        )
    return PolicyTable(contexts, shapes, loads, cells, device="synthetic", model="synthetic")


def percentiles(ns: list[int]) -> dict[str, float]:
    ordered = sorted(ns)
    return {
        "median_us": statistics.median(ordered) / 1000,
        "p99_us": ordered[int(0.99 * (len(ordered) - 1))] / 1000,
        "calls": len(ordered),
    }


def time_decisions(policy: PPDPolicy, calls: int, seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)
    requests = [
        (
            rng.choice([64, 300, 1200, 5000]),
            rng.choice([8, 64, 256, 1024]),
            rng.choice([8, 64, 256, 512]),
            rng.randint(1, 80),
            UnitLive(
                rng.randint(0, 20_000),
                rng.uniform(1_000, 30_000),
                rng.uniform(5, 30),
                rng.uniform(500, 20_000),
            ),
        )
        for _ in range(1000)
    ]
    route, clock = policy.route, time.perf_counter_ns
    times = []
    for i in range(calls):
        cached, new, output, load, live = requests[i % 1000]
        start = clock()
        route(cached, new, output, load, live)
        times.append(clock() - start)
    return percentiles(times)


def time_placements(policy: PPDPolicy, calls: int, prompt_tokens: int) -> dict[str, float]:
    router = Router(1, 16, policy, capacity_blocks=100_000)
    history = list(range(prompt_tokens))
    router.route(history, [0])
    router.finished(0, history)
    times = []
    for i in range(calls):
        prompt = history + [i % 50_000 + 1] * 16
        start = time.perf_counter_ns()
        placed = router.route(prompt, [0], 64)
        times.append(time.perf_counter_ns() - start)
        router.load[placed.unit] -= 1
    return percentiles(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--table",
        default=None,
        help="a policy table (default: this machine's shipped one, "
        "else a synthetic table of the GPU grid's size)",
    )
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    path = Path(args.table) if args.table else table_path(cpu_device_name(), "demo-v2")
    table = PolicyTable.load(path) if path.exists() else synthetic_table()
    policy = PPDPolicy(table, Objective())
    result = {
        "table": str(path) if path.exists() else "synthetic (GPU grid size)",
        "cells": len(table.cells),
        "decision": time_decisions(policy, args.calls),
        "placement_1k_prompt": time_placements(policy, args.calls // 10, 1024),
        "placement_8k_prompt": time_placements(policy, args.calls // 20, 8192),
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cores": len(os.sched_getaffinity(0)),
    }
    for name in ("decision", "placement_1k_prompt", "placement_8k_prompt"):
        r = result[name]
        print(
            f"{name:22s} median {r['median_us']:7.2f} us   p99 {r['p99_us']:7.2f} us   "
            f"({r['calls']} calls)"
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
