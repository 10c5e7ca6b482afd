"""`ppd bench engine` on the CPU with the demo model at its quick sizes: every figure beside its floor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from bench.engine import QUICK_GRID, ModelCost, markdown, run, write
from engine.config import ModelConfig
from engine.demo import demo_model_path


def test_quick_engine_benchmark_reports_every_point_against_its_floor(cache_dir: Path, tmp_path: Path) -> None:
    report = run(str(demo_model_path(cache_dir)), torch.device("cpu"), QUICK_GRID, quick=True)
    assert report.ceilings.copy_gbps > 0 and report.ceilings.matmul_tflops > 0
    kinds = [p.kind for p in report.points]
    expected = len(QUICK_GRID.batches) * len(QUICK_GRID.contexts)
    assert kinds.count("decode") == expected and kinds.count("prefill") == len(QUICK_GRID.prompts)
    assert kinds.count("append") == len(QUICK_GRID.appends)
    for p in report.points:
        assert p.skipped is None, p.skipped
        assert p.ms > 0 and p.floor_ms > 0 and p.ratio == p.ms / p.floor_ms and p.tokens_per_s > 0
    decode = [p for p in report.points if p.kind == "decode"]
    assert all(p.host_ms is not None and p.host_ms <= p.ms for p in decode)
    json_path, md_path = write(report, tmp_path)
    data = json.loads(json_path.read_text())
    assert len(data["points"]) == len(report.points) and all("ratio" in p for p in data["points"])
    assert md_path.read_text() == markdown(report) and "time / floor" in markdown(report)


def test_floor_is_the_larger_of_bytes_and_flops(cache_dir: Path) -> None:
    from bench.engine import Ceilings

    cost = ModelCost.of(ModelConfig.from_folder(demo_model_path(cache_dir)), torch.float32, 16)
    # Decode at batch 1 moves every weight for a few thousand FLOPs per weight byte: memory-bound.
    _, bound = cost.floor(Ceilings(copy_gbps=100, matmul_tflops=1), 1, 100, 101, 1)
    assert bound == "memory"
    # A long prefill does 2 FLOPs per weight per token: compute-bound on a slow matmul unit.
    ms, bound = cost.floor(Ceilings(copy_gbps=100, matmul_tflops=0.001), 4096, 0, 4096 * 4097 // 2, 1)
    assert bound == "compute" and ms > cost.weight_bytes / 100e9 * 1000


def test_cli_runs_quick_and_writes_results(cache_dir: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PPD_CACHE_DIR": str(cache_dir)}
    result = subprocess.run([sys.executable, "-m", "server.cli", "bench", "engine", "--quick", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| decode |" in result.stdout and (tmp_path / "engine-demo-v2.json").exists()
