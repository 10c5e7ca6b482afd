"""`ppd bench engine` on the CPU with the demo model at its quick sizes: every figure beside its
floor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.engine import QUICK_GRID, ModelCost, markdown, run, write
from engine.config import ModelConfig
from engine.demo import demo_model_path
from tests.tiny_models import write_tiny_model


def test_quick_engine_benchmark_reports_every_point_against_its_floor(
    cache_dir: Path, tmp_path: Path
) -> None:
    report = run(str(demo_model_path(cache_dir)), torch.device("cpu"), QUICK_GRID, quick=True)
    assert report.ceilings.copy_gbps > 0 and report.ceilings.matmul_tflops > 0
    kinds = [p.kind for p in report.points]
    expected = len(QUICK_GRID.batches) * len(QUICK_GRID.contexts)
    assert kinds.count("decode") == expected and kinds.count("prefill") == len(QUICK_GRID.prompts)
    # No CUDA graphs on the CPU: append and mixed steps are timed eagerly only.
    assert kinds.count("append") == len(QUICK_GRID.appends) and kinds.count("mixed") == len(
        QUICK_GRID.mixed
    )
    for p in report.points:
        assert p.skipped is None, p.skipped
        assert p.ms > 0 and p.floor_ms > 0 and p.ratio == p.ms / p.floor_ms and p.tokens_per_s > 0
        assert p.host_ms is not None and 0 < p.host_ms <= p.ms, (
            p
        )  # every kind records its host time
    (mixed,) = [p for p in report.points if p.kind == "mixed"]
    decodes, context, new, cached = QUICK_GRID.mixed[0]
    assert mixed.label == {
        "decodes": decodes,
        "context": context,
        "new": new,
        "cached": cached,
        "graphs": False,
    }
    assert all(
        p.label["graphs"] is False for p in report.points if p.kind in ("decode", "append", "mixed")
    )
    json_path, md_path = write(report, tmp_path)
    data = json.loads(json_path.read_text())
    assert len(data["points"]) == len(report.points) and all("ratio" in p for p in data["points"])
    assert md_path.read_text() == markdown(report) and "time / floor" in markdown(report)
    assert "| mixed | decodes 4, context 64, new 16, cached 128, graphs False |" in markdown(report)


class CountingGraphs:
    """Graphs that fit no step, whatever the runner asks them (None to every call): it runs the step
    eagerly, as for a step larger than every bucket."""

    def __init__(self) -> None:
        self.asked = 0

    def __getattr__(self, name: str):
        def no(*args, **kwargs) -> None:
            self.asked += 1

        return no


def test_append_and_mixed_steps_are_timed_with_the_runners_graphs_and_without(
    cache_dir: Path,
) -> None:
    from bench.engine import Ceilings, engine_config, start_engine, time_append, time_mixed
    from engine.step_timing import release_engine

    folder = str(demo_model_path(cache_dir))
    device = torch.device("cpu")
    engine = start_engine(engine_config(folder, device, QUICK_GRID))
    try:
        cost = ModelCost.of(ModelConfig.from_folder(folder), torch.float32, engine.plan.block_size)
        ceil = Ceilings(copy_gbps=10, matmul_tflops=0.1)
        new, cached = QUICK_GRID.appends[0]
        assert (
            time_append(engine, cost, ceil, new, cached, True, 1).skipped
            == "no CUDA graphs on this device/backend"
        )
        graphs = engine.runner.graphs = CountingGraphs()
        with_graphs = time_mixed(engine, cost, ceil, *QUICK_GRID.mixed[0], graphs=True, repeat=2)
        asked = graphs.asked
        eager = time_mixed(engine, cost, ceil, *QUICK_GRID.mixed[0], graphs=False, repeat=2)
        append = time_append(engine, cost, ceil, new, cached, False, 2)
        assert asked > 0 and graphs.asked == asked, (
            "the eager runs must not see the runner's graphs"
        )
        assert engine.runner.graphs is graphs, "the graphs are put back after an eager run"
        assert (
            with_graphs.label["graphs"] and not eager.label["graphs"] and not append.label["graphs"]
        )
        for p in (with_graphs, eager, append):
            assert p.skipped is None and p.host_ms is not None and 0 < p.host_ms <= p.ms
    finally:
        engine.runner.graphs = None
        release_engine(engine)


def test_floor_is_the_larger_of_bytes_and_flops(cache_dir: Path) -> None:
    from bench.engine import Ceilings

    cost = ModelCost.of(ModelConfig.from_folder(demo_model_path(cache_dir)), torch.float32, 16)
    # Decode at batch 1 moves every weight for a few thousand FLOPs per weight byte: memory-bound.
    _, bound = cost.floor(Ceilings(copy_gbps=100, matmul_tflops=1), 1, 100, 101, 1)
    assert bound == "memory"
    # A long prefill does 2 FLOPs per weight per token: compute-bound on a slow matmul unit.
    ms, bound = cost.floor(
        Ceilings(copy_gbps=100, matmul_tflops=0.001), 4096, 0, 4096 * 4097 // 2, 1
    )
    assert bound == "compute" and ms > cost.weight_bytes / 100e9 * 1000


def test_sequential_floor_adds_each_kernels_floor() -> None:
    """Run kernel after kernel, a mixed step cannot hide the decodes' KV reads under the append's
    GEMMs: its sequential floor is at least the overlap floor, equal to it where every kernel is
    memory-bound, and above it where the GEMMs are compute-bound while attention reads KV."""
    from bench.engine import Ceilings

    cost = ModelCost.of(
        ModelConfig.from_folder(Path(__file__).parents[2] / "bench/models/llama-3.1-8b"),
        torch.bfloat16,
        16,
    )
    ceil = Ceilings(copy_gbps=4000, matmul_tflops=800)
    # One decode at 1K: every kernel memory-bound, the two floors the same bytes over the same
    # bandwidth.
    overlap, bound = cost.floor(ceil, 1, 1024, 1025, 1)
    assert bound == "memory" and cost.sequential_floor(ceil, 1, 1, [(1024, 1025)]) == pytest.approx(
        overlap
    )
    # 64 decodes at 1K beside 256 new tokens over 4K: GEMMs of 320 rows are compute-bound, the
    # decodes' KV is not.
    pairs = 64 * 1025 + 256 * 4096 + 256 * 257 // 2
    overlap, bound = cost.floor(ceil, 320, 64 * 1024 + 4096, pairs, 65)
    kv_ms = 64 * 1024 * cost.kv_bytes_per_token / 4000e9 * 1000
    sequential = cost.sequential_floor(
        ceil, 320, 65, [(64 * 1024, 64 * 1025), (4096, pairs - 64 * 1025)]
    )
    assert bound == "compute" and sequential > overlap + 0.9 * kv_ms


def test_an_fp8_floor_reads_a_byte_a_weight_and_a_byte_a_kv_value() -> None:
    """Llama-3.1-8B with FP8 projections (a float32 scale a row) and an FP8 KV cache: a decode's
    bytes are the projections' 6.98 G values at a byte, their scales, the bfloat16 LM head, and
    half of bfloat16's KV per token."""
    folder = Path(__file__).parents[2] / "bench/models/llama-3.1-8b"
    cfg = ModelConfig.from_folder(folder)
    plain = ModelCost.of(cfg, torch.bfloat16, 16)
    fp8 = ModelCost.of(cfg.quantized("fp8"), torch.bfloat16, 16, torch.float8_e4m3fn)
    lm_head = cfg.vocab_size * cfg.hidden_size
    projections = plain.matmul_params  # a dense model's: every layer's four GEMMs
    rows = cfg.num_layers * (6144 + 4096 + 2 * 14336 + 4096)  # qkv, o, gate|up, down
    assert plain.weight_bytes == 2 * (projections + lm_head)
    assert fp8.weight_bytes == projections + 4 * rows + 2 * lm_head
    assert fp8.kv_bytes_per_token * 2 == plain.kv_bytes_per_token
    assert fp8.weight_itemsize == 1 and fp8.itemsize == 2


