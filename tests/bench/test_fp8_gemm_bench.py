"""bench/fp8_gemm.py: its floors, and a --rehearse run (tiny shapes, the kernels under Triton's
interpreter) that writes the report a GPU run writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.fp8_gemm import Shape, Variant, call_bytes, floors

ROOT = Path(__file__).resolve().parents[2]


def test_floors_count_the_weight_its_scales_and_the_activations() -> None:
    o = Shape("o", 4096, 4096)
    bf16, channel, block = Variant("bf16", None), Variant("c", 0), Variant("b", 128)
    assert call_bytes(o, 1, bf16) == 2 * 4096 * 4096 + 2 * (4096 + 4096)
    assert call_bytes(o, 1, channel) == 4096 * 4096 + 4 * 4096 + 2 * (4096 + 4096)
    assert call_bytes(o, 1, block) == 4096 * 4096 + 4 * 4096 * 32 + 2 * (4096 + 4096)
    tflops = {"bf16": 1000.0, "fp8": 2000.0}
    memory, compute = floors(o, 512, channel, 4000.0, tflops)
    assert memory == pytest.approx(call_bytes(o, 512, channel) / 4e12 * 1e3)
    assert compute == pytest.approx(2 * 512 * 4096 * 4096 / 2e15 * 1e3)
    assert floors(o, 512, Variant("w8a16", 0, "none"), 4000.0, tflops)[1] == pytest.approx(
        2 * compute
    )


def test_rehearsal_writes_every_cell(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.fp8_gemm", "--rehearse", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads((tmp_path / "fp8-gemm.json").read_text())
    cells = result["cells"]
    assert len(cells) == len(result["shapes"]) * len(result["rows"]) * len(result["columns"])
    assert all(c["ms"] is not None and not c["failure"] for c in cells)
    # fp8 outputs within bfloat16's rounding (toward zero under the interpreter: 2^-7) of float64
    assert all(c["error"] < 2**-7 for c in cells if c["variant"] != "bf16")
    table = (tmp_path / "fp8-gemm.md").read_text()
    assert "| qkv 64->96 | 1 |" in table and "fp8 block32" in table
