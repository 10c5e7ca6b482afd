"""bench/engine_host: an eager step's host time split by kind of op, on the CPU (the GPU's run is gpu_check's
engine-host step)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from bench.engine_host import KINDS, STEP, TRITON, main, split_host_time, triton_ranges
from engine.attention.cpu_linear import small_rows

STANDIN = str(Path(__file__).parents[2] / "bench" / "models" / "llama-3.1-8b-standin")


@dataclass
class Range:
    start: float
    end: float

    def elapsed_us(self) -> float:
        return self.end - self.start


@dataclass
class Event:
    """The parts of a profiler FunctionEvent that split_host_time reads."""

    name: str
    start: float
    end: float
    cpu_children: list[Event] = field(default_factory=list)
    device_type: torch.autograd.DeviceType = torch.autograd.DeviceType.CPU

    @property
    def time_range(self) -> Range:
        return Range(self.start, self.end)


def test_each_ops_time_goes_to_its_outermost_kind_and_the_rest_is_outside_ops() -> None:
    mm_alloc = Event("aten::empty", 12, 13)
    mm = Event("aten::mm", 11, 17, [mm_alloc, Event("cudaLaunchKernel", 14, 16)])
    linear = Event("aten::linear", 10, 20, [Event("aten::t", 10, 11), Event("aten::matmul", 11, 18, [mm])])
    launch = Event(TRITON + "_rope_kernel", 25, 30, [Event("cuLaunchKernel", 28, 29)])
    index = Event("aten::index", 40, 46, [Event("aten::empty", 41, 42), Event("aten::copy_", 42, 45)])
    step = Event(STEP, 0, 60, [linear, launch, Event("aten::empty", 50, 51), index])
    split = split_host_time([Event(STEP, 0, 1), step, *step.cpu_children])  # the last STEP range counts
    assert split.host_us == 60
    assert split.by_kind == {"gemm": 10, "triton": 5, "alloc": 2, "copy": 3, "other ops": 2, "outside ops": 38}
    assert sum(split.by_kind.values()) == split.host_us and set(split.by_kind) == set(KINDS)
    assert split.triton_us == {"_rope_kernel": 5} and split.triton_launches == {"_rope_kernel": 1}
    assert split.other_us == {"aten::index": 2}
    # linear -> matmul -> mm is one GEMM; the allocation inside mm and the one inside index are allocations
    assert split.counts["gemm"] == 1 and split.counts["alloc"] == 3 and split.counts["copy"] == 1
    assert split.counts["triton"] == 1


def test_device_launches_are_counted_by_time_inside_the_step() -> None:
    step = Event(STEP, 0, 60, [Event(TRITON + "k", 10, 20)])
    launches = [Event("cuLaunchKernel", 12, 13), Event("cudaLaunchKernel", 30, 31), Event("cudaLaunchKernel", 70, 71)]
    assert split_host_time([step, *launches]).counts["device launches"] == 2


def test_a_profile_without_the_step_range_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="no ppd::step range"):
        split_host_time([Event("aten::mm", 0, 1)])


def test_triton_launches_run_inside_a_range_named_for_their_kernel() -> None:
    import triton
    import triton.language as tl
    from torch.profiler import profile

    @triton.jit
    def _double_kernel(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 2, mask=mask)

    x = torch.ones(8)
    kind = type(_double_kernel)
    run = kind.__dict__["run"]
    with triton_ranges(), profile() as prof:
        _double_kernel[(1,)](x, 8, BLOCK=8)
    assert kind.__dict__["run"] is run, "the launcher is put back"
    assert torch.equal(x, torch.full((8,), 2.0))
    assert TRITON + "_double_kernel" in [e.name for e in prof.events()]


def test_cpu_run_writes_both_steps_split_by_kind(tmp_path: Path) -> None:
    main(["--quick", "--model", STANDIN, "--device", "cpu", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "engine-host.json").read_text())
    assert report["device_type"] == "cpu" and report["attention_backend"] == "cpu" and report["profiled"] == ["CPU"]
    assert [s["step"] for s in report["steps"]] == ["decode", "append"]
    for s in report["steps"]:
        assert s["host_ms"] > 0 and s["plain_host_ms"] > 0 and s["plain_ms"] >= s["plain_host_ms"]
        assert sum(s["by_kind_ms"].values()) == pytest.approx(s["host_ms"])
        assert s["per_layer_ms"] == pytest.approx(s["host_ms"] / report["layers"])
        # Both steps' linears (4 and 16 rows) run in our kernels (ctypes calls: "outside ops") where those take 16 rows
        # or more (AMX's tiles on a CPU with AMX-BF16, the rows kernel without AVX-512), else in torch's GEMMs.
        in_ours = small_rows() >= 16
        assert (s["counts"]["gemm"] == 0) == in_ours and s["device_ms"] is None
    md = (tmp_path / "engine-host.md").read_text()
    assert "| outside ops |" in md and "decode (batch 4, context 64)" in md and "**total, plain** (median)" in md
