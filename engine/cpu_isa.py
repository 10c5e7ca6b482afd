"""What this CPU's instructions allow, read once from /proc/cpuinfo: its flags, whether it has
native bfloat16, and which build of our CPU kernels it takes.

$PPD_CPU_ISA=avx2 runs this process as on a CPU of the same kind without AVX-512: the kernels are
built with -mno-avx512f (engine/attention/cpu_kernel.py) and the AVX-512 and AMX flags are hidden
from every decision here (so no native bfloat16 either). It stands in for an AVX2-only machine
(PyTorch's own kernels are held to AVX2 by ONEDNN_MAX_CPU_ISA=AVX2, ATEN_CPU_CAPABILITY=avx2 and
MKL_ENABLE_INSTRUCTIONS=AVX2, which this module leaves to the caller: they must be set before
PyTorch starts).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from pathlib import Path

ISA_ENV = "PPD_CPU_ISA"
ISAS = ("native", "avx2")
NATIVE_BF16_FLAGS = (
    "avx512_bf16",
    "amx_bf16",
)  # either one: bfloat16 matmuls at or above float32's speed


def isa() -> str:
    """$PPD_CPU_ISA: 'native' (unset or empty) or 'avx2'; ValueError naming the choices for anything
    else."""
    value = os.environ.get(ISA_ENV) or "native"
    if value not in ISAS:
        raise ValueError(f"${ISA_ENV}={value!r} is not a CPU build; use one of: {', '.join(ISAS)}")
    return value


@functools.cache
def proc_flags() -> frozenset[str]:
    """The CPU's flags as /proc/cpuinfo lists them (empty where it has none: a CPU we know nothing
    of)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_flags() -> frozenset[str]:
    """The flags every decision reads: proc_flags(), without AVX-512's and AMX's under
    PPD_CPU_ISA=avx2."""
    return _without_avx512(proc_flags()) if isa() == "avx2" else proc_flags()


@functools.cache
def _without_avx512(flags: frozenset[str]) -> frozenset[str]:
    return frozenset(f for f in flags if not f.startswith(("avx512", "amx")))


def has_native_bf16(flags: Iterable[str] | None = None) -> bool:
    """Whether a CPU with these flags (this one's by default) computes in bfloat16 natively
    (AVX512-BF16 or AMX-BF16). Without either, PyTorch's bfloat16 matmuls run at a fraction of
    float32's speed."""
    present = cpu_flags() if flags is None else set(flags)
    return any(f in present for f in NATIVE_BF16_FLAGS)
