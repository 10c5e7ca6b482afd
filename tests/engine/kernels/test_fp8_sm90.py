"""The FP8 kernels compile for sm_90 and fit its shared memory in every configuration, on any
machine: sm90_compile_fp8.py, in a process of its own without TRITON_INTERPRET (see
test_sm90_compile.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "triton.backends.nvidia", reason="needs Triton's NVIDIA backend (and its ptxas)"
)

ROOT = Path(__file__).resolve().parents[3]


def compile_for_sm90(dtypes: str) -> tuple[int, str]:
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.engine.kernels.sm90_compile_fp8", "--dtypes", dtypes],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return done.returncode, f"{done.stdout}\n{done.stderr[-4000:]}"


# 25-50 s on 2 cores with an empty Triton cache (15 kernels), as CI's always is: in the second
# suite, under the default one's budget
@pytest.mark.slow
def test_fp8_kernels_compile_for_sm90_in_bfloat16() -> None:
    rc, output = compile_for_sm90("bfloat16")
    assert rc == 0, output


@pytest.mark.slow
def test_fp8_kernels_compile_for_sm90_in_float16() -> None:
    rc, output = compile_for_sm90("float16")
    assert rc == 0, output
