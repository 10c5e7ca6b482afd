"""`ppd bench sampling`: what each OpenAI sampling feature adds to a decode step, against plain
greedy decoding.

Every configuration decodes a batch of sequences at a fixed context (the forward pass costs the same
whatever the token ids) through Engine.step, so that grammar masks are filled on a host thread while
the pass runs, as in serving. Each row is a request whose history grows with its sampled tokens, so
penalties update their counts and grammar matchers advance; a request ends at an EOS or at its max
tokens (drawn per request from 1..max_output, so the batch holds requests of every age) and a new
request takes its row (a restart, counted).

The machine may be shared, so timing drifts: within a round every configuration keeps its own batch
and they take steps in turn, one each, in a rotating order; a point is the median (and p90) of its
timed steps after warm-up, and the sweep runs --rounds times. Reported: the median across rounds of
the round medians, and of the ratio to greedy's at the same batch in the same round. Results go to
<results>/<device>/sampling-<model>.{json,md} ($PPD_RESULTS_DIR, else ./ppd-results).

The issue's target: structured outputs within 10% of plain decoding's step time at batch 64.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from bench.common import has_tokenizer
from bench.engine import device_slug, run_meta, write_results
from engine.config import ModelConfig, resolve_dtype
from engine.demo import DEMO_MODEL, demo_model_path, write_byte_tokenizer
from engine.engine import Engine, EngineConfig, device_info
from engine.model_runner import StepInput
from engine.sampler import Row
from engine.sampling_params import GuidedSpec, SamplingParams
from engine.step_timing import (
    Blocks,
    add_model_args,
    chosen_device,
    chosen_model,
    fill_random_kv,
    release_engine,
)
from profiles import results_dir

TARGET_RATIO = 1.10  # structured outputs' step time over plain decoding's
TARGET_BATCH = 64
GUIDED = ("json_schema", "json_object")
# Bounded strings and integers, so that even greedy decoding walks the whole object rather than
# staying in one string, and an array of at least 20 integers, so that outputs run long.
SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "active": {"type": "boolean"},
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 1000},
                "minItems": 20,
            },
        },
        "required": ["name", "age", "active", "scores"],
    }
)


@dataclass(frozen=True)
class Sweep:
    batches: tuple[int, ...]
    context: int  # tokens in the KV cache of every decoding sequence
    steps: int  # timed steps per point
    warmup: int  # untimed steps before them
    rounds: int
    max_output: int  # a request's max tokens is drawn from 1..max_output


GPU_SWEEP = Sweep((1, 64, 256), 1024, 100, 10, 3, 200)
CPU_SWEEP = Sweep((1, 64), 256, 30, 5, 5, 200)
QUICK_SWEEP = Sweep((1, 4), 32, 4, 2, 1, 8)


def configurations(vocab_size: int) -> dict[str, SamplingParams]:
    """The measured sampling parameters by name: each feature on top of greedy decoding, except the
    two that sample (sampled, min_p) and `all`."""
    greedy = dict(temperature=0.0)
    sampled = dict(temperature=0.8, top_p=0.95, top_k=50)
    penalties = dict(repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5)
    bias = tuple((vocab_size * i // 10, 1.0 if i % 2 else -1.0) for i in range(10))
    schema = GuidedSpec("json_schema", SCHEMA)
    return {
        "greedy": SamplingParams(**greedy),
        "sampled": SamplingParams(**sampled),
        "logprobs-5": SamplingParams(**greedy, logprobs=5),
        "logprobs-20": SamplingParams(**greedy, logprobs=20),
        "penalties": SamplingParams(**greedy, **penalties),
        "logit_bias": SamplingParams(**greedy, logit_bias=bias),
        "min_p": SamplingParams(temperature=1.0, min_p=0.05),
        "json_schema": SamplingParams(**greedy, guided=schema),
        "json_object": SamplingParams(**greedy, guided=GuidedSpec("json_object", "")),
        "all": SamplingParams(**sampled, **penalties, logprobs=5, guided=schema),
    }


@dataclass
class Point:
    config: str
    batch: int
    ms: float  # median across rounds of each round's median step time
    p90_ms: float  # median across rounds of each round's p90
    ratio: float  # median across rounds of ms / greedy's ms at the same batch in the same round
    # requests that ended (EOS or max tokens) and were replaced, over every round's timed steps
    restarts: int
    round_ms: list[float] = field(default_factory=list)


@dataclass
class Report:
    device: str
    model: str
    dtype: str
    tokenizer: str  # the folder, or "byte-level stand-in" when the model has none
    sweep: Sweep
    points: list[Point] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def point(self, config: str, batch: int) -> Point | None:
        return next((p for p in self.points if p.config == config and p.batch == batch), None)


# ---- one point -----------------------------------------------------------------------------------


class Batch:
    """A decode batch of `batch` requests with the same parameters, each replaced by a new one when
    it ends."""

    _ids = itertools.count()

    def __init__(
        self,
        engine: Engine,
        params: SamplingParams,
        batch: int,
        context: int,
        max_output: int,
        rng: random.Random,
    ) -> None:
        self.engine, self.params, self.max_output, self.rng = engine, params, max_output, rng
        self.eos = set(engine.mcfg.eos_token_ids)
        blocks = Blocks(engine.num_kv_blocks, engine.plan.block_size)
        self.inputs = [StepInput([1], context, blocks.table(context + 1)) for _ in range(batch)]
        vocab = engine.mcfg.vocab_size
        self.prompts = [[rng.randrange(vocab) for _ in range(context)] for _ in range(batch)]
        self.rows = [self._new(i) for i in range(batch)]
        self.caps = [rng.randint(1, max_output) for _ in range(batch)]
        self.restarts = 0

    def _new(self, i: int) -> Row:
        prompt = self.prompts[i]
        return Row(self.params, list(prompt), len(prompt), f"sampling-bench-{next(self._ids)}")

    def step(self) -> None:
        """One engine step, then each row's token appended to its history, or its request
        replaced."""
        sampled = self.engine.step(self.inputs, self.rows)
        for i, token in enumerate(sampled.tokens):
            row = self.rows[i]
            row.token_ids.append(token)  # type: ignore[attr-defined]
            if token in self.eos or len(row.token_ids) - row.num_prompt >= self.caps[i]:
                self.engine.release(row.request_id)
                self.rows[i], self.caps[i] = self._new(i), self.rng.randint(1, self.max_output)
                self.restarts += 1
            self.inputs[i].token_ids = [token]

    def close(self) -> None:
        for row in self.rows:
            self.engine.release(row.request_id)


def time_round(
    engine: Engine, configs: dict[str, SamplingParams], batch: int, sweep: Sweep, seed: int
) -> dict[str, tuple[list[float], int]]:
    """One round at one batch size: a batch per configuration (same prompts and max tokens), stepped
    in turn, one step each, in an order that rotates every step, so that a slow spell of the
    machine falls on all of them alike. Returns per configuration (its timed steps in
    milliseconds, the restarts among them)."""
    batches = {
        name: Batch(engine, params, batch, sweep.context, sweep.max_output, random.Random(seed))
        for name, params in configs.items()
    }
    names = list(batches)
    times: dict[str, list[float]] = {name: [] for name in names}
    try:
        for i in range(sweep.warmup + sweep.steps):
            if i == sweep.warmup:
                for b in batches.values():
                    b.restarts = 0
            for name in names[i % len(names) :] + names[: i % len(names)]:
                start = time.perf_counter()
                batches[name].step()
                if i >= sweep.warmup:
                    times[name].append((time.perf_counter() - start) * 1000)
        return {name: (times[name], batches[name].restarts) for name in names}
    finally:
        for b in batches.values():
            b.close()


def _p90(values: list[float]) -> float:
    return (
        statistics.quantiles(values, n=10, method="inclusive")[-1] if len(values) > 1 else values[0]
    )


# ---- the run -------------------------------------------------------------------------------------


def run(
    model: str,
    device: torch.device,
    sweep: Sweep,
    dtype: str = "auto",
    tokenizer: str | None = None,
    progress: bool = False,
) -> Report:
    folder = str(demo_model_path()) if model == DEMO_MODEL else model
    mcfg = ModelConfig.from_folder(folder)
    with tempfile.TemporaryDirectory(prefix="ppd-bench-tokenizer-") as scratch:
        stand_in = tokenizer is None and not has_tokenizer(folder)
        if stand_in:
            write_byte_tokenizer(Path(scratch), mcfg.vocab_size)
        tokenizer_folder = scratch if stand_in else (tokenizer or folder)
        block_size = 16
        max_batch = max(sweep.batches)
        cfg = EngineConfig(
            model=folder,
            dtype=dtype,
            load_format="dummy",
            device=device.type,
            block_size=block_size,
            max_model_len=sweep.context + 1,
            max_num_seqs=max_batch,
            max_num_batched_tokens=max_batch,
            # On the CPU the pool is exactly what the largest batch needs; a GPU's is planned from
            # its free memory.
            num_kv_blocks=max_batch * -(-(sweep.context + 1) // block_size)
            if device.type == "cpu"
            else None,
            shares_device=False,
            tokenizer=tokenizer_folder,
        )
        engine = Engine.create(
            cfg, (f"ppd-bench-{os.getpid()}-weights", f"ppd-bench-{os.getpid()}-kv")
        )
        try:
            if device.type == "cuda":
                fill_random_kv(engine)
            report = Report(
                device_info(device).name,
                os.path.basename(folder.rstrip("/")),
                str(resolve_dtype(dtype, mcfg, device.type)).split(".")[-1],
                "byte-level stand-in" if stand_in else tokenizer_folder,
                sweep,
                meta={**run_meta(engine, cfg), "host": _host(), "vocab_size": mcfg.vocab_size},
            )
            report.points = _sweep(engine, configurations(mcfg.vocab_size), sweep, progress)
            return report
        finally:
            release_engine(engine)
            if engine.sampler.guided is not None:
                engine.sampler.guided.close()


def _host() -> str:
    """The host's CPU model and the cores this process may use (the GPU's name is the report's
    device)."""
    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        name = next(
            (
                line.split(":", 1)[1].strip()
                for line in open("/proc/cpuinfo")
                if line.startswith("model name")
            ),
            name,
        )
    return f"{name}, {len(os.sched_getaffinity(0))} cores"


def _sweep(
    engine: Engine, configs: dict[str, SamplingParams], sweep: Sweep, progress: bool
) -> list[Point]:
    names = list(configs)
    times: dict[tuple[str, int], list[list[float]]] = {
        (n, b): [] for n in names for b in sweep.batches
    }
    restarts = dict.fromkeys(times, 0)
    for r in range(sweep.rounds):
        for batch in sweep.batches:
            for name, (steps, restarted) in time_round(
                engine, configs, batch, sweep, seed=batch * 1000 + r
            ).items():
                times[name, batch].append(steps)
                restarts[name, batch] += restarted
            if progress:
                print(
                    f"round {r + 1}/{sweep.rounds}, batch {batch}: "
                    + ", ".join(
                        f"{name} {statistics.median(times[name, batch][-1]):.2f}" for name in names
                    )
                    + " ms",
                    flush=True,
                )
    points = []
    for batch in sweep.batches:
        greedy = [statistics.median(t) for t in times["greedy", batch]]
        for name in names:
            medians = [statistics.median(t) for t in times[name, batch]]
            points.append(
                Point(
                    name,
                    batch,
                    statistics.median(medians),
                    statistics.median(_p90(t) for t in times[name, batch]),
                    statistics.median(m / g for m, g in zip(medians, greedy)),
                    restarts[name, batch],
                    medians,
                )
            )
    return points


# ---- output --------------------------------------------------------------------------------------


def verdicts(report: Report) -> dict[str, str]:
    """Each structured-output configuration against the target: 'meets', 'misses' or why it was not
    measured."""
    out = {}
    for name in GUIDED:
        p = report.point(name, TARGET_BATCH)
        if p is None:
            out[name] = f"not measured at batch {TARGET_BATCH}"
        else:
            out[name] = (
                "meets" if p.ratio <= TARGET_RATIO else "misses"
            ) + f" ({p.ratio:.2f} x greedy)"
    return out


def to_json(report: Report) -> dict:
    data = asdict(report)
    data["target"] = {"ratio": TARGET_RATIO, "batch": TARGET_BATCH, "verdicts": verdicts(report)}
    return data


def markdown(report: Report) -> str:
    s = report.sweep
    batches = s.batches
    lines = [
        f"# Sampling cost: {report.model} ({report.dtype}) on {report.device}",
        "",
        f"Host: {report.meta.get('host')}; torch {report.meta.get('torch')}. Vocabulary: "
        f"{report.meta.get('vocab_size')} tokens (the sampler's and the grammar masks' work grows "
        "with it).",
        "",
        f"Decode steps at context {s.context}; per point {s.steps} timed steps after {s.warmup} "
        "warm-up steps, "
        f"{s.rounds} round(s) with every configuration once per round. ms and p90: medians across "
        "rounds of "
        "each round's median and p90 step time; x greedy: median across rounds of the step time "
        "over greedy's "
        "at the same batch in the same round. Each row's history grows with its tokens; a request "
        "ends at an "
        f"EOS or at its max tokens (drawn from 1..{s.max_output}) and a new one takes its row "
        "(restarts: over "
        f"the timed steps of all rounds). Tokenizer for structured outputs: {report.tokenizer}; "
        "torch threads: "
        f"{report.meta.get('threads')}.",
        "",
        "| config | "
        + " | ".join(f"b{b} ms | b{b} p90 | b{b} x greedy | b{b} restarts" for b in batches)
        + " |",
        "| --- |" + " ---: | ---: | ---: | ---: |" * len(batches),
    ]
    for name in dict.fromkeys(p.config for p in report.points):
        cells = []
        for b in batches:
            p = report.point(name, b)
            cells.append(
                f"{p.ms:.2f} | {p.p90_ms:.2f} | {p.ratio:.2f} | {p.restarts}" if p else " | | | "
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Target (the issue): structured outputs within {round((TARGET_RATIO - 1) * 100)}% of "
        "plain "
        f"decoding's step time at batch {TARGET_BATCH} (x greedy <= {TARGET_RATIO:.2f}).",
        "",
    ]
    lines += [f"- {name}: {verdict}" for name, verdict in verdicts(report).items()]
    if report.tokenizer == "byte-level stand-in":
        lines += [
            "",
            "The model folder has no tokenizer, so structured outputs ran on a byte-level stand-in "
            "of its "
            "vocabulary size (256 byte tokens; the other ids special, never allowed): a real "
            "tokenizer's masks "
            "cost more to fill. Pass --tokenizer FOLDER to measure with the model's own.",
        ]
    return "\n".join(lines) + "\n"


def write(report: Report, out: Path) -> tuple[Path, Path]:
    return write_results(out, f"sampling-{report.model}", to_json(report), markdown(report))


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer folder for structured outputs (default: the model's; a byte-level stand-in "
        "of its "
        "vocabulary size when the folder has none)",
    )
    p.add_argument(
        "--rounds", type=int, default=None, help="sweeps (default 5 on the CPU, 3 on a GPU)"
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per point (default 30 on the CPU, 100 on a GPU)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch's intra-op threads (default on the CPU: all cores but one, which the "
        "grammar-mask "
        "thread fills masks on while the pass runs; on a GPU torch's default)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="folder for the JSON and markdown (default: $PPD_RESULTS_DIR, else ./ppd-results, "
        "/<device>)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="batches 1 and 4, a few steps, one round (what the tests run)",
    )


def main(args: argparse.Namespace) -> None:
    device = chosen_device(args)
    model = chosen_model(args, device)
    sweep = QUICK_SWEEP if args.quick else (GPU_SWEEP if device.type == "cuda" else CPU_SWEEP)
    sweep = replace(sweep, rounds=args.rounds or sweep.rounds, steps=args.steps or sweep.steps)
    if args.threads or device.type == "cpu":
        torch.set_num_threads(args.threads or max(1, len(os.sched_getaffinity(0)) - 1))
    report = run(model, device, sweep, args.dtype, args.tokenizer, progress=not args.quick)
    json_path, md_path = write(report, Path(args.out or results_dir() / device_slug(device)))
    print(markdown(report))
    print(f"written to {json_path} and {md_path}")
