"""The CPU backend: our decode and prefill kernels (engine/attention/cpu_decode.c, cpu_prefill.c)
against float64 reference attention, the elementwise, few-rows and AMX linear kernels against
PyTorch's ops, each in this CPU's build and in the build without AVX-512 (PPD_CPU_ISA=avx2), and the
backend's mixed steps against the torch backend's."""

from __future__ import annotations

import logging
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from engine.attention import AttentionShape, StepBatch, cpu_kernel, create_backend
from engine.attention.cpu_backend import CpuBackend
from engine.attention.torch_backend import (
    AttentionMetadata,
    TorchBackend,
    reference_attention,
    sdpa_attention,
)
from tests.engine.test_cpu_isa import stand_in_compiler

kernels = cpu_kernel.load()
# Only a machine without a C compiler skips these; where there is one, the kernels must build (a
# compile error is a failure, not a skip: test_the_kernels_build_where_there_is_a_compiler).
needs_kernel = pytest.mark.skipif(
    kernels is None and cpu_kernel._compiler() is None,
    reason="no C compiler here to build the CPU kernel",
)


def test_the_kernels_build_where_there_is_a_compiler() -> None:
    if cpu_kernel._compiler() is None:
        pytest.skip("no C compiler here to build the CPU kernel")
    for isa in cpu_kernel.ISA_FLAGS:
        cpu_kernel.build(build_isa=isa)  # raises with the compiler's message
    assert kernels is not None


@pytest.fixture(scope="module", params=["native", "avx2"])
def built(request: pytest.FixtureRequest) -> cpu_kernel.CpuKernels:
    """Each build of the kernels: for this CPU (-march=native), and without AVX-512 (the paths of an
    AVX2-only CPU, whose vectors are half as wide)."""
    if cpu_kernel._compiler() is None:
        pytest.skip("no C compiler here to build the CPU kernel")
    return cpu_kernel.CpuKernels(cpu_kernel.build(build_isa=request.param))


