"""`ppd probe`'s CPU section: the CPU's model, cores and the vector extensions our kernels care
about, and what `ppd serve --device cpu` chooses on it: the dtype of --dtype auto and the path of
our CPU kernels.

Every decision is asked of the function the server asks (engine/cpu_isa.py, engine/config.py
resolve_dtype, engine/attention/cpu_kernel.py and cpu_linear.py), so the report cannot drift from
what the server does. It needs no GPU; it builds the CPU kernels as the server's first start would
(cached under $PPD_CACHE_DIR/cpu-kernels).
"""

from __future__ import annotations

import dataclasses
import os
import platform
from pathlib import Path
from typing import Any

import torch

# The extensions that change a decision here: AVX2 is the floor of our kernels' builds, AVX-512F
# decides between our float32 few-rows kernel and oneDNN, AVX512-BF16 or AMX-BF16 makes bfloat16
# native, AMX-BF16 adds the AMX linears.
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_facts() -> dict[str, Any]:
    """The CPU section of the report (see the module docstring); exceptions are the caller's to turn
    into a finding."""
    from engine.cpu_isa import has_native_bf16, isa, proc_flags

    flags = proc_flags()
    return {
        "model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)),
        "flags": {flag: flag in flags for flag in FLAGS},
        "ppd_cpu_isa": isa(),
        "native_bf16": has_native_bf16(),
        "dtype_auto": auto_dtypes(),
        "kernels": kernel_path(),
    }


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it, else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def auto_dtypes() -> dict[str, str]:
    """The dtype `ppd serve --device cpu` serves with --dtype auto (the default): the demo model's
    (a float32 checkpoint) and a bfloat16 checkpoint's."""
    from engine.config import ModelConfig, resolve_dtype
    from engine.demo import demo_model_path

    demo = ModelConfig.from_folder(demo_model_path())
    return {
        "demo": _name(resolve_dtype("auto", demo, "cpu")),
        "bfloat16_checkpoint": _name(
            resolve_dtype("auto", dataclasses.replace(demo, dtype=torch.bfloat16), "cpu")
        ),
    }


def kernel_path() -> dict[str, Any]:
    """Which build of our C kernels this CPU runs and what runs where: attention, the linears of a
    few rows (AMX or not), how bfloat16 weights are packed for oneDNN, and bfloat16 prefill
    attention."""
    from engine.attention.cpu_backend import prefill_in_sdpa
    from engine.attention.cpu_kernel import ISA_FLAGS, build
    from engine.attention.cpu_linear import amx_rows, few_rows, packed_dtype, rows_kernel_rows
    from engine.cpu_isa import isa

    try:
        library, error = str(build()), None
    except (RuntimeError, OSError) as exc:
        library, error = None, str(exc)
    packed = packed_dtype(torch.bfloat16)
    return {
        "build": isa(),
        "compile_flags": ["-march=native", *ISA_FLAGS[isa()]],
        "library": library,
        "error": error,
        "attention": "ours (cpu_decode.c, cpu_prefill.c)"
        if library
        else "PyTorch's (our kernels did not build)",
        "amx_linear_rows": amx_rows() if library else 0,
        "few_rows": {
            "float32": rows_kernel_rows() if library else 0,
            "bfloat16": few_rows() if library else 0,
        },
        "bfloat16_weights_packed_as": _name(packed) if packed is not None else None,
        "bfloat16_prefill_attention": "PyTorch's SDPA (AMX)"
        if prefill_in_sdpa(torch.bfloat16)
        else ("ours" if library else "PyTorch's"),
    }


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