def test_a_mixture_of_experts_floor_reads_the_experts_routed_to() -> None:
    """Qwen3-30B-A3B on an H200's nominal 4.8 TB/s: a decode at batch 1 reads its 8 experts in
    each of 48 layers beside the rest of the weights (about 1.3 ms), a batch of 64 nearly every
    expert (about 12 ms) under uniform routing; a count measured from the router replaces it."""
    from bench.engine import Ceilings

    cost = ModelCost.of(
        ModelConfig.from_folder(Path(__file__).parents[2] / "bench/models/qwen3-30b-a3b"),
        torch.bfloat16,
        16,
    )
    ceil = Ceilings(copy_gbps=4800, matmul_tflops=990)
    assert cost.expected_experts(1) == pytest.approx(48 * 8)
    assert cost.expected_experts(64) == pytest.approx(48 * 128 * (1 - (120 / 128) ** 64))
    one, bound = cost.floor(ceil, 1, 0, 0, 1)
    assert bound == "memory" and 1.2 < one < 1.35
    assert 11.0 < cost.floor(ceil, 64, 0, 0, 64)[0] < 12.5
    # 64 tokens that all went to the same 8 experts read what one token reads (their 64x FLOPs
    # still under the reads)
    same, bound = cost.floor(ceil, 64, 0, 0, 64, experts_read=48 * 8)
    assert bound == "memory" and same == pytest.approx(one)


