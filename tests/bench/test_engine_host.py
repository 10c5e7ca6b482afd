"""bench/engine_host: an eager step's host time split by kind of op, on the CPU (the GPU's run is
gpu_check's engine-host step)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from bench.engine_host import (
    KINDS,
    STEP,
    TRITON,
    TRITON_JIT,
    main,
    split_host_time,
    step_inputs,
    triton_ranges,
    weight_names,
)
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
    linear = Event(
        "aten::linear", 10, 20, [Event("aten::t", 10, 11), Event("aten::matmul", 11, 18, [mm])]
    )
    launch = Event(TRITON_JIT + "_rope_kernel", 25, 30, [Event("cuLaunchKernel", 28, 29)])
    index = Event(
        "aten::index", 40, 46, [Event("aten::empty", 41, 42), Event("aten::copy_", 42, 45)]
    )
    step = Event(STEP, 0, 60, [linear, launch, Event("aten::empty", 50, 51), index])
    split = split_host_time(
        [Event(STEP, 0, 1), step, *step.cpu_children]
    )  # the last STEP range counts
    assert split.host_us == 60
    assert split.by_kind == {
        "gemm": 10,
        "triton": 5,
        "alloc": 2,
        "copy": 3,
        "other ops": 2,
        "outside ops": 38,
    }
    assert sum(split.by_kind.values()) == split.host_us and set(split.by_kind) == set(KINDS)
    assert split.triton_us == {"_rope_kernel": 5} and split.triton_launches == {"_rope_kernel": 1}
    assert split.other_us == {"aten::index": 2}
    # linear -> matmul -> mm is one GEMM; the allocation inside mm and the one inside index are
    # allocations
    assert split.counts["gemm"] == 1 and split.counts["alloc"] == 3 and split.counts["copy"] == 1
    assert split.counts["triton"] == 1 and split.counts["triton relaunched"] == 0


def test_a_launch_through_launches_counts_once_and_as_relaunched_when_it_skipped_the_jit() -> None:
    jit = Event(
        TRITON + "_rms_norm_kernel",
        10,
        20,
        [Event(TRITON_JIT + "_rms_norm_kernel", 11, 19, [Event("cuLaunchKernelEx", 15, 16)])],
    )  # layer 0: through the JIT
    relaunch = Event(
        TRITON + "_rms_norm_kernel", 30, 32, [Event("cuLaunchKernelEx", 30.5, 31.5)]
    )  # later layers
    step = Event(
        STEP, 0, 40, [jit, relaunch, Event("cuLaunchKernelEx", 35, 36)]
    )  # the last: outside any range
    split = split_host_time([step, *step.cpu_children])
    assert split.counts["triton"] == 2 and split.counts["triton relaunched"] == 1
    assert split.triton_launches == {"_rms_norm_kernel": 2} and split.triton_us == {
        "_rms_norm_kernel": 12
    }
    assert split.by_kind["triton"] == 12 and split.other_us == {"cuLaunchKernelEx": 1}


def test_device_launches_are_counted_by_time_inside_the_step() -> None:
    step = Event(STEP, 0, 60, [Event(TRITON + "k", 10, 20)])
    launches = [
        Event("cuLaunchKernel", 12, 13),
        Event("cudaLaunchKernel", 30, 31),
        Event("cudaLaunchKernel", 70, 71),
    ]
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
    assert TRITON_JIT + "_double_kernel" in [e.name for e in prof.events()]


def test_a_steps_relaunches_through_launches_are_counted_and_timed_under_the_profiler() -> None:
    """engine/kernels/launch.py relaunches a compiled kernel without the JIT after a step's first
    layer: a launch that the JIT's range never sees. On the CPU Triton only interprets (nothing is
    compiled to relaunch), so the step's Launches holds a stand-in compiled kernel for the second
    launch."""
    import triton
    import triton.language as tl
    from torch.profiler import profile, record_function

    from engine.kernels.launch import Consts, Launches

    @triton.jit
    def _triple_kernel(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 3, mask=mask)

    class Compiled:
        function = packed_metadata = None

        def __init__(self) -> None:
            self.calls = 0

        def run(self, *args) -> None:
            self.calls += 1

    x, consts, compiled = torch.ones(8), Consts(BLOCK=8), Compiled()
    launches = Launches()
    launches.compiled[(id(_triple_kernel), (1,), (8,), consts)] = compiled
    launches.stream = 0  # the step's stream, as its first relaunch reads it on a GPU
    call = Launches.__dict__["__call__"]
    with triton_ranges(), profile() as prof:
        with record_function(STEP):
            launches(
                _triple_kernel, (1,), (x,), (4,), consts
            )  # not compiled for these scalars: through the JIT
            launches(_triple_kernel, (1,), (x,), (8,), consts)  # relaunched
    assert Launches.__dict__["__call__"] is call, "Launches is put back"
    assert compiled.calls == 1 and torch.equal(x, torch.tensor([3.0] * 4 + [1.0] * 4))
    split = split_host_time(prof.events())
    assert split.counts["triton"] == 2 and split.counts["triton relaunched"] == 1
    assert split.triton_launches == {"_triple_kernel": 2}


def test_the_steps_inputs_and_the_names_of_the_weights_by_shape() -> None:
    from engine.config import ModelConfig
    from engine.step_timing import Blocks

    mixed = step_inputs(
        "mixed", {"decodes": 3, "context": 20, "new": 5, "cached": 40}, Blocks(100, 16)
    )
    assert [(len(i.token_ids), i.start_pos) for i in mixed] == [(1, 20)] * 3 + [(5, 40)]
    tables = [b for i in mixed for b in i.block_table]
    assert len(tables) == len(set(tables)) == 3 * 2 + 3  # each sequence on blocks of its own
    assert [
        len(i.token_ids) for i in step_inputs("append", {"new": 5, "cached": 40}, Blocks(100, 16))
    ] == [5]
    llama = weight_names(
        ModelConfig.from_folder(str(Path(__file__).parents[2] / "bench/models/llama-3.1-8b"))
    )
    assert llama == {
        (6144, 4096): "qkv",
        (4096, 4096): "q/o",
        (1024, 4096): "k/v",
        (28672, 4096): "gate_up",
        (14336, 4096): "gate/up",
        (4096, 14336): "down",
        (128256, 4096): "lm_head",
    }


def test_cpu_run_writes_both_steps_split_by_kind(tmp_path: Path) -> None:
    main(["--quick", "--model", STANDIN, "--device", "cpu", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "engine-host.json").read_text())
    assert (
        report["device_type"] == "cpu"
        and report["attention_backend"] == "cpu"
        and report["profiled"] == ["CPU"]
    )
    assert [s["step"] for s in report["steps"]] == ["decode", "append", "mixed"]
    assert [(r["step"], r["skipped"]) for r in report["replays"]] == [
        (step, "no CUDA graphs on this device/backend") for step in ("decode", "append", "mixed")
    ]
    for s in report["steps"]:
        assert s["host_ms"] > 0 and s["plain_host_ms"] > 0 and s["plain_ms"] >= s["plain_host_ms"]
        assert sum(s["by_kind_ms"].values()) == pytest.approx(s["host_ms"])
        assert s["per_layer_ms"] == pytest.approx(s["host_ms"] / report["layers"])
        # Both steps' linears (4 and 16 rows) run in our kernels (ctypes calls: "outside ops") where
        # those take 16 rows or more (AMX's tiles on a CPU with AMX-BF16, the rows kernel without
        # AVX-512), else in torch's GEMMs.
        in_ours = small_rows() >= 16
        assert (
            (s["counts"]["gemm"] == 0) == in_ours and s["device_ms"] is None and s["device"] is None
        )
    md = (tmp_path / "engine-host.md").read_text()
    assert (
        "| outside ops |" in md
        and "decode (batch 4, context 64)" in md
        and "**total, plain** (median)" in md
    )
    assert "mixed (decodes 4, context 64, new 16, cached 128)" in md
    assert "No CUDA activity on this device: no device table, no graph replays." in md


def test_a_gpu_reports_markdown_has_each_steps_device_table_and_says_why_a_replay_has_none() -> (
    None
):
    """The report's CUDA half, from made-up device tables (the GPU's run is gpu_check's engine-host
    step)."""
    from dataclasses import asdict

    from bench.device_time import device_time
    from bench.engine_host import NO_GRAPH_NODES, markdown

    step = Event(STEP, 0, 100)
    kernels = [
        Event("nvjet_tst_64x8", 10, 60, device_type=torch.autograd.DeviceType.CUDA),
        Event("_attention_kernel", 60, 70, device_type=torch.autograd.DeviceType.CUDA),
    ]
    device = asdict(device_time([step, *kernels], step, weights={}, ranges=(STEP,)))
    host = {
        "host_ms": 2.0,
        "per_layer_ms": 1.0,
        "by_kind_ms": {k: 2.0 / len(KINDS) for k in KINDS},
        "triton_ms": {"_attention_kernel": 0.1},
        "counts": {"triton": 2, "triton relaunched": 1},
        "device_ms": device["sum_ms"],
        "plain_host_ms": 1.5,
        "plain_ms": 1.8,
        "triton_launches": {"_attention_kernel": 2},
        "other_ms": {},
        "device": device,
    }
    report = {
        "model": "llama-3.1-8b",
        "device": "NVIDIA H200",
        "device_type": "cuda",
        "attention_backend": "triton",
        "layers": 2,
        "dtype": "bfloat16",
        "profiled": ["CPU", "CUDA"],
        "meta": {"graph_capture_s": 0.9},
        "steps": [
            {"step": name, "shape": {"batch": 1}, **host} for name in ("decode", "append", "mixed")
        ],
        "replays": [
            {
                "step": "decode",
                "shape": {},
                "graph": "decode batch 32",
                "plain_ms": 6.7,
                "plain_host_ms": 0.2,
                "device": device,
            },
            {
                "step": "append",
                "shape": {},
                "graph": "256 tokens, 65 sequences",
                "plain_ms": 11.8,
                "plain_host_ms": 0.5,
                "device": None,
                "why": NO_GRAPH_NODES,
            },
            {"step": "mixed", "shape": {}, "skipped": "no captured graph fits this step"},
        ],
    }
    md = markdown(report)
    assert "| device (kernels + copies, each once) | 0.060 | 0.060 | 0.060 |" in md
    assert (
        "| of them relaunched (Launches) | 1 | 1 | 1 |" in md
        and "| `_attention_kernel` | 2, 0.100 |" in md
    )
    assert (
        "| device ms (share), count | eager decode | eager append | eager mixed | graph decode | "
        "graph append "
        "| graph mixed |"
    ) in md
    assert (
        "| gemm | 0.050 (83%), 1 | 0.050 (83%), 1 | 0.050 (83%), 1 | 0.050 (83%), 1 |  |  |" in md
    )
    assert (
        f"| why none / note |  |  |  |  | {NO_GRAPH_NODES} | no captured graph fits this step |"
        in md
    )
    assert (
        "| decode | decode batch 32 | 6.700 | 0.200 |" in md
        and "captured after the eager steps in 0.9 s" in md
    )
