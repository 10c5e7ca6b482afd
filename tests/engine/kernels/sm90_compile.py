"""Compile every Triton kernel of the project for an H100 (sm_90) on a machine without a GPU.

A stand-in Triton driver reports a CUDA target of compute capability 9.0 and stops after ptxas: a
launch through a public launcher compiles its kernel to a cubin, Triton checks the kernel's shared
memory against the H100's per-block limit as it does when it loads a kernel on the GPU, and the
launch itself is only recorded. This catches what Triton's interpreter (which runs the kernel tests)
never sees: code or dot types the compiler rejects, and tiles too big for shared memory. Shapes are
Llama-3.1-8B's, in bfloat16, float16 and float32 (and a bfloat16 model over an fp8 KV pool, for the
kernels that read or write it); the attention configurations are every one the engine can choose,
found by asking the engine (choose_num_splits, default_config, choose_append_splits, the CUDA-graph
buckets) rather than listed here, in either mixed launch (MIXED_LAUNCH). Compiled kernels land in
Triton's cache, so a second run is quick.

Run with TRITON_INTERPRET unset, in a process of its own (the stand-in driver stays active until
exit):
    env -u TRITON_INTERPRET python -m tests.engine.kernels.sm90_compile [--part PART] [--jobs N]
Prints one line per case (status, case, launches, the most shared memory a launched kernel needs,
seconds) and exits 1 if any case is not OK. --part picks a share of the cases (PARTS); `oversized`
compiles only a tile too big for shared memory, which must come out SMEM: the proof that the check
can fail.
"""

from __future__ import annotations

import argparse
import functools
import math
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import triton
from torch import Tensor
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime.driver import driver
from triton.runtime.errors import OutOfResources

from engine.attention import triton_backend
from engine.attention.base import AttentionShape, GraphBucket, StepBatch
from engine.attention.triton_backend import GraphBuffers, TritonBackend, TritonMetadata
from engine.config import ModelConfig
from engine.cuda_graphs import graph_buckets
from engine.engine import EngineConfig
from engine.kernels.attention import (
    APPEND_CONFIG,
    PREFILL_CONFIGS,
    AttentionConfig,
    choose_append_splits,
    choose_num_splits,
    default_config,
    general_programs,
    paged_attention,
)
from engine.kernels.moe import moe_config
from engine.kernels.rope import rope_store_kv
from engine.kernels.store_kv import store_kv
from engine.ops import Experts
from partition.probe_kernels import BLOCK, SM_ID_BLOCK, _sm_ids_kernel, spin

H100_SHARED_MEMORY = (
    232_448  # bytes of shared memory one thread block may opt in to on sm_90 (227 KiB)
)
H100_MAX_THREADS = 1024
H100_SMS = 132
LLAMA = ModelConfig.from_folder(
    Path(__file__).resolve().parents[3] / "bench" / "models" / "llama-3.1-8b"
)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# A decode token and a prefill chunk: the one launcher whose tile follows the token count (per-head
# rms_norm, rows = tokens x heads) picks the same tile for every count from 2 on.
TOKENS = (1, 256)
CACHED_PREFIX = 1000  # tokens already in the KV cache when an append-prefill runs
MAX_DECODE_BATCH = 512  # choose_num_splits is asked about every batch size up to this
# Needs ~276 KB in bfloat16 (256-key K and V tiles, pipelined). Float32 tiles that big compile for
# minutes.
OVERSIZED = AttentionConfig(block_m=16, tile_n=256, num_warps=4, num_stages=6)


@dataclass(frozen=True)
class Launch:
    kernel: str
    shared: int  # bytes of shared memory the compiled kernel needs
    # what the launcher was given: grid, stream, function, metadata, hooks, then every argument
    args: tuple = ()