def paged(
    lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
):
    """A pool of random K/V with each sequence's blocks scattered over it, and its block tables."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 7
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(order[i : i + n])
        i += n
    k_cache = torch.randn(num_blocks * block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    return k_cache, v_cache, tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(4, 4, 64), (16, 8, 64), (8, 2, 128), (12, 2, 96), (4, 1, 80)],
)
@pytest.mark.parametrize(
    "lens", [[1, 15, 16, 17, 100, 513], [700], [3, 300]], ids=["many", "one", "two"]
)
def test_decode_kernel_matches_float64_reference(
    built: cpu_kernel.CpuKernels,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    lens: list[int],
) -> None:
    """Many sequences (one per work item) and one or two (their KV heads split among the threads);
    head sizes that are multiples of a vector (8 floats with AVX2, 16 with AVX-512) and one that
    is not with AVX-512 (80)."""
    check_decode(built, dtype, num_heads, num_kv_heads, head_dim, lens)


def check_decode(
    kernels: cpu_kernel.CpuKernels,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    lens: list[int],
) -> None:
    block_size = 16
    k_cache, v_cache, tables = paged(
        lens, block_size, num_kv_heads, head_dim, dtype, seed=num_heads + head_dim
    )
    q = torch.randn(len(lens), num_heads, head_dim).to(dtype)
    # The reference writes the new token's K/V itself; here they are already in the pool at the last
    # slot.
    last = torch.tensor(
        [t[(n - 1) // block_size] * block_size + (n - 1) % block_size for t, n in zip(tables, lens)]
    )
    meta = AttentionMetadata(last, list(range(len(lens) + 1)), lens, tables, block_size)
    k64, v64 = k_cache.double(), v_cache.double()
    ref = reference_attention(q.double(), k64[last], v64[last], k64, v64, meta, 0.125)
    width = max(map(len, tables))
    table_tensor = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    out = kernels.paged_decode(
        q, k_cache, v_cache, table_tensor, torch.tensor(lens, dtype=torch.int32), 0.125, block_size
    )
    assert out.dtype == dtype and out.shape == q.shape and not out.isnan().any()
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < (1e-6 if dtype == torch.float32 else 1e-2), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("lens", "news", "heads", "block_size"),
    [
        ([17], [17], (4, 4, 64), 16),  # a prompt inside one key tile
        (
            [100, 513, 40],
            [30, 513, 2],
            (16, 8, 64),
            16,
        ),  # appends, a prompt over 9 key tiles, a 2-token append
        (
            [300, 77],
            [5, 77],
            (8, 2, 128),
            16,
        ),  # a short append over a long context (few rows an item)
        ([200], [200], (28, 4, 128), 16),  # G = 7: query tiles of 9 tokens, 63 rows
        ([50, 90], [50, 3], (6, 6, 48), 8),  # a head size that is no multiple of 16
        ([33], [20], (4, 1, 80), 32),  # G = 4 over one KV head, larger blocks
    ],
    ids=["one-tile", "appends", "short-append", "group-of-7", "head-48", "head-80"],
)
def test_prefill_kernel_matches_float64_reference(
    built: cpu_kernel.CpuKernels,
    dtype: torch.dtype,
    lens: list[int],
    news: list[int],
    heads: tuple[int, int, int],
    block_size: int,
) -> None:
    """Sequence b's news[b] new queries are the last of its lens[b] tokens and attend causally, over
    blocks scattered in the pool."""
    check_prefill(built, dtype, lens, news, heads, block_size)


@needs_kernel
def test_the_kernels_without_the_cpus_bfloat16_instructions() -> None:
    """Where the CPU has AVX512-BF16 the bfloat16 rows take the dot-product paths; the paths of an
    AVX-512 CPU without them (bfloat16 widened to float32) are built here without those instructions
    and checked the same way (the AVX2 build's widened paths are in the tests above)."""
    try:
        plain = cpu_kernel.CpuKernels(cpu_kernel.build(("-mno-avx512bf16",)))
    except RuntimeError as exc:
        pytest.skip(f"this compiler has no -mno-avx512bf16: {exc}")
    for lens, news, heads in [
        ([100, 513, 40], [30, 513, 2], (16, 8, 64)),
        ([50, 90], [50, 3], (6, 6, 48)),
    ]:
        check_prefill(plain, torch.bfloat16, lens, news, heads, 16)
    for lens in ([1, 15, 16, 17, 100, 513], [700]):
        check_decode(plain, torch.bfloat16, 16, 8, 64, lens)
    check_few_rows(plain)


def check_prefill(
    kernels: cpu_kernel.CpuKernels,
    dtype: torch.dtype,
    lens: list[int],
    news: list[int],
    heads: tuple[int, int, int],
    block_size: int,
) -> None:
    num_heads, num_kv_heads, head_dim = heads
    k_cache, v_cache, tables = paged(
        lens, block_size, num_kv_heads, head_dim, dtype, seed=num_heads + head_dim
    )
    starts = [0]
    for n in news:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], num_heads, head_dim).to(dtype)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.int64), starts, lens, tables, block_size)
    ref = sdpa_attention(q.double(), k_cache.double(), v_cache.double(), meta, 0.125)
    width = max(map(len, tables))
    table_tensor = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    out = kernels.paged_prefill(
        q,
        k_cache,
        v_cache,
        table_tensor,
        torch.tensor(lens, dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int32),
        0.125,
        block_size,
    )
    assert out.dtype == dtype and out.shape == q.shape and not out.isnan().any()
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < (1e-6 if dtype == torch.float32 else 1e-2), err
    # Each row on its own: a wrong mask or a dropped tile on one row is not averaged away by the
    # others.
    row_err = (
        ((out.double() - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)).max().item()
    )
    assert row_err < (1e-5 if dtype == torch.float32 else 2e-2), row_err


