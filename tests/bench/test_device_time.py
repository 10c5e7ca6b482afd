"""bench/device_time: a profiled step's device work counted once per kernel, grouped, and its GEMMs
by shape, on made-up profiler events (the GPU's run is gpu_check's engine-host step)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.autograd.profiler_util import Kernel

from bench.device_time import (
    GROUPS,
    device_time,
    gemm_shape,
    gemm_table,
    group_of,
    markdown,
    step_work,
    union_us,
)

CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


@dataclass
class Range:
    start: float
    end: float

    def elapsed_us(self) -> float:
        return self.end - self.start


@dataclass
class Event:
    """The parts of a profiler FunctionEvent that bench/device_time reads."""

    name: str
    start: float
    end: float
    device_type: Any = CUDA
    activity_type: str | None = "kernel"
    is_user_annotation: bool = False
    device_index: int = 0
    device_resource_id: int = 7  # the stream
    cpu_children: list[Event] = field(default_factory=list)
    kernels: list[Kernel] = field(default_factory=list)
    input_shapes: list = field(default_factory=list)

    @property
    def time_range(self) -> Range:
        return Range(self.start, self.end)


def op(
    name: str,
    start: float,
    end: float,
    children: list[Event] = (),
    kernels: list[Kernel] = (),
    shapes: list = (),
) -> Event:
    return Event(
        name,
        start,
        end,
        CPU,
        "cpu_op",
        cpu_children=list(children),
        kernels=list(kernels),
        input_shapes=list(shapes),
    )


def test_each_kernel_counts_once_and_not_the_ranges_around_it_nor_what_ran_before_the_step() -> (
    None
):
    step = op("ppd::step", 100, 400)
    gemm = Event("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", 120, 170)
    norm = Event("_rms_norm_kernel", 170, 180)
    events = [
        Event("_attention_kernel", 50, 90),  # the warm-up's, before the step's range
        step,
        Event(
            "ppd::step", 120, 260, activity_type="gpu_user_annotation", is_user_annotation=True
        ),  # spans all
        Event(
            "triton::_rms_norm_kernel",
            170,
            180,
            activity_type="gpu_user_annotation",
            is_user_annotation=True,
        ),
        Event("Memcpy HtoD (Pinned -> Device)", 110, 112, activity_type="gpu_memcpy"),
        gemm,
        gemm,  # listed twice
        norm,
        Event("_attention_kernel", 200, 260),
        Event(
            "_merge_splits_kernel", 230, 250, device_resource_id=9
        ),  # on another stream, overlapping attention
    ]
    work, dropped = step_work(events, step.time_range.start)
    assert [e.name for e in work] == [
        "Memcpy HtoD (Pinned -> Device)",
        gemm.name,
        norm.name,
        "_attention_kernel",
        "_merge_splits_kernel",
    ]
    assert dropped == {"before the step": 1, "annotations": 2, "duplicates": 1}
    found = device_time(events, step)
    assert (found.kernels, found.copies) == (4, 1)
    assert found.sum_ms == pytest.approx((2 + 50 + 10 + 60 + 20) / 1000)
    assert found.busy_ms == pytest.approx(
        (2 + 50 + 10 + 60) / 1000
    )  # the merge ran inside attention's interval
    assert found.span_ms == pytest.approx((260 - 110) / 1000)
    # The old total: every CUDA event of the profile, the ranges' copies and the warm-up's kernel
    # included.
    assert found.all_events_ms == pytest.approx((40 + 140 + 10 + 2 + 50 + 50 + 10 + 60 + 20) / 1000)
    assert {g: v["count"] for g, v in found.groups.items() if v["count"]} == {
        "gemm": 1,
        "norm": 1,
        "attention": 1,
        "merge": 1,
        "other": 1,
    }
    assert found.groups["gemm"]["ms"] == pytest.approx(0.05) and list(found.groups) == list(GROUPS)
    assert found.by_kernel[gemm.name] == {"group": "gemm", "count": 1, "ms": pytest.approx(0.05)}


def test_without_activity_types_annotations_are_known_by_their_flag_and_the_range_names() -> None:
    step = op("ppd::step", 0, 100)
    events = [
        step,
        Event("ppd::step", 10, 90, activity_type=None, is_user_annotation=True),
        Event(
            "triton::_silu_and_mul_kernel", 10, 20, activity_type=None
        ),  # no flag: known by its name
        Event("_silu_and_mul_kernel", 10, 20, activity_type=None),
        Event("Memset (Device)", 20, 21, activity_type=None),
    ]
    found = device_time(events, step, ranges=("ppd::step", "triton::"))
    assert (found.kernels, found.copies) == (1, 1) and found.dropped == {"annotations": 2}
    assert found.groups["silu"]["count"] == 1 and found.groups["other"]["count"] == 1


@pytest.mark.parametrize(
    "name, group",
    [
        ("_attention_kernel", "attention"),
        ("_mixed_attention_kernel", "attention"),
        ("_merge_splits_kernel", "merge"),
        ("_rms_norm_kernel", "norm"),
        ("_rope_store_kv_kernel", "rope-store"),
        ("_rope_kernel", "rope-store"),
        ("_store_kv_kernel", "rope-store"),
        ("_silu_and_mul_kernel", "silu"),
        ("nvjet_tst_128x64_64x8_1x1_v_bz_coopA_NNT", "gemm"),
        (
            "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off",
            "gemm",
        ),
        (
            "void "
            "cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>",
            "gemm",
        ),
        ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "gemm"),
        ("void gemv2T_kernel_val<int, int, __nv_bfloat16, 128, 16, 4, 4, false>", "gemm"),
        (
            "void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, "
            "unsigned int>",
            "other",
        ),
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>",
            "other",
        ),
    ],
)
def test_kernels_are_grouped_by_the_words_of_their_names(name: str, group: str) -> None:
    assert group_of(name) == group


def test_union_of_intervals() -> None:
    assert union_us([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25
    assert union_us([]) == 0


def test_gemms_are_tabled_by_weight_and_shape_with_the_kernels_linked_to_them() -> None:
    def linear(start: float, m: int, n: int, k: int, us: float) -> Event:
        mm = op(
            "aten::mm",
            start + 1,
            start + 8,
            kernels=[Kernel("nvjet_tst_64x8", 0, us)],
            shapes=[[m, k], [k, n]],
        )
        return op(
            "aten::linear",
            start,
            start + 10,
            [
                op("aten::t", start, start + 1),
                op("aten::matmul", start + 1, start + 9, [mm], shapes=[[m, k], [k, n]]),
            ],
            shapes=[[m, k], [n, k], []],
        )

    split_k = op(
        "aten::mm",
        41,
        48,
        kernels=[Kernel("sm90_xmma_gemm", 0, 30.0), Kernel("splitKreduce", 0, 2.0)],
        shapes=[[32, 14336], [14336, 4096]],
    )
    layer = op(
        "layer",
        0,
        100,
        [
            linear(0, 32, 6144, 4096, 20.0),
            linear(20, 32, 6144, 4096, 22.0),
            op("aten::linear", 40, 50, [split_k], shapes=[[32, 14336], [4096, 14336], []]),
            op("aten::bmm", 60, 70, kernels=[Kernel("gemm", 0, 5.0)]),
        ],
    )
    step = op("ppd::step", 0, 100, [layer])
    table = gemm_table(step, {(6144, 4096): "qkv", (4096, 14336): "down"})
    assert table == [
        {
            "weight": "qkv",
            "m": 32,
            "n": 6144,
            "k": 4096,
            "count": 2,
            "ms": pytest.approx(0.042),
            "kernel": "nvjet_tst_64x8",
        },
        {
            "weight": "down",
            "m": 32,
            "n": 4096,
            "k": 14336,
            "count": 1,
            "ms": pytest.approx(0.032),
            "kernel": "sm90_xmma_gemm",
        },
        {
            "weight": "",
            "m": 0,
            "n": 0,
            "k": 0,
            "count": 1,
            "ms": pytest.approx(0.005),
            "kernel": "gemm",
        },
    ]
    assert gemm_shape(op("aten::addmm", 0, 1, shapes=[[6144], [8, 4096], [4096, 6144]])) == (
        8,
        6144,
        4096,
    )
    assert gemm_shape(op("aten::linear", 0, 1, shapes=[[2, 4, 64], [32, 64], []])) == (8, 32, 64)


def test_the_gemm_table_says_when_no_kernel_was_linked_to_its_op() -> None:
    step = op("ppd::step", 0, 100, [op("aten::mm", 10, 20, shapes=[[4, 8], [8, 16]])])
    found = device_time([step, Event("nvjet_tst", 15, 30)], step, weights={})
    assert found.gemm_shapes[0]["ms"] == 0 and "linked no GEMM kernel" in found.note


def test_the_markdown_shows_each_step_and_says_why_a_step_has_none() -> None:
    step = op(
        "ppd::step",
        0,
        100,
        [
            op(
                "aten::linear",
                1,
                2,
                [
                    op(
                        "aten::mm",
                        1,
                        2,
                        kernels=[Kernel("nvjet_tst", 0, 50.0)],
                        shapes=[[32, 4096], [4096, 6144]],
                    )
                ],
                shapes=[[32, 4096], [6144, 4096], []],
            )
        ],
    )
    from dataclasses import asdict

    found = asdict(
        device_time(
            [step, Event("nvjet_tst", 10, 60), Event("_rms_norm_kernel", 60, 70)],
            step,
            weights={(6144, 4096): "qkv"},
        )
    )
    text = "\n".join(
        markdown(
            [
                ("eager decode", found, ""),
                ("graph decode", None, "graph nodes not visible to the profiler"),
            ],
            itemsize=2,
        )
    )
    assert "| gemm | 0.050 (83%), 1 |  |" in text and "| norm | 0.010 (17%), 1 |  |" in text
    assert "| **kernels + copies, summed** | **0.060**, 2 + 0 |  |" in text
    assert "|  | graph nodes not visible to the profiler |" in text
    # 2 x 32 x 6144 x 4096 FLOPs in 50 us: 32.2 TFLOP/s; 6144 x 4096 x 2 bytes in 50 us: 1007 GB/s.
    assert (
        "| eager decode | qkv | 32 x 6144 x 4096 | 1 | 0.050 | 50.0 | 32.2 | 1007 | `nvjet_tst` |"
        in text
    )
