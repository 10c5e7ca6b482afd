"""Every Triton kernel compiles for an H100 (sm_90) and fits its shared memory, on any machine:
sm90_compile.py.

Each check runs in a process of its own, without TRITON_INTERPRET (which this test process sets, and
under which nothing is compiled): its stand-in Triton driver stays active until that process exits,
out of other tests' way.
"""

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
# About 120 CPU-seconds with CI's empty Triton cache: started first, beside the other tests
# (tests/conftest.py).
RUN_FIRST = True


def compile_for_sm90(part: str) -> tuple[int, list[str], str]:
    """(exit status, the cases that are not OK, everything printed) of sm90_compile.py --part
    part."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.engine.kernels.sm90_compile", "--part", part],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    not_ok = [line for line in done.stdout.splitlines() if line.startswith(("FAIL", "SMEM"))]
    return done.returncode, not_ok, f"{done.stdout}\n{done.stderr[-4000:]}"


def test_kernels_compile_for_sm90() -> None:
    """Every kernel and every configuration the engine can choose, in bfloat16, split over the keys
    and in the mixed launch, and every elementwise kernel in every dtype; float16's and float32's
    attention and the graph-replayed steps, minutes of compiling on two cores with CI's empty
    Triton cache, are the second suite's (below): the two suites together compile every case."""
    rc, not_ok, output = compile_for_sm90("fast")
    assert rc == 0, "\n".join(not_ok) or output


@pytest.mark.slow
def test_float16_attention_and_experts_compile_for_sm90() -> None:
    """float16 attention, split or not and in the mixed launch, and the mixtures of experts: the
    bfloat16 kernels with another dot type, 75 CPU-seconds to compile with an empty cache."""
    rc, not_ok, output = compile_for_sm90("float16")
    assert rc == 0, "\n".join(not_ok) or output


@pytest.mark.slow
def test_float32_attention_and_graph_steps_compile_for_sm90() -> None:
    """float32 attention unsplit, whose FMA dots take several times as long to compile as the rest,
    bfloat16 steps through CUDA graphs' static buffers, and a bfloat16 model over an fp8 KV pool
    (its store, RoPE fused with the store, decode split or not, prefill, split append, the mixed
    launch: about 50 s)."""
    rc, not_ok, output = compile_for_sm90("slow")
    assert rc == 0, "\n".join(not_ok) or output


@pytest.mark.slow
def test_float32_split_and_mixed_attention_compile_for_sm90() -> None:
    """float32 attention's split-KV and mixed-launch variants: several minutes of FMA dots on two
    cores."""
    rc, not_ok, output = compile_for_sm90("float32-splits")
    assert rc == 0, "\n".join(not_ok) or output


# about 14 s on 2 cores: in the second suite, under the default one's budget
@pytest.mark.slow
def test_a_tile_over_shared_memory_fails_the_check() -> None:
    rc, not_ok, output = compile_for_sm90("oversized")
    assert rc == 1 and len(not_ok) == 1 and not_ok[0].startswith("SMEM"), output


# 25-50 s on 2 cores with an empty Triton cache (15 kernels), as CI's always is: in the second
# suite, under the default one's budget
@pytest.mark.slow
@pytest.mark.parametrize("part", ["fp8-gemm", "fp8-gemm-float16"])
def test_fp8_linear_kernels_compile_for_sm90(part: str) -> None:
    """The FP8 activation quantizer and GEMM (engine/kernels/fp8.py) in every tile, W8A8 and W8A16,
    per-channel and block scales."""
    rc, not_ok, output = compile_for_sm90(part)
    assert rc == 0, "\n".join(not_ok) or output