class StopAfterPtxas(DriverBase):
    """Triton's view of an H100 that compiles kernels to cubins but loads and runs none: each launch
    is recorded."""

    def __init__(self) -> None:
        self.launches: list[Launch] = []
        # Triton asks its driver's C helpers (utils) for device properties and module loading
        self.utils = self

    @classmethod
    def is_active(cls) -> bool:
        return False  # never chosen by Triton's own driver discovery, only by set_active

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def map_python_to_cpp_type(self, ty: str) -> str:
        return ty

    def get_benchmarker(self) -> Any:
        raise NotImplementedError("nothing runs on the stand-in driver")

    def get_device_properties(self, device: int) -> dict[str, int]:
        return {
            "max_shared_mem": H100_SHARED_MEMORY,
            "multiprocessor_count": H100_SMS,
            "warpSize": 32,
        }

    def load_binary(
        self, name: str, kernel: bytes, shared: int, device: int
    ) -> tuple[Any, Any, int, int, int]:
        """(module, function, registers, spills, max threads per block). Triton checks shared memory
        before this; the CUDA driver refuses the kernel here too, so the check does not hang on
        Triton's."""
        if shared > H100_SHARED_MEMORY:
            raise OutOfResources(shared, H100_SHARED_MEMORY, "shared memory")
        return name, name, 0, 0, H100_MAX_THREADS

    def unload_module(self, module: Any) -> None:
        pass

    def launcher_cls(self, src: Any, metadata: Any) -> Callable[..., None]:
        """The launcher Triton builds for a loaded kernel (Triton's name for it): this one records
        the launch."""
        return lambda *args: self.launches.append(Launch(metadata.name, metadata.shared, args))


@dataclass(frozen=True)
class Case:
    name: str
    family: str  # cases of one family share compiled kernels: one process runs them in turn
    run: Callable[[], object]


@dataclass(frozen=True)
class Result:
    # OK; SMEM: a kernel over H100_SHARED_MEMORY; FAIL: a compile error, or no kernel launched
    status: str
    name: str
    launches: int
    shared: int
    seconds: float
    error: str = ""

    def line(self) -> str:
        error = f"  {self.error}" if self.error else ""
        return (
            f"{self.status:4s}  {self.name:62s} {self.launches} launch(es)  shared "
            f"{self.shared:6d} B  "
            f"{self.seconds:5.1f} s{error}"
        )


def run_case(stand_in: StopAfterPtxas, case: Case) -> Result:
    """Run one case; a compile error, a kernel over the shared-memory limit, or no launch at all is
    not OK."""
    start, before = time.perf_counter(), len(stand_in.launches)
    status, error, shared = "OK", "", 0
    try:
        case.run()
    except OutOfResources as exc:  # Triton's load-time check, as on the GPU
        status, error, shared = (
            "SMEM" if exc.name == "shared memory" else "FAIL",
            str(exc),
            exc.required,
        )
    except Exception as exc:  # noqa: BLE001 - a compile error of any kind is a result to report
        status, error = "FAIL", " | ".join(f"{type(exc).__name__}: {exc}".splitlines())[-800:]
    new = stand_in.launches[before:]
    # a finished case's launches keep no arguments: its tensors are freed before the next case's
    stand_in.launches[before:] = [replace(launch, args=()) for launch in new]
    shared = max([shared] + [launch.shared for launch in new])
    if status == "OK" and not new:
        status, error = "FAIL", "no kernel was launched"
    return Result(status, case.name, len(new), shared, time.perf_counter() - start, error)


# ---- the model's launches ------------------------------------------------------------------------