def mixed_batch(block_size: int, seed: int) -> tuple[StepBatch, list[int]]:
    """Decode rows, a full prefill and an append-prefill in one step, interleaved."""
    rng = random.Random(seed)
    news, cached = [1, 23, 1, 9, 1], [40, 0, 7, 30, 129]
    tables, next_block, slots, starts = [], 0, [], [0]
    for n, c in zip(news, cached):
        blocks = -(-(n + c) // block_size)
        table = list(range(next_block, next_block + blocks))
        rng.shuffle(table)
        next_block += blocks
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c, c + n)]
        starts.append(starts[-1] + n)
    total = starts[-1]
    batch = StepBatch(
        token_ids=[1] * total,
        positions=[0] * total,
        slot_mapping=slots,
        query_start=starts,
        seq_lens=[n + c for n, c in zip(news, cached)],
        block_tables=tables,
        sample_rows=[s - 1 for s in starts[1:]],
        block_size=block_size,
    )
    return batch, [next_block]


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "without-kernel"])
def test_a_mixed_step_equals_the_torch_backend(
    kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode rows through the decode kernel, prefill and append rows through the prefill kernel, in
    their places; without the kernels (no compiler) every row through SDPA."""
    if kernel and kernels is None:
        pytest.skip("no C compiler here to build the CPU kernel")
    block_size, heads, kv_heads, dim = 8, 8, 4, 64
    batch, (num_blocks,) = mixed_batch(block_size, seed=3)
    shape = AttentionShape(heads, kv_heads, dim, block_size, 32)
    cpu, ref = CpuBackend(shape, torch.device("cpu")), TorchBackend(shape, torch.device("cpu"))
    if not kernel:
        cpu.kernels = None
    total = len(batch.token_ids)
    q, k, v = (
        torch.randn(total, heads, dim),
        torch.randn(total, kv_heads, dim),
        torch.randn(total, kv_heads, dim),
    )
    caches = [torch.randn(num_blocks * block_size, kv_heads, dim) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    out = cpu.forward(q, k, v, *caches, cpu.prepare(batch), 0.125)
    expected = ref.forward(q, k, v, *ref_caches, ref.prepare(batch), 0.125)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches, ref_caches)  # both stored the step's K/V at the same slots


def test_the_cpu_backend_is_the_cpu_default_and_refuses_a_gpu() -> None:
    shape = AttentionShape(4, 2, 64, 16, 8)
    assert isinstance(create_backend("auto", shape, torch.device("cpu")), CpuBackend)
    with pytest.raises(ValueError, match="runs on the CPU"):
        create_backend("cpu", shape, torch.device("cuda"))


def test_a_failed_build_says_what_failed(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PPD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    with pytest.raises(RuntimeError, match="failed to build cpu_decode.c"):
        cpu_kernel.build()
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(RuntimeError, match="no C compiler"):
        cpu_kernel.build()


def test_builds_started_at_once_compile_once(
    tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A unit's workers (or servers sharing a cache) that start together: one compiles, the others
    wait for its library. The stand-in compiler takes half a second a call."""
    calls = stand_in_compiler(tmp_path, monkeypatch, seconds=0.5)
    start = threading.Barrier(3)

    def build() -> Path:
        start.wait()
        return cpu_kernel.build()

    with caplog.at_level(logging.INFO, logger="ppd.engine"), ThreadPoolExecutor(3) as pool:
        paths = list(pool.map(lambda _: build(), range(3)))
    assert len(set(paths)) == 1 and paths[0].exists()
    # the five sources and the link, once
    assert sum(" -o " in c for c in calls.read_text().splitlines()) == len(cpu_kernel.SOURCES) + 1
    assert caplog.text.count("compiling the CPU kernels for this CPU") == 1
    assert caplog.text.count("waiting for another process compiling") == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_packed_linear_equals_torchs_and_follows_its_weight(dtype: torch.dtype) -> None:
    """The CPU ops' linear on a prepacked weight gives F.linear's result; a weight that is freed
    frees its packed copy, so a later weight that reuses its memory is never served the old one."""
    from engine.attention import cpu_linear

    ops = cpu_linear.CpuOps()
    x, bias = torch.randn(40, 64).to(dtype), torch.randn(48).to(dtype)
    for _ in range(3):
        weight = torch.randn(48, 64).to(dtype)
        for rows in (
            x,
            x[:5],
            x[:1],
            x[:0],
        ):  # 40 rows: oneDNN's; 1 and 5: AMX's tiles where the CPU has them
            expected = torch.nn.functional.linear(rows, weight, bias)
            torch.testing.assert_close(
                ops.linear(rows, weight, bias), expected, atol=1e-2, rtol=1e-2
            )
        key, onednn = id(weight), cpu_linear.packed(weight)
        assert (("onednn", key) in cpu_linear._packed) == (onednn is not None)
        assert (("amx", key) in cpu_linear._packed) == (
            dtype == torch.bfloat16 and cpu_linear.amx_rows() > 0
        )
        del weight, onednn
        assert not any(k == key for _, k in cpu_linear._packed)


def test_loading_the_kernel_keeps_subnormal_floats() -> None:
    """The kernel is compiled with -ffast-math; linked with it, the library would set flush-to-zero
    for the whole process as it loads (hypothesis caught that: it refuses to draw floats in such
    a process)."""
    import subprocess
    import sys

    script = (
        "import sys; from engine.attention.cpu_kernel import load; assert load() is not None; "
        "import torch; tiny = sys.float_info.min / 4; "
        "assert tiny > 0 and (torch.tensor([1e-40]) * 1.0).item() > 0, 'subnormals flushed to zero'"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    if kernels is None:
        pytest.skip("no C compiler here to build the CPU kernel")
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_norm_and_silu_equal_torchs_composition(
    built: cpu_kernel.CpuKernels, dtype: torch.dtype
) -> None:
    """RMSNorm (with the residual add) and SiLU-and-multiply in one pass, rounded where TorchOps'
    ops round: equal to TorchOps' results but for last-place differences where the sum of squares
    or exp() rounds otherwise."""
    from engine.ops import TorchOps

    gen = torch.Generator().manual_seed(5)
    x, residual = (
        (torch.randn(37, 1024, generator=gen) * 3).to(dtype),
        torch.randn(37, 1024, generator=gen).to(dtype),
    )
    weight = (torch.rand(1024, generator=gen) + 0.5).to(dtype)
    gate_up = (torch.randn(37, 2 * 704, generator=gen) * 4).to(dtype)
    pairs = [
        (built.rms_norm(x, weight, 1e-5)[0], TorchOps.rms_norm(x, weight, 1e-5)),
        *zip(
            built.rms_norm(x, weight, 1e-6, residual),
            TorchOps.add_rms_norm(x, residual, weight, 1e-6),
        ),
        (built.silu_mul(gate_up), TorchOps.silu_and_mul(gate_up)),
    ]
    for ours, ref in pairs:
        assert ours.dtype == dtype and ours.shape == ref.shape
        if dtype == torch.float32:
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
        # a bfloat16 step apart at most (two where a step of silu's rounding meets the product's),
        # and rarely
        else:
            torch.testing.assert_close(ours.float(), ref.float(), rtol=2**-6, atol=1e-30)
            assert (ours == ref).float().mean() > 0.99


@needs_kernel
def test_the_cpu_ops_leave_what_the_elementwise_kernels_cannot_take_to_torch() -> None:
    """The CPU ops run the kernels, and send PyTorch's ops what they do not take: a view that is not
    contiguous, a RoPE input whose heads are not contiguous."""
    from engine.attention.cpu_linear import CpuOps
    from engine.ops import TorchOps

    gen = torch.Generator().manual_seed(5)
    x, weight = torch.randn(7, 256, generator=gen), torch.rand(256, generator=gen) + 0.5
    assert torch.equal(CpuOps.rms_norm(x, weight, 1e-5), kernels.rms_norm(x, weight, 1e-5)[0])
    strided = torch.randn(7, 512, generator=gen)[:, ::2]
    assert not strided.is_contiguous()
    assert torch.equal(CpuOps.silu_and_mul(strided), TorchOps.silu_and_mul(strided))
    q, k = torch.randn(5, 8, 64, generator=gen), torch.randn(5, 2, 64, generator=gen)
    freqs = (
        torch.arange(64, dtype=torch.float32)[:, None]
        * (10000.0 ** (-torch.arange(0, 64, 2) / 64))[None, :]
    )
    positions = torch.randint(0, 64, (5,), generator=gen)
    every_other = q[:, ::2]  # heads not contiguous: PyTorch's ops
    assert torch.equal(
        CpuOps.apply_rope(every_other, k, positions, freqs.cos(), freqs.sin())[0],
        TorchOps.apply_rope(every_other, k, positions, freqs.cos(), freqs.sin())[0],
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rope_kernel_equals_torchs_exactly(
    built: cpu_kernel.CpuKernels, dtype: torch.dtype
) -> None:
    """RoPE on q and k as views of one QKV output (strided tokens), rounded where TorchOps rounds:
    bit for bit its result, so that greedy ids cannot move."""
    from engine.ops import TorchOps

    gen = torch.Generator().manual_seed(11)
    tokens, heads, kv_heads, d = 45, 16, 4, 64
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen) * 2).to(dtype)
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.view(tokens, heads, d), k.view(tokens, kv_heads, d)
    freqs = (
        torch.arange(4096, dtype=torch.float32)[:, None]
        * (10000.0 ** (-torch.arange(0, d, 2) / d))[None, :]
    )
    cos, sin = freqs.cos(), freqs.sin()
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    ours = built.rope(q, positions, cos, sin), built.rope(k, positions, cos, sin)
    for a, b in zip(ours, TorchOps.apply_rope(q, k, positions, cos, sin)):
        assert a.dtype == dtype and a.is_contiguous() and torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_the_kv_store_in_one_call_equal_the_two_apart(
    built: cpu_kernel.CpuKernels, dtype: torch.dtype
) -> None:
    """rope_store_kv (a layer's RoPE and KV store in one call): q rotated as rope rotates it; k
    rotated and v as it is at each token's slot, bit for bit what rope and index_copy_ write; a
    slot of -1 (a padding token) and every slot not in the step keep what they held."""
    from engine.attention.torch_backend import store_kv
    from engine.ops import TorchOps

    gen = torch.Generator().manual_seed(12)
    tokens, heads, kv_heads, d, num_slots = 37, 9, 3, 64, 128
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen) * 2).to(dtype)
    q, k, v = (
        x.view(tokens, -1, d) for x in qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    )
    freqs = (
        torch.arange(4096, dtype=torch.float32)[:, None]
        * (10000.0 ** (-torch.arange(0, d, 2) / d))[None, :]
    )
    cos, sin = freqs.cos(), freqs.sin()
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    slots = torch.randperm(num_slots, generator=gen)[:tokens]
    slots[5] = -1
    caches = [torch.randn(num_slots, kv_heads, d, generator=gen).to(dtype) for _ in range(4)]
    k_cache, v_cache, k_expected, v_expected = (
        caches[0],
        caches[1],
        caches[0].clone(),
        caches[1].clone(),
    )
    q_rotated, k_rotated = TorchOps.apply_rope(q, k, positions, cos, sin)
    kept = slots >= 0
    store_kv(k_rotated[kept], v[kept], k_expected, v_expected, slots[kept])
    ours = built.rope_store_kv(q, k, v, k_cache, v_cache, slots, positions, cos, sin)
    assert ours.is_contiguous() and torch.equal(ours, q_rotated)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)


