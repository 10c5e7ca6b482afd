"""Our CPU kernels (attention: cpu_decode.c, cpu_prefill.c; RMSNorm, SiLU and RoPE:
cpu_elementwise.c; linear layers of a few rows: cpu_gemv.c, and on AMX: cpu_amx.c): built once
per machine with the host's C compiler, loaded with ctypes.

The build is cached under $PPD_CACHE_DIR (default ~/.cache/ppd-serve) by a hash of the source, the
compiler and the CPU's flags (it is built for this CPU, -march=native). $PPD_CPU_ISA=avx2
(engine/cpu_isa.py) builds it without AVX-512 instead, as an AVX2-only CPU of the same kind would
run it, into a file of its own beside the other. Without a compiler, or if the build fails, load()
returns None with the reason in the log, and attention falls back to PyTorch's kernels.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch import Tensor

from engine.cpu_isa import isa, proc_flags
from profiles import cache_dir

log = logging.getLogger("ppd.engine")

SOURCES = [
    Path(__file__).with_name(name)
    for name in ("cpu_decode.c", "cpu_prefill.c", "cpu_elementwise.c", "cpu_gemv.c", "cpu_amx.c")
]
HEADERS = [
    Path(__file__).with_name("cpu_common.h")
]  # included by the sources: part of the build's cache key
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]  # compiling
# Linking without -ffast-math: with it gcc links crtfastmath.o, which sets flush-to-zero for the
# whole process when the library loads, and every float in the server (torch's too) would lose its
# subnormals.
LINK_FLAGS = ["-shared", "-fopenmp", "-lm"]
ISA_FLAGS = {
    "native": (),
    "avx2": ("-mno-avx512f",),
}  # -mno-avx512f turns off every AVX-512 extension with it
DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}  # the suffix of each entry point


def _compiler() -> str | None:
    """$CC where set (and only it), else cc or gcc."""
    if os.environ.get("CC"):
        return shutil.which(os.environ["CC"])
    return shutil.which("cc") or shutil.which("gcc")


def build(extra_flags: tuple[str, ...] = (), build_isa: str | None = None) -> Path:
    """The shared library for this machine, compiled now unless the cache has it; RuntimeError if it
    cannot be. build_isa: 'native' or 'avx2' (default: $PPD_CPU_ISA's); extra_flags go after the
    others (the tests build without the CPU's bfloat16 instructions, for the other path). Where
    the CPU lacks what a build turns off (avx2's AVX-512 on an AVX2-only CPU), it is the native
    build, compiled once."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError(
            f"no C compiler on this machine ({os.environ.get('CC') or 'cc or gcc'}; set $CC to one)"
        )
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[
        :1
    ]
    build_isa = build_isa or isa()
    # A flag that turns off what this CPU lacks changes nothing: the build is the native one's.
    flags = [*FLAGS, *(f for f in (*ISA_FLAGS[build_isa], *extra_flags) if not _moot(f))]
    if flags == FLAGS:
        build_isa = "native"
    cpu = " ".join(sorted(proc_flags())) or platform.processor()
    key = hashlib.sha256(
        "\n".join(
            [
                *(s.read_text() for s in (*SOURCES, *HEADERS)),
                *version,
                *flags,
                *LINK_FLAGS,
                platform.machine(),
                cpu,
            ]
        ).encode()
    ).hexdigest()[:16]
    cache = cache_dir() / "cpu-kernels"
    target = cache / f"cpu_attention-{'' if build_isa == 'native' else build_isa + '-'}{key}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    # One process compiles; the others (a unit's workers, tensor-parallel ranks, servers sharing the
    # cache) wait for its library instead of compiling the same one beside it.
    with open(cache / f".{target.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process compiling the CPU kernels into %s", cache)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            _compile(cc, flags, build_isa, cache, target)
    return target


def _compile(cc: str, flags: list[str], build_isa: str, cache: Path, target: Path) -> None:
    """Compiles the sources into target, aside in cache and then renamed."""
    # Said before it starts: the first start on a machine is otherwise silent for the compile.
    log.info(
        "compiling the CPU kernels for this CPU (%s; once: they are cached in %s)", build_isa, cache
    )
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(
        dir=cache
    ) as tmp:  # built aside, then renamed: a build cut short leaves no library
        built = Path(tmp) / target.name
        objects = [str(Path(tmp) / f"{s.stem}.o") for s in SOURCES]
        # The sources compile side by side, one process each, then link.
        compiles = [
            (subprocess.Popen([cc, *flags, "-c", str(s), "-o", o], **PIPES), s.name)
            for s, o in zip(SOURCES, objects)
        ]
        link = ([cc, *objects, *LINK_FLAGS, "-o", str(built)], "the library")
        for proc, name in compiles:
            _, err = proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} failed to build {name}: {err.strip()[-1500:]}")
        proc = subprocess.run(link[0], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed to build {link[1]}: {proc.stderr.strip()[-1500:]}")
        os.replace(built, target)
    log.info(
        "built the CPU kernels (%s) in %.0f s: %s", build_isa, time.perf_counter() - began, target
    )


PIPES = dict(stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

# gcc's -mno-X flags and the /proc/cpuinfo flag of the extension each turns off
TURNS_OFF = {"-mno-avx512f": "avx512f", "-mno-avx512bf16": "avx512_bf16"}


def _moot(flag: str) -> bool:
    """Whether flag turns off an extension this CPU does not have (under -march=native, gcc
    would not use it anyway). Only a CPU whose flags are known is judged."""
    return flag in TURNS_OFF and bool(proc_flags()) and TURNS_OFF[flag] not in proc_flags()


class CpuKernels:
    """The loaded library's entry points, with their argument types."""

    def __init__(self, path: Path) -> None:
        self.lib = ctypes.CDLL(str(path))
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        for suffix in DTYPES.values():
            decode, prefill = (
                getattr(self.lib, f"paged_decode_{suffix}"),
                getattr(self.lib, f"paged_prefill_{suffix}"),
            )
            decode.argtypes = [ptr] * 6 + [i64] * 6 + [ctypes.c_float, i64]
            prefill.argtypes = [ptr] * 7 + [i64] * 6 + [ctypes.c_float, i64]
            decode.restype = prefill.restype = ctypes.c_int
            norm, silu = (
                getattr(self.lib, f"rms_norm_{suffix}"),
                getattr(self.lib, f"silu_mul_{suffix}"),
            )
            norm.argtypes = [ptr] * 5 + [i64, i64, ctypes.c_float, i64]
            silu.argtypes = [ptr] * 2 + [i64] * 3
            norm.restype = silu.restype = ctypes.c_int
            rope, rope_store = (
                getattr(self.lib, f"rope_{suffix}"),
                getattr(self.lib, f"rope_store_kv_{suffix}"),
            )
            rope.argtypes = [ptr, i64] + [ptr] * 5 + [i64] * 4
            rope_store.argtypes = [ptr, i64] * 3 + [ptr] * 7 + [i64] * 5
            rope.restype = rope_store.restype = ctypes.c_int
        self.lib.amx_pack_bf16.argtypes = [ptr] * 2 + [i64] * 2
        self.lib.amx_linear_bf16.argtypes = [ptr] * 4 + [i64] * 4
        self.lib.amx_pack_bf16.restype = self.lib.amx_linear_bf16.restype = (
            self.lib.amx_ready.restype
        ) = ctypes.c_int
        self.rope_store = {
            dtype: getattr(self.lib, f"rope_store_kv_{suffix}") for dtype, suffix in DTYPES.items()
        }
        self.lib.linear_few_rows_bf16.argtypes = [ptr] * 4 + [i64] * 4
        self.lib.linear_few_rows_bf16.restype = ctypes.c_int
        self.lib.linear_rows_f32.argtypes = [ptr] * 4 + [i64] * 5
        self.lib.linear_rows_f32.restype = ctypes.c_int

    def paged_decode(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        block_tables: Tensor,
        seq_lens: Tensor,
        scale: float,
        block_size: int,
    ) -> Tensor:
        """q [B, H, D] (one query per sequence); k_cache/v_cache [num_slots, Hkv, D]; block_tables
        [B, max_blocks] and seq_lens [B] int32. Sequence b's query attends its keys
        0..seq_lens[b]-1. Returns [B, H, D]."""
        assert q.dtype == k_cache.dtype == v_cache.dtype and q.dtype in DTYPES, (
            "one supported dtype throughout"
        )
        assert block_tables.dtype == seq_lens.dtype == torch.int32
        assert all(t.is_contiguous() for t in (k_cache, v_cache, block_tables, seq_lens))
        q = q.contiguous()
        out = torch.empty_like(q)
        b, h, d = q.shape
        failed = getattr(self.lib, f"paged_decode_{DTYPES[q.dtype]}")(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            seq_lens.data_ptr(),
            out.data_ptr(),
            b,
            h,
            k_cache.shape[1],
            d,
            block_size,
            block_tables.shape[1],
            scale,
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("the CPU attention kernel could not allocate its scores")
        return out

    def paged_prefill(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        block_tables: Tensor,
        seq_lens: Tensor,
        query_start: Tensor,
        scale: float,
        block_size: int,
    ) -> Tensor:
        """q [rows, H, D], sequence b's new queries in rows query_start[b] .. query_start[b+1]-1
        (int32 [B + 1]); k_cache/v_cache [num_slots, Hkv, D] holding every sequence's context,
        the new tokens' K/V included; block_tables [B, max_blocks] and seq_lens [B] int32. The n
        new queries of sequence b sit at positions seq_lens[b] - n .. seq_lens[b] - 1 and attend
        causally. Returns [rows, H, D]."""
        assert q.dtype == k_cache.dtype == v_cache.dtype and q.dtype in DTYPES, (
            "one supported dtype throughout"
        )
        assert block_tables.dtype == seq_lens.dtype == query_start.dtype == torch.int32
        assert all(
            t.is_contiguous() for t in (k_cache, v_cache, block_tables, seq_lens, query_start)
        )
        q = q.contiguous()
        out = torch.empty_like(q)
        _, h, d = q.shape
        failed = getattr(self.lib, f"paged_prefill_{DTYPES[q.dtype]}")(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            seq_lens.data_ptr(),
            query_start.data_ptr(),
            out.data_ptr(),
            len(seq_lens),
            h,
            k_cache.shape[1],
            d,
            block_size,
            block_tables.shape[1],
            scale,
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("the CPU prefill attention kernel could not allocate its scratch")
        return out

    def rms_norm(
        self, x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """(rms_norm(x + residual) * weight, x + residual) over the last dimension, as
        TorchOps.add_rms_norm (without residual: (rms_norm(x) * weight, x)). x, residual and weight
        contiguous, one supported dtype."""
        n = x.shape[-1]
        out = torch.empty_like(x)
        total = x if residual is None else torch.empty_like(x)
        getattr(self.lib, f"rms_norm_{DTYPES[x.dtype]}")(
            x.data_ptr(),
            None if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            total.data_ptr(),
            x.numel() // n,
            n,
            eps,
            torch.get_num_threads(),
        )
        return out, total

    def silu_mul(self, x: Tensor) -> Tensor:
        """x [..., 2I] = [gate | up] -> silu(gate) * up [..., I], as TorchOps.silu_and_mul; x
        contiguous."""
        n = x.shape[-1] // 2
        out = x.new_empty((*x.shape[:-1], n))
        getattr(self.lib, f"silu_mul_{DTYPES[x.dtype]}")(
            x.data_ptr(), out.data_ptr(), x.numel() // (2 * n), n, torch.get_num_threads()
        )
        return out

    def rope(self, x: Tensor, positions: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [T, heads, D] rotated by positions [T] int64 (cos/sin [max_positions, D/2] float32
        tables), as TorchOps.apply_rope rotates each of q and k; x may be a view whose tokens are
        strided (a slice of the QKV projection's output) with its heads and dimensions contiguous.
        Every position must be a row of the tables (the engine's max_model_len is at most the
        model's positions, which the tables cover); the kernel does not check. Returns a new
        contiguous [T, heads, D]."""
        t, heads, d = x.shape
        assert x.stride(2) == 1 and x.stride(1) == d and positions.dtype == torch.int64
        assert (
            cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
        )
        out = torch.empty((t, heads, d), dtype=x.dtype)
        getattr(self.lib, f"rope_{DTYPES[x.dtype]}")(
            x.data_ptr(),
            x.stride(0),
            out.data_ptr(),
            None,
            positions.contiguous().data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            t,
            heads,
            d,
            torch.get_num_threads(),
        )
        return out

    def rope_store_kv(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        slots: Tensor,
        positions: Tensor,
        cos: Tensor,
        sin: Tensor,
    ) -> Tensor:
        """rope(q), with rope(k) and v written at their slots of k_cache and v_cache [num_slots,
        Hkv, D] (slots [T] int64; a negative slot stores nothing): one call for what rope twice
        and two index_copy_ do. q, k and v as rope takes x, one dtype with the caches; positions
        int64 and slots contiguous, the tables as rope's. Returns the rotated q, a new contiguous
        [T, H, D]."""
        t, heads, d = q.shape
        out = torch.empty((t, heads, d), dtype=q.dtype)
        self.rope_store[q.dtype](
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            out.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            slots.data_ptr(),
            positions.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            t,
            heads,
            k.shape[1],
            d,
            torch.get_num_threads(),
        )
        return out

    def linear_few_rows(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor | None:
        """x [M, K] @ weight [N, K]^T (+ bias [N]) in bfloat16 for M of 1 to 8 (cpu_gemv.c); None
        where the shape is not one the kernel takes (K a multiple of 32). x, weight and bias
        contiguous bfloat16."""
        (m, k), n = x.shape, weight.shape[0]
        out = x.new_empty((m, n))
        failed = self.lib.linear_few_rows_bf16(
            x.data_ptr(),
            weight.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            m,
            k,
            n,
            torch.get_num_threads(),
        )
        return None if failed else out

    def amx_pack(self, weight: Tensor) -> Tensor | None:
        """weight [N, K] bfloat16 (contiguous) packed into the AMX kernel's tiles (cpu_amx.c), or
        None where it cannot be (no AMX in this build, N not a multiple of 16, K of 32)."""
        n, k = weight.shape
        out = torch.empty(n * k, dtype=torch.bfloat16)
        return None if self.lib.amx_pack_bf16(weight.data_ptr(), out.data_ptr(), n, k) else out

    def amx_linear(self, x: Tensor, packed: Tensor, n: int, bias: Tensor | None) -> Tensor | None:
        """x [M, K] @ weight^T (+ bias [N]) in bfloat16 on AMX (M at least 1), weight [N, K] as
        amx_pack packed it; None where the kernel cannot run (this process was refused AMX). x and
        bias contiguous bfloat16."""
        m, k = x.shape
        out = x.new_empty((m, n))
        failed = self.lib.amx_linear_bf16(
            x.data_ptr(),
            packed.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            m,
            k,
            n,
            torch.get_num_threads(),
        )
        return None if failed else out

    def linear_rows(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor | None:
        """x [M, K] @ weight [N, K]^T (+ bias [N]) in float32 for M of 1 to 32 (cpu_gemv.c), weight
        float32 or bfloat16 (widened in registers); None where the shape is not one the kernel takes
        (K a multiple of the vector). x and bias contiguous float32, weight contiguous."""
        (m, k), n = x.shape, weight.shape[0]
        out = x.new_empty((m, n))
        failed = self.lib.linear_rows_f32(
            x.data_ptr(),
            weight.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            m,
            k,
            n,
            int(weight.dtype == torch.bfloat16),
            torch.get_num_threads(),
        )
        return None if failed else out


@functools.cache
def load() -> CpuKernels | None:
    """The kernels for this machine ($PPD_CPU_ISA's build), or None (the reason logged once) where
    they cannot be built."""
    try:
        return CpuKernels(build())
    except (RuntimeError, OSError) as exc:
        log.warning("CPU attention kernel unavailable, using PyTorch's: %s", exc)
        return None
