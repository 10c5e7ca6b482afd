"""Does the ppd policy's decode route predict what an inline append costs a mixture of experts'
decode batch? `python -m bench.moe_inline [--model FOLDER] [--out DIR]`.

An inline append adds to the decode step its tokens' compute and, of a mixture of experts, the
experts its tokens route to that the batch's own tokens do not read: many at a batch of one, almost
none at a large batch. The decode worker fits the two costs over the appends it runs
(scheduler.decode_worker.StepTimes) and the policy predicts an append's cost from them
(PPDPolicy.inline_ms). This measures, on one engine with dummy weights (uniform routing), decode
steps at several batch sizes and the same steps with an append of several sizes; then predicts each
(batch, append) point from the costs fitted on all the others (leave one out), against a cost per
token alone fitted over the same points (what the policy counted before). Reports each point's
measured and predicted extra milliseconds, and each prediction's errors.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
from pathlib import Path

import torch

from bench.engine import (
    Grid,
    engine_config,
    routed_experts,
    start_engine,
    token_ids,
    write_results,
)
from engine.config import ModelConfig
from engine.cpu_isa import isa
from engine.model_runner import StepInput
from engine.step_timing import Blocks, release_engine, time_step
from scheduler.decode_worker import StepTimes
from server.routing.policy import Objective, PPDPolicy, UnitLive

STANDIN = Path(__file__).parent / "models" / "qwen3-30b-a3b-standin"
# The tiny model measured by default: Qwen3-30B-A3B's stand-in with 4 layers of 32 experts of width
# 256 and a vocabulary of 2,048 (the stand-in's 151,936-row head would take most of a CPU's decode
# step, hiding what the experts cost).
TINY = {
    "num_hidden_layers": 4,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 256,
    "vocab_size": 2048,
    "max_window_layers": 4,
}
BATCHES = (1, 2, 4, 8, 16)
APPENDS = (8, 32, 128)
CONTEXT = 256  # each decode's and the append's cached tokens


def measure(model: str, device: str, repeat: int, rounds: int) -> list[dict]:
    """Each (batch, append) point's decode step and mixed step (medians of `rounds` rounds of
    medians of `repeat` runs), and the experts the decode tokens and all tokens routed to."""
    grid = Grid(
        BATCHES,
        (CONTEXT,),
        (),
        (),
        tuple((b, CONTEXT, n, CONTEXT) for b in BATCHES for n in APPENDS),
        max(APPENDS) + max(BATCHES),
        repeat,
    )
    engine = start_engine(engine_config(model, torch.device(device), grid))
    try:
        blocks = Blocks(engine.num_kv_blocks, engine.plan.block_size)
        points = []
        for b in BATCHES:
            decodes = [
                StepInput(token_ids(engine, 1, i), CONTEXT, blocks.table(CONTEXT + 1))
                for i in range(b)
            ]
            for n in APPENDS:
                append = StepInput(
                    token_ids(engine, n, 100 + n), CONTEXT, blocks.table(CONTEXT + n)
                )
                decode_ms, mixed_ms = [], []
                for _ in range(rounds):  # alternated, so drift in the machine's speed hits both
                    decode_ms.append(time_step(engine, decodes, repeat, graphs=False)[0])
                    mixed_ms.append(time_step(engine, [*decodes, append], repeat, graphs=False)[0])
                points.append(
                    {
                        "batch": b,
                        "new": n,
                        "decode_ms": statistics.median(decode_ms),
                        "mixed_ms": statistics.median(mixed_ms),
                        "decode_experts": routed_experts(engine, decodes),
                        "mixed_experts": routed_experts(engine, [*decodes, append]),
                    }
                )
        return points
    finally:
        release_engine(engine)


def predict(points: list[dict], mcfg: ModelConfig) -> None:
    """Each point's extra milliseconds as predicted from the others, by the policy with the fitted
    expert cost (`moe_ms`) and by a cost per token alone, fitted over the same points
    (`per_token_ms`)."""
    for p in points:
        p["extra_ms"] = p["mixed_ms"] - p["decode_ms"]
        p["expected_added_experts"] = mcfg.expected_experts(
            p["batch"] + p["new"]
        ) - mcfg.expected_experts(p["batch"])
    policy = PPDPolicy(None, Objective())
    policy.experts = mcfg.expected_experts
    for held in points:
        moe, dense = StepTimes(mcfg.expected_experts), StepTimes()
        for p in points:
            if p is not held:
                moe.fit_experts(p["new"], p["expected_added_experts"], p["extra_ms"])
                dense.fit_experts(p["new"], 0.0, p["extra_ms"])
        live = UnitLive(
            decode_batch=held["batch"],
            inline_tokens_per_s=moe.inline_tokens_per_s,
            inline_expert_ms=moe.expert_ms,
        )
        held["moe_ms"] = policy.inline_ms(held["new"], live, moe.inline_tokens_per_s)
        held["per_token_ms"] = 1000.0 * held["new"] / dense.inline_tokens_per_s


def summary(points: list[dict]) -> dict:
    """Each prediction's errors: of the extra milliseconds (median, relative), and of the whole
    mixed step, what a TPOT is made of (median and largest, relative to the measured step)."""
    out = {}
    for key in ("moe_ms", "per_token_ms"):
        misses = [abs(p[key] - p["extra_ms"]) for p in points]
        out[key] = {
            "median_error": statistics.median(
                m / abs(p["extra_ms"]) for m, p in zip(misses, points)
            ),
            "median_step_error": statistics.median(
                m / p["mixed_ms"] for m, p in zip(misses, points)
            ),
            "max_step_error": max(m / p["mixed_ms"] for m, p in zip(misses, points)),
        }
    return out


def markdown(points: list[dict], totals: dict, meta: dict) -> str:
    lines = [
        f"# An inline append's cost to a mixture of experts' decode step: {meta['model']} on "
        f"{meta['device']}",
        "",
        f"`{meta['command']}`; {meta['cpu']}. Step times are medians of {meta['rounds']} rounds of "
        f"medians of {meta['repeat']} runs; each point's prediction comes from the costs fitted on "
        "the other points.",
        "",
        "| batch | append | decode step (ms) | extra (ms) | experts added (routed / expected) "
        "| predicted with experts (ms) | per token only (ms) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in points:
        added = p["mixed_experts"] - p["decode_experts"]
        lines.append(
            f"| {p['batch']} | {p['new']} | {p['decode_ms']:.2f} | {p['extra_ms']:.2f} | "
            f"{added} / {p['expected_added_experts']:.1f} | {p['moe_ms']:.2f} | "
            f"{p['per_token_ms']:.2f} |"
        )
    lines += [
        "",
        "| prediction | median error of the extra | median / largest error of the mixed step |",
        "| --- | ---: | ---: |",
    ]
    for key, name in (("moe_ms", "tokens and experts (ppd)"), ("per_token_ms", "per token only")):
        t = totals[key]
        lines.append(
            f"| {name} | {t['median_error']:.0%} | {t['median_step_error']:.0%} / "
            f"{t['max_step_error']:.0%} |"
        )
    return "\n".join(lines) + "\n"


def write_tiny(out: Path) -> Path:
    """The tiny model's folder (its config.json only: the engine makes dummy weights)."""
    folder = out / "tiny-qwen3-moe"
    folder.mkdir(parents=True, exist_ok=True)
    config = {**json.loads((STANDIN / "config.json").read_text()), **TINY}
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        help="a mixture of experts' folder (config.json; dummy weights); by default a tiny "
        "Qwen3-MoE written to --out",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeat", type=int, default=9, help="timed runs per step and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, help="write moe-inline.json and .md here")
    args = p.parse_args()
    if args.model is None:
        args.model = str(write_tiny(args.out or Path(tempfile.mkdtemp())))
    mcfg = ModelConfig.from_folder(args.model)
    if not mcfg.is_moe:
        p.error(f"{args.model} is a dense model; give a mixture of experts' folder")
    points = measure(args.model, args.device, args.repeat, args.rounds)
    predict(points, mcfg)
    totals = summary(points)
    meta = {
        "model": Path(args.model).name,
        "device": args.device,
        "cpu": f"{platform.processor() or platform.machine()}, {isa()}",
        "command": "python -m bench.moe_inline "
        + " ".join(f"--{k} {v}" for k, v in (("repeat", args.repeat), ("rounds", args.rounds))),
        "repeat": args.repeat,
        "rounds": args.rounds,
    }
    md = markdown(points, totals, meta)
    print(md)
    if args.out is not None:
        write_results(args.out, "moe-inline", {**meta, "points": points, "summary": totals}, md)


if __name__ == "__main__":
    main()
