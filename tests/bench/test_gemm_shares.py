"""bench/gemm_shares: what runs without CUDA: the shapes the model multiplies, the floors, the
columns, the report, and the glue of a run (shares, columns, cells, kernels) with the GPU's parts
stood in."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bench import gemm_shares as gs
from bench.gemm_shares import (
    Cell,
    Shape,
    Share,
    Variant,
    floor_ms,
    kernel_changes,
    label,
    markdown,
    model_shapes,
)
from engine.loader import load_model
from tests.tiny_models import write_tiny_model


def test_the_shapes_are_llama_3_1_8b_layers_as_the_engine_fuses_them(tmp_path: Path) -> None:
    assert model_shapes() == [
        Shape("qkv", 6144, 4096),
        Shape("o", 4096, 4096),
        Shape("gate_up", 28672, 4096),
        Shape("down", 4096, 14336),
    ]
    # The engine's fused weights (q, k, v stacked; gate and up stacked) have exactly these shapes.
    folder = write_tiny_model(tmp_path, "llama")
    model, _ = load_model(folder)
    layer = model.model.layers[0]
    weights = [
        layer.self_attn.qkv_weight,
        layer.self_attn.o_proj.weight,
        layer.mlp.gate_up_weight,
        layer.mlp.down_proj.weight,
    ]
    assert [(s.n, s.k) for s in model_shapes(folder)] == [tuple(w.shape) for w in weights]


def test_a_floor_is_bytes_over_read_bandwidth_or_flops_over_the_matmul_rate() -> None:
    share = Share("green 64", 64, read_gbps=4000.0, copy_gbps=3500.0, matmul_tflops=800.0)
    o = Shape("o", 4096, 4096)
    assert gs.gemm_bytes(o, 1) == (4096 * 4096 + 4096 + 4096) * 2
    assert floor_ms(o, 1, share) == pytest.approx(gs.gemm_bytes(o, 1) / 4e12 * 1e3)  # memory-bound
    gate_up = Shape("gate_up", 28672, 4096)
    assert gs.gemm_flops(gate_up, 320) == 2 * 320 * 28672 * 4096
    assert floor_ms(gate_up, 320, share) == pytest.approx(
        2 * 320 * 28672 * 4096 / 8e14 * 1e3
    )  # compute-bound


def test_columns_are_each_share_with_and_without_the_target_and_cublaslt() -> None:
    columns = gs.variants(132, (96, 64))
    assert [c.name for c in columns] == [
        "132",
        "132 Lt",
        "96",
        "96 +target",
        "96 Lt",
        "96 Lt+target",
        "64",
        "64 +target",
        "64 Lt",
        "64 Lt+target",
    ]
    assert {c.name: c.carveout for c in columns if c.carveout is not None} == {
        "96 +target": 36,
        "96 Lt+target": 36,
        "64 +target": 68,
        "64 Lt+target": 68,
    }
    assert {c.library for c in columns} == {None, "cublaslt"}


def test_the_report_gives_each_cell_ms_x_its_floor_and_whether_the_target_changed_the_kernel() -> (
    None
):
    share = Share("green 64", 64, 2000.0, 1800.0, 400.0)
    o = Shape("o", 4096, 4096)
    columns = [Variant("64 Lt", 64, "cublaslt", None), Variant("64 Lt+target", 64, "cublaslt", 68)]
    floor = floor_ms(o, 1, share)
    cells = [
        Cell(o.label, 1, "64 Lt", 2 * floor, floor),
        Cell(o.label, 1, "64 Lt+target", None, floor, "boom"),
    ]
    kernels = {
        label(o, 1, "64 Lt"): ["a"],
        label(o, 1, "64 Lt+target"): ["b"],
        label(o, 1, "64"): ["c"],
        label(o, 1, "64 +target"): ["c"],
    }
    changes = kernel_changes(kernels, [o], [1], [64])
    assert changes == [{"shape": "o 4096->4096", "m": 1, "64 Lt": True, "64 default": False}]
    assert kernel_changes({}, [o], [1], [64])[0]["64 Lt"] is None
    meta = {
        "device": "a GPU",
        "torch": "2.11",
        "cuda": "13.0",
        "default_blas": "Cublas",
        "total_sms": 132,
        "timing": "Times: graphs.",
    }
    text = markdown(meta, [share], columns, [o], [1], cells, changes)
    assert "| green 64 | 64 | 2,000 | 1,800 | 400 |" in text
    assert "| shape | M | 64 Lt | 64 Lt+target |" in text
    assert f"| o 4096->4096 | 1 | {2 * floor:.4f} (2.00x) | failed |" in text
    assert "| o 4096->4096 | 1 | changed | same |" in text
    assert "No green contexts" in markdown(
        {**meta, "green_error": "no cuda-python"}, [share], columns, [o], [1], cells, None
    )


def test_the_blas_settings_are_put_back_after() -> None:
    assert torch._C._get_sm_carveout_experimental() is None
    with gs.blas(None, 36):
        assert torch._C._get_sm_carveout_experimental() == 36
    assert torch._C._get_sm_carveout_experimental() is None


def test_a_run_measures_every_cell_on_its_shares_stream_and_names_its_kernels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU's parts stood in: green splits of 96 and 64 SMs with named streams, fixed floors, a
    timing that runs the GEMM once on the CPU and reports the stream and settings it ran under,
    kernels named by the carveout."""
    from partition import green
    from partition.green import StreamPair, StreamSplits

    folder = write_tiny_model(tmp_path, "llama")
    splits = StreamSplits(
        132,
        StreamPair("whole", "whole prefill", 132, 132),
        {0: StreamPair("d96", "p96", 96, 36), 1: StreamPair("d64", "p64", 64, 68)},
    )
    monkeypatch.setattr(green.StreamSplits, "green", classmethod(lambda cls, counts: splits))
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda device: SimpleNamespace(multi_processor_count=132),
    )
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "a GPU")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(gs, "DEVICE", "cpu")
    monkeypatch.setattr(gs, "ROTATE_BYTES", 1 << 12)
    monkeypatch.setattr(
        gs,
        "measure_share",
        lambda name, sms, stream, replays: Share(name, sms, 1000.0, 900.0, 100.0),
    )
    library = [
        "Cublas"
    ]  # the CPU's torch cannot choose cuBLASLt: a stand-in that remembers the choice

    def preferred_blas_library(backend=None):
        library[0] = library[0] if backend is None else backend
        return library[0]

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preferred_blas_library)
    ran = []

    def captured_ms(stream, launch, reps, replays):
        launch(reps - 1)
        ran.append((stream, library[0], torch._C._get_sm_carveout_experimental()))
        return 0.01

    def kernel_names(shapes, rows, columns, streams):
        return {
            label(s, m, c.name): [f"gemm carveout {c.carveout}"]
            for s in shapes
            for m in rows
            for c in columns
        }

    monkeypatch.setattr(gs, "captured_ms", captured_ms)
    monkeypatch.setattr(gs, "kernel_names", kernel_names)
    result = gs.run(folder, (96, 64), (1, 16), 1)
    json.dumps(result)
    assert len(result["cells"]) == 4 * 2 * 10 and all(
        c["ms"] == 0.01 and c["floor_ms"] for c in result["cells"]
    )
    lt = "cublaslt"
    assert ran[:10] == [
        ("whole", "Cublas", None),
        ("whole", lt, None),
        ("d96", "Cublas", None),
        ("d96", "Cublas", 36),
        ("d96", lt, None),
        ("d96", lt, 36),
        ("d64", "Cublas", None),
        ("d64", "Cublas", 68),
        ("d64", lt, None),
        ("d64", lt, 68),
    ]
    assert torch._C._get_sm_carveout_experimental() is None and library == ["Cublas"]
    assert result["default_blas"] == "Cublas"
    assert [s["name"] for s in result["shares"]] == ["whole", "green 96", "green 64"]
    assert all(r["96 Lt"] and r["64 default"] for r in result["kernel_changes"])
    first = result["cells"][0]
    assert (
        "| 64 Lt+target |" in result["markdown"]
        and f"({0.01 / first['floor_ms']:.2f}x)" in result["markdown"]
    )


def test_without_cuda_it_names_the_shapes_and_measures_nothing(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.gemm_shares", "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[2],
    )
    assert done.returncode == 0, done.stderr
    assert "qkv 4096->6144 (48 MiB)" in done.stdout and "needs a CUDA GPU" in done.stdout
    assert not (tmp_path / "out").exists()
