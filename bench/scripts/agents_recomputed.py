#!/usr/bin/env python3
"""What eviction cost each configuration of bench/scripts/agents_smollm2.sh, from its records.

Over turns 2+: the tokens of whole blocks whose KV an earlier turn of the session computed (its
prompt and answer, but the answer's last token, which is sampled and never run through the model),
less the tokens the server reported cached; and the working set at a run's end (the sum over its
sessions of their last context). Blocks are the server's own: ppd's 16 tokens, vLLM's CPU build's
128 (a prefix cache keeps whole blocks only, so a partial one is no eviction's cost). Usage:
agents_recomputed.py OUT
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import statistics
import sys

BLOCK = 16
SERVERS = ("ppd_notier", "ppd_tier", "ppd_hints", "vllm")
BLOCKS = {"vllm": 128}  # vLLM's CPU KV blocks (its log: 182 blocks for 23,296 tokens)


def run_figures(run: str, block: int = BLOCK) -> tuple[int, int]:
    """(whole-block tokens recomputed, working set at the end) of one run's records."""
    with gzip.open(glob.glob(f"{run}/records.jsonl*")[0], "rt") as f:
        ok = [r for r in map(json.loads, f) if r["error"] is None]
    later = [r for r in ok if r.get("history_tokens") and r.get("cached_tokens") is not None]
    again = sum(
        max(0, (r["history_tokens"] - 1) // block * block - r["cached_tokens"]) for r in later
    )
    last: dict[str, int] = collections.defaultdict(int)
    for r in ok:
        context = r["prompt_tokens"] + r["output_tokens"]
        last[r["conversation"]] = max(last[r["conversation"]], context)
    return again, sum(last.values())


def main(out: str) -> None:
    medians = {}
    for name in SERVERS:
        runs = [
            run_figures(run, BLOCKS.get(name, BLOCK))
            for run in sorted(glob.glob(f"{out}/{name}-*-run*"))
        ]
        again = [a for a, _ in runs]
        medians[name] = statistics.median(again)
        print(
            f"{name}: whole-block tokens recomputed per run {again} (median {medians[name]:.0f}); "
            f"working set at the end {[w for _, w in runs]} tokens"
        )
    for name in SERVERS[1:]:
        print(f"{name} over ppd_notier: {medians[name] / medians['ppd_notier']:.3f}")


if __name__ == "__main__":
    main(sys.argv[1])