def test_the_amx_linear_equals_torchs_but_for_last_places(built: cpu_kernel.CpuKernels) -> None:
    """bfloat16 linears of 1-40 rows on AMX's tiles (cpu_amx.c), with and without bias, a last group
    of fewer than four column blocks, rows past one tile's 16: torch's result within a bfloat16
    rounding (float32 sums in another order), most of it bit for bit. Shapes the tiles do not
    take, and CPUs without AMX, are refused (None)."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(13)
    if (
        built.amx_pack(torch.ones(16, 32, dtype=torch.bfloat16)) is None
    ):  # only the AVX2 build, or no AMX here
        assert "amx_bf16" not in cpu_kernel.proc_flags() or "-avx2-" in Path(built.lib._name).name
        return
    for m in (1, 5, 16, 17, 32, 40):
        for n, k in ((16, 32), (48, 64), (320, 576), (576, 1536)):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            w = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16)
            bias = torch.randn(n, generator=gen).to(torch.bfloat16) if n % 3 else None
            ours, ref = built.amx_linear(x, built.amx_pack(w), n, bias), F.linear(x, w, bias)
            assert ours.shape == ref.shape and ours.dtype == torch.bfloat16
            torch.testing.assert_close(ours.float(), ref.float(), rtol=2**-7, atol=1e-2)
            assert (ours == ref).float().mean() >= 0.9, (m, n, k)
    assert (
        built.amx_pack(torch.ones(24, 32, dtype=torch.bfloat16)) is None
    )  # 24 outputs: not whole tiles
    assert built.amx_pack(torch.ones(16, 48, dtype=torch.bfloat16)) is None


def check_few_rows(kernels: cpu_kernel.CpuKernels) -> None:
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(3)
    for m in range(1, 9):
        for n, k in ((1, 64), (37, 1024), (200, 96)):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            w = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16)
            bias = torch.randn(n, generator=gen).to(torch.bfloat16) if n % 2 else None
            ours, ref = kernels.linear_few_rows(x, w, bias), F.linear(x, w, bias)
            assert ours.shape == ref.shape and ours.dtype == torch.bfloat16
            torch.testing.assert_close(ours.float(), ref.float(), rtol=2**-7, atol=1e-2)
            assert (ours == ref).float().mean() >= 0.9, (m, n, k)
    assert (
        kernels.linear_few_rows(
            torch.ones(1, 48, dtype=torch.bfloat16), torch.ones(4, 48, dtype=torch.bfloat16), None
        )
        is None
    )


def test_the_few_rows_linear_equals_torchs_to_its_last_place(built: cpu_kernel.CpuKernels) -> None:
    """cpu_gemv.c's bfloat16 linear at 1-8 rows (with and without a bias, N not a multiple of its
    row groups) gives torch's linear but for last-place differences (its sums run in another
    order), with AVX512-BF16's dot products or the weights widened to float32; a K that is not a
    multiple of 32 is refused (the caller falls back)."""
    check_few_rows(built)


def test_the_rows_linear_equals_float64_for_float32_and_bfloat16_weights(
    built: cpu_kernel.CpuKernels,
) -> None:
    """cpu_gemv.c's float32 linear of 1-32 rows (every remainder of its row groups; N not a multiple
    of its weight tiles nor of its blocks; with and without a bias) equals the float64 product of
    the same numbers to float32's accuracy, its weights float32 or bfloat16 widened in registers;
    a K its vectors do not divide, or 33 rows, is refused (the caller falls back)."""
    gen = torch.Generator().manual_seed(5)
    for m in (1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 31, 32):
        for n, k in ((1, 64), (37, 1024), (131, 96), (600, 160)):
            x = torch.randn(m, k, generator=gen)
            w = torch.randn(n, k, generator=gen) / k**0.5
            bias = torch.randn(n, generator=gen) if n % 2 else None
            for weight in (w, w.to(torch.bfloat16)):
                ours = built.linear_rows(x, weight, bias)
                ref = x.double() @ weight.double().T + (0 if bias is None else bias.double())
                assert ours.shape == (m, n) and ours.dtype == torch.float32
                torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5)
    assert built.linear_rows(torch.ones(1, 44), torch.ones(4, 44), None) is None
    assert built.linear_rows(torch.ones(33, 64), torch.ones(4, 64), None) is None


@needs_kernel
def test_the_cpu_ops_linear_takes_the_kernel_for_few_rows_and_onednn_for_more() -> None:
    """With native bfloat16, 1-2 rows in the kernel and oneDNN's bfloat16 GEMM from 3 (on AMX, of a
    weight that is whole tiles, up to AMX_ROWS rows in the AMX kernel, oneDNN's GEMM from there);
    without AVX-512 (simulated: PPD_CPU_ISA=avx2) up to 8 rows in the few-rows kernel, 9-32 in the
    float32 rows kernel (the weight widened) and from 33 oneDNN's float32 GEMM on a float32 copy of
    the weight, rounded to bfloat16 once: torch's result but for last-place differences; a float32
    model's linears of up to 32 rows in the rows kernel, oneDNN's from 33."""
    import torch.nn.functional as F

    from engine.attention import cpu_linear
    from engine.cpu_isa import has_native_bf16

    gen = torch.Generator().manual_seed(4)
    w, bias = (
        (torch.randn(300, 512, generator=gen) / 20).to(torch.bfloat16),
        torch.randn(300).to(torch.bfloat16),
    )
    if has_native_bf16() and cpu_linear.packed_dtype(torch.bfloat16) == torch.bfloat16:
        for m in (1, 2, 3):  # 300 outputs: not a whole number of AMX tiles
            x = torch.randn(m, 512, generator=gen).to(torch.bfloat16)
            via_kernel = kernels.linear_few_rows(x, w, None)
            assert torch.equal(
                cpu_linear.CpuOps.linear(x, w),
                via_kernel
                if m <= cpu_linear.FEW_ROWS
                else torch.ops.mkldnn._linear_pointwise(
                    x, cpu_linear.packed(w), None, "none", [], ""
                ),
            )
        if (
            cpu_linear.amx_rows()
        ):  # 320 outputs: up to AMX_ROWS rows on AMX's tiles, oneDNN from there
            w320 = (torch.randn(320, 512, generator=gen) / 20).to(torch.bfloat16)
            bias320 = torch.randn(320).to(torch.bfloat16)
            for m in (1, 8, cpu_linear.AMX_ROWS, cpu_linear.AMX_ROWS + 1):
                x = torch.randn(m, 512, generator=gen).to(torch.bfloat16)
                ours = cpu_linear.CpuOps.linear(x, w320, bias320)
                assert torch.equal(
                    ours,
                    kernels.amx_linear(x, cpu_linear.amx_packed(w320), 320, bias320)
                    if m <= cpu_linear.AMX_ROWS
                    else torch.ops.mkldnn._linear_pointwise(
                        x, cpu_linear.packed(w320), bias320, "none", [], ""
                    ),
                )
                torch.testing.assert_close(
                    ours.float(), F.linear(x, w320, bias320).float(), rtol=2**-7, atol=1e-2
                )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PPD_CPU_ISA", "avx2")
        cpu_linear.forget_cpu_decisions()
        try:
            wide = w.clone()  # packed afresh, in float32
            for m in (1, 8, 9, 32, 40):
                x = torch.randn(m, 512, generator=gen).to(torch.bfloat16)
                ours = cpu_linear.CpuOps.linear(x, wide, bias)
                if m <= cpu_linear.FEW_ROWS_WIDENED:
                    assert torch.equal(ours, kernels.linear_few_rows(x, wide, bias))
                elif m <= cpu_linear.ROWS_F32:
                    assert torch.equal(
                        ours, kernels.linear_rows(x.float(), wide, bias.float()).to(torch.bfloat16)
                    )
                else:
                    assert cpu_linear.packed(wide).dtype == torch.float32
                    in_float32 = F.linear(x.float(), wide.float(), bias.float()).to(torch.bfloat16)
                    assert (
                        ours == in_float32
                    ).float().mean() > 0.98  # else a rounding apart (sums' order)
                torch.testing.assert_close(
                    ours.float(), F.linear(x, w, bias).float(), rtol=2**-7, atol=1e-2
                )
            w32, bias32 = (
                w.float(),
                bias.float(),
            )  # a float32 model: the float32 kernel up to ROWS_F32 rows
            for m in (1, 32, 33):
                x = torch.randn(m, 512, generator=gen)
                ours = cpu_linear.CpuOps.linear(x, w32, bias32)
                if m <= cpu_linear.ROWS_F32:
                    assert torch.equal(ours, kernels.linear_rows(x, w32, bias32))
                else:
                    assert torch.equal(
                        ours,
                        torch.ops.mkldnn._linear_pointwise(
                            x, cpu_linear.packed(w32), bias32, "none", [], ""
                        ),
                    )
                torch.testing.assert_close(ours, F.linear(x, w32, bias32), rtol=1e-5, atol=1e-5)
        finally:
            patch.undo()
            cpu_linear.forget_cpu_decisions()


@needs_kernel
def test_the_cpu_ops_linear_leaves_what_the_kernel_cannot_take_to_torch() -> None:
    """A weight whose inner size is not x's is torch's error, not a read past the weight; a strided
    weight or a bias of another shape goes to torch's linear too."""
    import torch.nn.functional as F

    from engine.attention.cpu_linear import CpuOps

    x = torch.ones(1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):
        CpuOps.linear(x, torch.ones(8, 32, dtype=torch.bfloat16))
    strided = torch.ones(64, 16, dtype=torch.bfloat16).t()
    assert torch.equal(CpuOps.linear(x, strided), F.linear(x, strided))
    with pytest.raises(RuntimeError):
        CpuOps.linear(
            x, torch.ones(8, 64, dtype=torch.bfloat16), torch.ones(4, dtype=torch.bfloat16)
        )