class Model:
    """Llama-3.1-8B's shapes, a TritonBackend, and a small KV cache (of kv_dtype, read through
    kv_scales): block tables point at block 0 (nothing runs)."""

    def __init__(
        self,
        dtype: torch.dtype,
        kv_dtype: torch.dtype | None = None,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> None:
        self.dtype = dtype
        self.kv_scales = kv_scales
        self.h, self.hkv, self.d = LLAMA.num_heads, LLAMA.num_kv_heads, LLAMA.head_dim
        self.block_size = EngineConfig.block_size
        shape = AttentionShape(
            self.h,
            self.hkv,
            self.d,
            self.block_size,
            max_blocks_per_seq=math.ceil(LLAMA.max_position_embeddings / self.block_size),
        )
        self.backend = TritonBackend(shape, torch.device("cpu"))
        self.k_cache = torch.zeros(4 * self.block_size, self.hkv, self.d, dtype=kv_dtype or dtype)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.cos = torch.zeros(
            LLAMA.max_position_embeddings, self.d // 2
        )  # float32, as Model.rope_cos
        self.sin = torch.zeros_like(self.cos)

    @functools.cached_property
    def graph_buffers(self) -> GraphBuffers:
        return self.backend.graph_metadata(
            graph_buckets(EngineConfig.max_num_seqs, EngineConfig.max_graph_tokens)
        )

    def step(self, seqs: list[tuple[int, int]]) -> StepBatch:
        """A step over sequences of (cached, new) tokens, as the scheduler hands it to the model
        runner (the sequences of one new token first)."""
        starts = [0]
        for _, new in seqs:
            starts.append(starts[-1] + new)
        decodes = next((i for i, (_, new) in enumerate(seqs) if new > 1), len(seqs))
        return StepBatch(
            token_ids=[0] * starts[-1],
            positions=[c + i for c, n in seqs for i in range(n)],
            slot_mapping=[0] * starts[-1],
            query_start=starts,
            seq_lens=[c + n for c, n in seqs],
            block_tables=[[0] * math.ceil((c + n) / self.block_size) for c, n in seqs],
            sample_rows=[s - 1 for s in starts[1:]],
            block_size=self.block_size,
            num_decodes=decodes,
        )

    def qkv(self, t: int) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v as engine/model.py has them: strided views of one fused qkv projection output."""
        h, hkv, d = self.h, self.hkv, self.d
        q, k, v = torch.zeros(t, (h + 2 * hkv) * d, dtype=self.dtype).split(
            [h * d, hkv * d, hkv * d], dim=-1
        )
        return q.view(t, h, d), k.view(t, hkv, d), v.view(t, hkv, d)

    @staticmethod
    def positions(t: int) -> Tensor:
        """Positions as ModelRunner uploads them: after the token ids in one int64 tensor, 16-byte
        aligned."""
        return torch.zeros(2 * t + 2, dtype=torch.int64)[t + t % 2 : t + t % 2 + t]

    def attention(self, meta: TritonMetadata, t: int, positions: Tensor) -> None:
        """One layer's attention kernels as Attention.forward runs them: the backend's
        rope_and_attend (RoPE fused with the KV store, then the attention planned for the step)."""
        q, k, v = self.qkv(t)
        self.backend.rope_and_attend(
            q,
            k,
            v,
            self.k_cache,
            self.v_cache,
            meta,
            self.d**-0.5,
            positions,
            self.cos,
            self.sin,
            kv_scales=self.kv_scales,
        )

    def decode(self, batch: int, context: int, splits: int) -> None:
        """A decode step of batch sequences at context, with the workspace prepare() allocates for
        splits."""
        meta = self.backend.prepare(self.step([(context - 1, 1)] * batch))
        assert meta.num_splits == splits, (meta.num_splits, splits)
        self.attention(meta, batch, self.positions(batch))

    def graph_step(self, bucket: GraphBucket, splits: int = 1, mixed: str = "fused") -> None:
        """A CUDA graph's step (its decode grid's splits in a decode bucket, else its general
        grid's, and the mixed launch of a token bucket, which has decode slots): metadata and
        workspace are views of the static buffers."""
        triton_backend.MIXED_LAUNCH = mixed
        meta = self.backend.graph_view(self.graph_buffers, bucket)
        assert (meta.num_splits if bucket.decode else meta.general_splits) == splits, (meta, splits)
        self.attention(meta, bucket.tokens, torch.zeros(bucket.tokens, dtype=torch.int64))

    def prefill(
        self,
        seqs: list[tuple[int, int]],
        config: AttentionConfig,
        splits: int = 1,
        mixed: str = "fused",
    ) -> None:
        """A step (decodes first, then prefills or appends) whose general tile default_config must
        pick as config, split `splits` ways, the two grids launched as `mixed` says."""
        triton_backend.MIXED_LAUNCH = mixed
        meta = self.backend.prepare(self.step(seqs))
        assert default_config(meta.max_query_len, self.h // self.hkv, meta.max_seq_len) == config
        assert meta.general_splits == splits, (meta.general_splits, splits)
        t = sum(new for _, new in seqs)
        self.attention(meta, t, self.positions(t))

    def prefill_with(self, config: AttentionConfig, new: int) -> None:
        """paged_attention over a new prompt with its tile table overridden (as bench/kernels.py
        sweeps it)."""
        meta = self.backend.prepare(self.step([(0, new)]))
        q = self.qkv(new)[0].contiguous()
        paged_attention(
            q,
            self.k_cache,
            self.v_cache,
            meta.block_tables,
            meta.query_start,
            meta.seq_lens,
            block_size=self.block_size,
            scale=self.d**-0.5,
            max_query_len=new,
            config=config,
        )


@functools.cache
def model(dtype: str) -> Model:
    return Model(DTYPES[dtype])


@functools.cache
def fp8_model() -> Model:
    """A bfloat16 model over an fp8 (e4m3) KV pool, its layer's scales not 1."""
    return Model(torch.bfloat16, torch.float8_e4m3fn, (0.05, 3.0))


# ---- the cases -----------------------------------------------------------------------------------


def contexts() -> list[int]:
    """Context lengths from 1 to the model's longest, each about 5/4 of the one before."""
    longest, found = LLAMA.max_position_embeddings, [1]
    while found[-1] < longest:
        found.append(min(found[-1] * 5 // 4 + 1, longest))
    return found


def first_batch_per_split() -> dict[int, tuple[int, int]]:
    """Every split count choose_num_splits returns for Llama-3.1-8B over batches 1..MAX_DECODE_BATCH
    and contexts up to the model's longest, each with the smallest (batch, context) that gets it."""
    found: dict[int, tuple[int, int]] = {}
    for batch in range(1, MAX_DECODE_BATCH + 1):
        for context in contexts():
            found.setdefault(
                choose_num_splits(batch, LLAMA.num_kv_heads, context, H100_SMS), (batch, context)
            )
    return dict(sorted(found.items()))


def first_append_per_split() -> dict[tuple[AttentionConfig, int], tuple[int, int]]:
    """Every (tile, split count) the general grid gets for one sequence of up to a full chunk of new
    tokens over a cached prefix (none included), each with the smallest (new, cached) that gets
    it."""
    group, hkv, chunk = (
        LLAMA.num_heads // LLAMA.num_kv_heads,
        LLAMA.num_kv_heads,
        EngineConfig.max_num_batched_tokens,
    )
    news = set(range(2, 2 * PREFILL_CONFIGS[-1].block_m // group + 1)) | {
        2**k for k in range(chunk.bit_length())
    }
    found: dict[tuple[AttentionConfig, int], tuple[int, int]] = {}
    for new in sorted(news | {chunk}):
        for cached in [0, *contexts()]:
            if 2 <= new <= chunk and cached + new <= LLAMA.max_position_embeddings:
                config = default_config(new, group, cached + new)
                programs = general_programs(new, group, hkv, config)
                found.setdefault(
                    (config, choose_append_splits(programs, new, cached + new, H100_SMS)),
                    (new, cached),
                )
    return found


def tile(config: AttentionConfig) -> str:
    return (
        f"tile {config.block_m}x{config.tile_n} warps {config.num_warps} stages {config.num_stages}"
    )


def attention_cases(dt: str) -> list[Case]:
    """A full-chunk prompt; every tile of the general grid unsplit, each through the smallest step
    that gets it (an override for a tile none gets); then decode for every split count the engine
    can choose, with the workspace prepare() allocates."""
    group, chunk = LLAMA.num_heads // LLAMA.num_kv_heads, EngineConfig.max_num_batched_tokens
    longest = default_config(chunk, group, chunk)
    cases = [
        Case(
            f"attention prefill {dt} {chunk}-token prompt",
            f"prefill {dt} {longest}",
            lambda: model(dt).prefill([(0, chunk)], longest),
        )
    ]
    appends = first_append_per_split()
    for (config, splits), (new, cached) in appends.items():
        if splits == 1:
            cases.append(
                Case(
                    f"attention append {dt} {tile(config)} ({new} new over {cached})",
                    f"prefill {dt} {config}",
                    lambda n=new, c=cached, config=config: model(dt).prefill([(c, n)], config),
                )
            )
    for config in (APPEND_CONFIG, *PREFILL_CONFIGS):
        if (
            config,
            1,
        ) not in appends:  # an entry this model's batches never get unsplit: compile it anyway
            cases.append(
                Case(
                    f"attention prefill {dt} {tile(config)} (override)",
                    f"prefill {dt} {config}",
                    lambda config=config: model(dt).prefill_with(config, chunk),
                )
            )
    for splits, (batch, context) in first_batch_per_split().items():
        cases.append(
            Case(
                f"attention decode {dt} splits={splits} (batch {batch}, context {context})",
                f"decode {dt} {splits > 1}",
                lambda b=batch, c=context, s=splits: model(dt).decode(b, c, s),
            )
        )
    return cases


def split_cases(dt: str) -> list[Case]:
    """Every (tile, split count > 1) of the general grid, each through the smallest step that gets
    it, with its merge; each tile beside a decode, in one launch with neither grid split and with
    both, and in two launches."""
    appends = first_append_per_split()
    cases = [
        Case(
            f"attention append {dt} {tile(config)} splits={splits} ({new} new over {cached})",
            f"split {dt} {config}",
            lambda n=new, c=cached, config=config, s=splits: model(dt).prefill([(c, n)], config, s),
        )
        for (config, splits), (new, cached) in appends.items()
        if splits > 1
    ]
    split_decode, whole_decode = (4095, 1), (15, 1)  # a decode of 16 splits, one of none (batch 1)
    for config in dict.fromkeys(c for c, _ in appends):
        splits = [s for c, s in appends if c == config]
        plain, split = appends[config, min(splits)], appends[config, max(splits)]
        steps = [
            ("fused", whole_decode, plain, min(splits)),
            ("fused", split_decode, split, max(splits)),
            ("sequential", split_decode, split, max(splits)),
        ]
        for mixed, decode, (new, cached), s in steps:
            cases.append(
                Case(
                    f"attention mixed {dt} {tile(config)} splits={s} beside decode at "
                    f"{decode[0] + 1}, "
                    f"{mixed}",
                    f"split {dt} {config}",
                    lambda m=mixed, seqs=[decode, (cached, new)], config=config, s=s: model(
                        dt
                    ).prefill(seqs, config, s, m),
                )
            )
    return cases


def graph_cases(dt: str) -> list[Case]:
    """Steps replayed from CUDA graphs (the GPU's default path for steps up to max_graph_tokens):
    decode, one batch bucket per split count; every (tile, split count) a token bucket is planned
    with, at its smallest bucket, in either mixed launch (a token bucket has decode slots). Their
    kernels differ from eager steps' only in pointer alignment (static buffers), so one dtype is
    enough."""
    longest = (
        math.ceil(LLAMA.max_position_embeddings / EngineConfig.block_size) * EngineConfig.block_size
    )
    group, hkv = LLAMA.num_heads // LLAMA.num_kv_heads, LLAMA.num_kv_heads
    decode: dict[int, GraphBucket] = {}
    tiles: dict[tuple[AttentionConfig, int], GraphBucket] = {}
    for bucket in graph_buckets(EngineConfig.max_num_seqs, EngineConfig.max_graph_tokens):
        if bucket.decode:  # graphs are captured for the longest context (TritonBackend)
            decode.setdefault(choose_num_splits(bucket.seqs, hkv, longest, H100_SMS), bucket)
        else:
            config = default_config(bucket.max_query_len, group, longest)
            programs = general_programs(bucket.tokens, group, hkv, config)
            tiles.setdefault(
                (config, choose_append_splits(programs, bucket.max_query_len, longest, H100_SMS)),
                bucket,
            )
    return [
        Case(
            f"attention decode graph {dt} splits={splits} (batch {b.seqs})",
            f"graph {dt} {splits > 1}",
            lambda b=b, s=splits: model(dt).graph_step(b, s),
        )
        for splits, b in sorted(decode.items())
    ] + [
        Case(
            f"attention step graph {dt} {b.tokens} tokens ({tile(config)}, splits={splits}, "
            f"{mixed})",
            f"graph {dt} {config}",
            lambda b=b, s=splits, m=mixed: model(dt).graph_step(b, s, m),
        )
        for (config, splits), b in tiles.items()
        for mixed in ("fused", "sequential")
    ]


def fp8_cases() -> list[Case]:
    """An fp8 KV pool under a bfloat16 model: the store, and each layer's RoPE fused with the store
    before attention's decode grid unsplit and split, the general grid over a prompt and split over
    an append, and the two in one launch, both split (each split with its merge). The tiles are
    bfloat16's, the pool's dtype only their loads."""
    group, chunk = LLAMA.num_heads // LLAMA.num_kv_heads, EngineConfig.max_num_batched_tokens
    family = "fp8 bfloat16"

    def kv_store() -> None:
        m = fp8_model()
        _, k, v = m.qkv(TOKENS[-1])
        slots = torch.zeros(TOKENS[-1], dtype=torch.int64)
        store_kv(k, v, m.k_cache, m.v_cache, slots, m.kv_scales)

    decodes = first_batch_per_split()
    appends = first_append_per_split()
    split = max(s for c, s in appends if c == APPEND_CONFIG)
    new, cached = appends[APPEND_CONFIG, split]
    prompt = default_config(chunk, group, chunk)
    cases = [Case("store_kv bfloat16 into fp8", family, kv_store)]
    for splits in (min(decodes), max(decodes)):
        batch, context = decodes[splits]
        cases.append(
            Case(
                f"attention decode bfloat16 fp8 splits={splits} (batch {batch}, context {context})",
                family,
                lambda b=batch, c=context, s=splits: fp8_model().decode(b, c, s),
            )
        )
    return cases + [
        Case(
            f"attention prefill bfloat16 fp8 {chunk}-token prompt",
            family,
            lambda: fp8_model().prefill([(0, chunk)], prompt),
        ),
        Case(
            f"attention append bfloat16 fp8 {tile(APPEND_CONFIG)} splits={split} ({new} new "
            f"over {cached})",
            family,
            lambda: fp8_model().prefill([(cached, new)], APPEND_CONFIG, split),
        ),
        Case(
            f"attention mixed bfloat16 fp8 {tile(APPEND_CONFIG)} splits={split} beside a split "
            "decode, fused",
            family,
            lambda: fp8_model().prefill([(4095, 1), (cached, new)], APPEND_CONFIG, split, "fused"),
        ),
    ]


def elementwise_cases(dt: str) -> list[Case]:
    """The fused elementwise kernels through the backend's ops, on the tensors the model passes
    them."""
    eps, hidden, family = LLAMA.rms_norm_eps, LLAMA.hidden_size, f"elementwise {dt}"

    def norm(t: int) -> None:
        m = model(dt)
        m.backend.ops.rms_norm(
            torch.zeros(t, hidden, dtype=m.dtype), torch.ones(hidden, dtype=m.dtype), eps
        )

    def add_norm(t: int) -> None:
        m = model(dt)
        x = torch.zeros(t, hidden, dtype=m.dtype)
        m.backend.ops.add_rms_norm(x, torch.zeros_like(x), torch.ones(hidden, dtype=m.dtype), eps)

    def head_norm(
        t: int, which: int
    ) -> None:  # Qwen3's per-head q/k norm, on views of the qkv output
        m = model(dt)
        m.backend.ops.rms_norm(m.qkv(t)[which], torch.ones(m.d, dtype=m.dtype), eps)

    def rope(t: int) -> None:
        m = model(dt)
        q, k, _ = m.qkv(t)
        m.backend.ops.apply_rope(q, k, m.positions(t), m.cos, m.sin)

    def kv_store(t: int) -> None:
        m = model(dt)
        _, k, v = m.qkv(t)
        store_kv(k, v, m.k_cache, m.v_cache, torch.zeros(t, dtype=torch.int64))

    def rope_kv_store(
        t: int,
    ) -> None:  # the engine's path: int32 slots, into the step's rotated-query buffer
        m = model(dt)
        q, k, v = m.qkv(t)
        rope_store_kv(
            q,
            k,
            v,
            m.positions(t),
            m.cos,
            m.sin,
            m.k_cache,
            m.v_cache,
            torch.zeros(t, dtype=torch.int32),
            out=torch.empty(t, m.h, m.d, dtype=m.dtype),
        )

    def silu_mul(t: int) -> None:
        m = model(dt)
        m.backend.ops.silu_and_mul(torch.zeros(t, 2 * LLAMA.intermediate_size, dtype=m.dtype))

    cases = []
    for t in TOKENS:
        cases += [
            Case(f"rms_norm {dt} hidden t={t}", family, lambda t=t: norm(t)),
            Case(f"add_rms_norm {dt} hidden t={t}", family, lambda t=t: add_norm(t)),
            Case(f"rms_norm {dt} per-head q t={t}", family, lambda t=t: head_norm(t, 0)),
            Case(f"rms_norm {dt} per-head k t={t}", family, lambda t=t: head_norm(t, 1)),
            Case(f"apply_rope {dt} t={t}", family, lambda t=t: rope(t)),
            Case(f"store_kv {dt} t={t}", family, lambda t=t: kv_store(t)),
            Case(f"rope_store_kv {dt} t={t}", family, lambda t=t: rope_kv_store(t)),
            Case(f"silu_and_mul {dt} t={t}", family, lambda t=t: silu_mul(t)),
        ]
    return cases


QWEN3_MOE = ModelConfig.from_folder(
    Path(__file__).resolve().parents[3] / "bench" / "models" / "qwen3-30b-a3b"
)
MIXTRAL = ModelConfig.from_folder(
    Path(__file__).resolve().parents[3] / "bench" / "models" / "mixtral-8x7b"
)


def moe_layer(cfg: ModelConfig, dt: str, tokens: int) -> None:
    """A mixture-of-experts layer as MoE.forward runs it on the Triton backend: the router's
    choice, then the fused layer (align, the two grouped GEMMs, silu_and_mul, the top-k sum). The
    stacked weights are one expert's memory expanded to E (an expert stride of 0, which Triton
    specializes as it does the real one, a multiple of 16): a launch record keeps 1/E of the real
    bytes alive."""
    ops, dtype = model(dt).backend.ops, DTYPES[dt]
    e, h, w = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    logits = torch.zeros(tokens, e, dtype=dtype)
    weights, ids = ops.route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    experts = Experts.of(
        torch.zeros(1, 2 * w, h, dtype=dtype).expand(e, -1, -1),
        torch.zeros(1, h, w, dtype=dtype).expand(e, -1, -1),
    )
    ops.moe(torch.zeros(tokens, h, dtype=dtype), experts, weights, ids)


def moe_cases(dt: str) -> list[Case]:
    """Every tile of the grouped GEMM (MOE_CONFIGS), each through the smallest token count that
    gets it, at Qwen3-30B-A3B's shapes (8 of 128 experts) and Mixtral-8x7B's (2 of 8)."""
    cases = []
    for cfg, name in ((QWEN3_MOE, "qwen3-30b-a3b"), (MIXTRAL, "mixtral-8x7b")):
        k, seen = cfg.num_experts_per_tok, set()
        for tokens in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096):
            config = moe_config(tokens * k, DTYPES[dt])
            if config in seen:
                continue
            seen.add(config)
            cases.append(
                Case(
                    f"moe {name} {dt} t={tokens} (tile {config.block_m}x{config.block_n}"
                    f"x{config.block_k})",
                    f"moe {dt}",
                    lambda cfg=cfg, t=tokens: moe_layer(cfg, dt, t),
                )
            )
    return cases


def relaunch_check(dt: str) -> None:
    """engine/kernels/launch.py's Launches: a step's second launch of each kind (the compiled
    kernel's launcher called directly) gives the launcher what the first, through the JIT, gave
    it (but the launch hooks and their metadata, which it leaves out when no profiler set a
    hook): two layers of a decode step, a prompt and a mixed step, each kernel of a layer."""
    m = model(dt)

    def described(launch: Launch) -> tuple:
        args = launch.args[:6] + launch.args[8:]
        return tuple((x.dtype, x.shape, x.stride()) if isinstance(x, Tensor) else x for x in args)

    for seqs in ([(CACHED_PREFIX, 1)] * 4, [(0, 64)], [(1, 1), (CACHED_PREFIX, 16)]):
        batch = m.step(seqs)
        meta = m.backend.prepare(batch)
        t = len(batch.token_ids)
        q, k, v = m.qkv(t)
        hidden, residual = (
            torch.zeros(t, LLAMA.hidden_size, dtype=m.dtype),
            torch.zeros(t, LLAMA.hidden_size, dtype=m.dtype),
        )
        weight = torch.ones(LLAMA.hidden_size, dtype=m.dtype)
        gate_up, positions = (
            torch.zeros(t, 2 * LLAMA.intermediate_size, dtype=m.dtype),
            m.positions(t),
        )
        layers = []
        for _ in range(2):
            before = len(_stand_in.launches)
            m.backend.ops.add_rms_norm(hidden, residual, weight, LLAMA.rms_norm_eps)
            m.backend.rope_and_attend(
                q, k, v, m.k_cache, m.v_cache, meta, m.d**-0.5, positions, m.cos, m.sin
            )
            m.backend.ops.silu_and_mul(gate_up)
            layers.append(_stand_in.launches[before:])
        first, second = ([described(launch) for launch in layer] for layer in layers)
        assert len(first) == len(second) >= 4 and first == second, (
            f"relaunch differs from the JIT's launch: {seqs}"
        )
        assert all(launch.args[7] is None for launch in layers[1]), (
            "the second layer went through the JIT"
        )


def sm_ids_launch(programs: int = 4) -> None:
    """The green-context probe's %smid kernel (probe_kernels.sm_ids allocates on CUDA: launched here
    directly)."""
    sm = torch.empty(programs, dtype=torch.int32)
    work = torch.empty(programs * SM_ID_BLOCK, dtype=torch.float32)
    _sm_ids_kernel[(programs,)](sm, work, 100, BLOCK=SM_ID_BLOCK, num_warps=1)


PARTS = {
    "default": "every case but float32-splits' (fast, float16, slow and the FP8 GEMMs' together)",
    "float32-splits": "float32 attention split over its keys, or beside decodes in one launch: "
    "minutes of FMA dots each to compile (the second test suite)",
    "fast": "bfloat16 attention and mixtures of experts, and every elementwise kernel in every "
    "dtype (the default test suite)",
    "float16": "float16 attention and mixtures of experts, the same kernels as bfloat16's with "
    "another dot type: over a minute of CPU time with an empty Triton cache (the second suite)",
    "slow": "float32 attention unsplit, whose FMA dots take several times as long to compile as "
    "the rest together, bfloat16 steps replayed from CUDA graphs, and a bfloat16 model over an "
    "fp8 KV pool (the second test suite)",
    "oversized": "only an attention tile too big for shared memory, which must come out SMEM",
    "fp8-gemm": "the FP8 linear layers' kernels (sm90_compile_fp8.py) in bfloat16 (second suite)",
    "fp8-gemm-float16": "the FP8 linear layers' kernels in float16 (the second suite)",
}


def cases(part: str) -> list[Case]:
    """The part's cases, the slowest families first so that the pool's last jobs are short."""
    if part == "oversized":
        return [
            Case(
                f"attention prefill bfloat16 oversized {OVERSIZED}",
                "oversized",
                lambda: model("bfloat16").prefill_with(OVERSIZED, 256),
            )
        ]
    if part == "float32-splits":
        return split_cases("float32")
    from tests.engine.kernels.sm90_compile_fp8 import fp8_gemm_cases  # which imports this module

    if part in ("fp8-gemm", "fp8-gemm-float16"):
        return fp8_gemm_cases("float16" if part == "fp8-gemm-float16" else "bfloat16")
    slow = attention_cases("float32") + graph_cases("bfloat16") + moe_cases("float32") + fp8_cases()
    float16 = split_cases("float16") + attention_cases("float16") + moe_cases("float16")
    fast = split_cases("bfloat16") + attention_cases("bfloat16") + moe_cases("bfloat16")
    fast += [case for dt in DTYPES for case in elementwise_cases(dt)]
    fast.append(Case("relaunch bfloat16", "relaunch", lambda: relaunch_check("bfloat16")))
    fast.append(Case("probe spin float32", "probe", lambda: spin(torch.zeros(2 * BLOCK), 1000)))
    fast.append(Case("probe sm_ids", "probe", sm_ids_launch))
    everything = slow + float16 + fast + fp8_gemm_cases("bfloat16") + fp8_gemm_cases("float16")
    return {"slow": slow, "float16": float16, "fast": fast}.get(part, everything)


# ---- running them --------------------------------------------------------------------------------

_stand_in: StopAfterPtxas | None = None
_cases: list[Case] = []


def _start_worker(part: str) -> None:
    global _stand_in, _cases
    torch.set_num_threads(1)
    _stand_in = StopAfterPtxas()
    driver.set_active(_stand_in)
    _cases = cases(part)


def _run_family(family: str) -> list[tuple[int, Result]]:
    assert _stand_in is not None, "call _start_worker first"
    return [
        (i, run_case(_stand_in, case)) for i, case in enumerate(_cases) if case.family == family
    ]


def run_part(part: str, jobs: int) -> list[Result]:
    """The part's results in case order; each family of cases runs in one process, up to jobs at a
    time."""
    _start_worker(part)
    families = list(dict.fromkeys(case.family for case in _cases))
    if jobs <= 1 or len(families) == 1:
        done = [pair for family in families for pair in _run_family(family)]
    else:
        spawn = multiprocessing.get_context(
            "spawn"
        )  # a fresh interpreter: forking after torch's import is unsafe
        with ProcessPoolExecutor(
            min(jobs, len(families)), mp_context=spawn, initializer=_start_worker, initargs=(part,)
        ) as pool:
            done = [pair for pairs in pool.map(_run_family, families) for pair in pairs]
    return [result for _, result in sorted(done, key=lambda pair: pair[0])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(f"  {name:18s} {text}" for name, text in PARTS.items()),
    )
    parser.add_argument(
        "--part", choices=PARTS, default="default", help="which cases to compile (below)"
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiling processes")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: under the interpreter nothing is compiled", file=sys.stderr)
        return 2
    start = time.perf_counter()
    results = run_part(args.part, args.jobs)
    print(
        f"triton {triton.__version__}, torch {torch.__version__}, target cuda:90, "
        f"shared memory limit {H100_SHARED_MEMORY} B"
    )
    for result in results:
        print(result.line(), flush=True)
    bad = [r for r in results if r.status != "OK"]
    print(
        f"{len(results) - len(bad)} of {len(results)} cases OK in "
        f"{time.perf_counter() - start:.0f} s"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