def test_a_mixture_of_experts_engine_run_counts_the_routed_experts(tmp_path: Path) -> None:
    """On the CPU with a tiny Qwen3-MoE: every step records how many of its 8 experts a layer read
    (from 2, all tokens routed alike, to 8), and its floor counts them."""
    folder = write_tiny_model(tmp_path, "qwen3_moe", max_position_embeddings=512)
    report = run(str(folder), torch.device("cpu"), QUICK_GRID, quick=True)
    for p in report.points:
        assert p.skipped is None, p.skipped
        assert 2 <= p.experts_per_layer <= 8, p
    prefill = next(p for p in report.points if p.kind == "prefill")
    assert prefill.experts_per_layer == 8  # 128 random tokens reach every expert
    assert "experts 8.0/layer" in markdown(report)


def test_rounds_report_medians_and_each_rounds_own_ratio() -> None:
    """A drifting machine: round 2 ran everything (its ceilings too) twice as slowly. Its ratios
    equal round 1's, and the merged ratio is that ratio, not the median time over the median
    floor of rounds that differ."""
    from bench.engine import Ceilings, Point, Report, merge_rounds

    def report(slow: float, ms: list[float], floors: list[float]) -> Report:
        points = [
            Point(
                "decode",
                {"batch": b},
                ms=m * slow,
                floor_ms=f * slow,
                floor_bound="memory",
                tokens_per_s=1 / slow,
            )
            for b, m, f in zip((1, 8), ms, floors)
        ]
        points.append(Point("decode", {"batch": 32}, skipped="does not fit"))
        return Report(
            "cpu", "m", "bfloat16", Ceilings(copy_gbps=30 / slow, matmul_tflops=0.4 / slow), points
        )

    rounds = [report(1, [10, 20], [5, 8]), report(2, [10, 20], [5, 8]), report(1, [12, 20], [5, 8])]
    merged = merge_rounds(rounds)
    assert merged.rounds == 3 and merged.ceilings.copy_gbps == 30
    one, eight, skipped = merged.points
    assert one.ms == 12 and one.floor_ms == 5 and one.ratio == 2.0  # ratios 2, 2, 2.4
    assert eight.ratio == 2.5 and skipped.skipped == "does not fit"
    assert "3 rounds" in markdown(merged) and "| 2.00 |" in markdown(merged)
    assert merge_rounds(rounds[:1]) is rounds[0]


@pytest.mark.slow  # over 10 s on 2 cores: the second suite keeps the default one under its budget
def test_cli_runs_quick_and_writes_results(cache_dir: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PPD_CACHE_DIR": str(cache_dir)}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli",
            "bench",
            "engine",
            "--quick",
            "--rounds",
            "2",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| decode |" in result.stdout and "2 rounds" in result.stdout
    assert json.loads((tmp_path / "engine-demo-v2.json").read_text())["rounds"] == 2


# about 14 s on 2 cores: in the second suite, under the default one's budget
@pytest.mark.slow
def test_two_ranks_report_each_steps_collectives_against_their_floor(
    cache_dir: Path, tmp_path: Path
) -> None:
    """`ppd bench engine -tp 2` on the CPU: the demo model's shards on two processes; every step has
    its collectives timed (two all-reduces a layer, the embedding's and the logits' gather) beside
    the floor the link's measured bandwidth gives, and each step's floor is one rank's shard's: half
    the bytes and FLOPs."""
    import argparse

    from bench.engine import add_engine_args, run_ranks

    folder = str(demo_model_path(cache_dir))
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", folder, "--quick", "--tensor-parallel-size", "2"])
    report = run_ranks(args, folder, torch.device("cpu"), QUICK_GRID)
    one = run(folder, torch.device("cpu"), QUICK_GRID, quick=True)
    assert report.meta["tensor_parallel_size"] == 2 and report.ceilings.link_gbps > 0
    for p, q in zip(report.points, one.points):
        assert p.label == q.label and p.skipped is None
        assert p.comm_ms > 0 and 0 < p.comm_floor_ms
    whole = ModelCost.of(ModelConfig.from_folder(folder), torch.float32, 16)
    shard = ModelCost.of(ModelConfig.from_folder(folder).sharded(2), torch.float32, 16)
    assert (shard.weight_bytes, shard.kv_bytes_per_token, shard.matmul_params) == (
        whole.weight_bytes // 2,
        whole.kv_bytes_per_token // 2,
        whole.matmul_params // 2,
    )
    md = markdown(report)
    assert "tensor parallelism 2" in md and "| collectives ms | their floor ms |" in md
