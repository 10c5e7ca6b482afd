"""`python -m bench.kernels`'s cases listed without a GPU (their tensors on the meta device):
nothing is timed."""

from __future__ import annotations

import pytest
import torch

from bench import kernels
from bench.kernels import HKV, D, H, Split, all_cases, label, main
from engine.attention.triton_backend import MIXED_LAUNCH


@pytest.fixture(scope="module")
def cases() -> dict[str, kernels.Case]:
    listed = list(all_cases(quick=False, device="meta"))
    by_shape = {f"{c.kernel} {c.shape}": c for c in listed}
    assert len(by_shape) == len(listed), "each case is one kernel at one shape"
    return by_shape


def test_appends_sweep_tiles_of_4_and_8_warps_by_kv_splits(cases: dict[str, kernels.Case]) -> None:
    appends = {name: c for name, c in cases.items() if name.startswith("attention append")}
    # The engine splits a 256-token append's 16 query tiles x 8 KV heads in two (toward two programs
    # per SM).
    assert set(appends) == {
        "attention append over 4096 n=256 splits=2",
        "attention append over 16384 n=256 splits=2",
    }
    for case in appends.values():
        assert all(isinstance(c, Split) for c in case.configs)
        assert {c.splits for c in case.configs} == {1, 2, 4}
        assert {c.tile.num_warps for c in case.configs} == {4, 8}
        assert {c.tile.block_m for c in case.configs} == {32, 64, 128}
        assert len({label(c) for c in case.configs}) == len(case.configs), (
            "labels tell the configs apart"
        )
    case = appends["attention append over 4096 n=256 splits=2"]
    assert case.flops == 4 * H * D * (256 * 4096 + 256 * 257 // 2), (
        "each (query, key) pair under the mask once"
    )
    assert case.nbytes == (4096 + 256) * HKV * D * 2 * 2 + 2 * 256 * H * D * 2


def test_the_mixed_step_sweeps_both_launches_by_the_appends_splits(
    cases: dict[str, kernels.Case],
) -> None:
    ((name, case),) = ((n, c) for n, c in cases.items() if n.startswith("attention mixed"))
    assert name.endswith(f"(decode splits=1, splits=2 {MIXED_LAUNCH})")
    swept = {(c.mixed, c.splits) for c in case.configs} | {
        (MIXED_LAUNCH, 2)
    }  # the default, timed apart
    assert swept == {(m, s) for m in ("sequential", "fused") for s in (1, 2, 4)}
    assert case.flops == 4 * H * D * 64 * 1024 + 4 * H * D * (256 * 4096 + 256 * 257 // 2)
    assert (
        label(Split(None, 2, "fused")) == "default tile splits=2 fused" and label(None) == "default"
    )


def test_the_moe_layer_is_timed_from_one_token_to_4096_over_tiles(
    cases: dict[str, kernels.Case],
) -> None:
    """Qwen3-30B-A3B's layer: at t tokens at most 8 t of the 128 experts are read (listed without a
    GPU: no routing to count), and every token multiplies by 8 experts of 3 x 2048 x 768."""
    moe = {name: c for name, c in cases.items() if name.startswith("moe ")}
    assert len(moe) == len(kernels.MOE_TOKENS)
    one = moe["moe t=1 (8 experts read)"]
    assert one.nbytes == 8 * 3 * 2048 * 768 * 2 + 2 * 2048 * 2
    assert one.flops == 2 * 8 * 3 * 2048 * 768
    assert "moe t=4096 (128 experts read)" in moe
    assert {c.block_m for c in one.configs} == {16, 32, 64, 128}


def test_quick_lists_the_defaults_only_and_without_cuda_nothing_runs(
    capsys: pytest.CaptureFixture,
) -> None:
    assert all(not c.configs for c in all_cases(quick=True, device="meta"))
    if not torch.cuda.is_available():
        assert main([]) == 0 and "none is visible" in capsys.readouterr().out
