"""How the KV pool is sized: from the operator's request on the CPU, from measured memory on a
GPU."""

from __future__ import annotations

import pytest

from engine.memory_plan import (
    GiB,
    MemoryMeasurement,
    StartupError,
    check_free_at_start,
    plan_from_measurement,
    plan_from_request,
)

BLOCK = 2 * 2**20  # bytes per block (Llama-3.1-8B bf16: 16 tokens x 128 KiB)


def measured(**changes: int) -> MemoryMeasurement:
    values = dict(
        total=80 * GiB,
        in_use=17 * GiB,
        weights=15 * GiB,
        activation_peak=2 * GiB,
        graph_peak=GiB // 2,
        peer_activation_peak=2 * GiB,
    )
    values.update(changes)
    return MemoryMeasurement(**values)


def test_gpu_pool_gets_what_everything_else_leaves() -> None:
    plan = plan_from_measurement(measured(), 0.9, BLOCK, 16, 131072, None, "H100")
    left = int(80 * GiB * 0.9) - (17 + 2 + 2) * GiB - GiB // 2
    assert plan.num_blocks == left // BLOCK
    assert plan.max_model_len == min(131072, plan.num_blocks * 16)
    for figure in (
        "72.00 GiB allowed",
        "in use 17.00 GiB",
        "weights 15.00 GiB",
        "prefill worker's peak 2.00 GiB",
        "CUDA graphs 0.50 GiB",
        f"{plan.num_blocks} blocks",
    ):
        assert figure in plan.summary


def test_no_prefill_worker_and_no_graphs_leave_more() -> None:
    shared = plan_from_measurement(measured(), 0.9, BLOCK, 16, 131072, None, "H100")
    alone = plan_from_measurement(
        measured(peer_activation_peak=0, graph_peak=0), 0.9, BLOCK, 16, 131072, None, "H100"
    )
    assert alone.num_blocks - shared.num_blocks == (2 * GiB + GiB // 2) // BLOCK


def test_model_that_does_not_fit_names_the_numbers_and_the_fix() -> None:
    with pytest.raises(StartupError) as err:
        plan_from_measurement(
            measured(in_use=75 * GiB), 0.9, BLOCK, 16, 131072, 8192, "NVIDIA H100"
        )
    message = str(err.value)
    assert "8192 tokens" in message and "in use 75.00 GiB" in message and "NVIDIA H100" in message
    assert "--gpu-memory-utilization" in message and "512 blocks" in message


def test_memory_other_processes_held_at_start_is_outside_the_share() -> None:
    """--gpu-memory-utilization is this instance's share, as vLLM's is: a second server beside one
    that holds 30 GiB gets the same pool as it would alone, and its log line says what was held
    before it started."""
    alone = plan_from_measurement(measured(), 0.5, BLOCK, 16, 131072, None, "H100")
    beside = plan_from_measurement(measured(others=30 * GiB), 0.5, BLOCK, 16, 131072, None, "H100")
    assert beside.num_blocks == alone.num_blocks == (40 * GiB - 21 * GiB - GiB // 2) // BLOCK
    assert "30.00 GiB held before start, outside this share" in beside.summary
    assert "held before start" not in alone.summary


def test_a_share_larger_than_the_free_memory_is_refused_with_the_numbers() -> None:
    check_free_at_start(50 * GiB, 80 * GiB, 0.6, "NVIDIA H100")  # 48 GiB asked, 50 free: starts
    with pytest.raises(StartupError) as err:
        check_free_at_start(50 * GiB, 80 * GiB, 0.9, "NVIDIA H100")
    message = str(err.value)
    for figure in (
        "--gpu-memory-utilization 0.90",
        "72.00 GiB",
        "only 50.00 GiB is free",
        "30.00 GiB is held",
        "at most 0.62",
        "NVIDIA H100",
    ):
        assert figure in message


def test_requested_context_longer_than_the_pool_is_refused() -> None:
    with pytest.raises(StartupError, match="--kv-cache-memory"):
        plan_from_request(None, 0.001, BLOCK, 16, 131072, 8192)


def test_cpu_pool_from_blocks_or_gib() -> None:
    assert plan_from_request(100, None, BLOCK, 16, 4096, None).num_blocks == 100
    plan = plan_from_request(None, 1.0, BLOCK, 16, 4096, None)
    assert (
        plan.num_blocks == GiB // BLOCK and plan.max_model_len == 4096
    )  # the model's context, the pool holds more
    assert (
        plan_from_request(10, None, BLOCK, 16, 4096, None).max_model_len == 160
    )  # capped by the pool


def test_context_beyond_the_model_is_refused() -> None:
    with pytest.raises(StartupError, match="exceeds the model's 4096 positions"):
        plan_from_request(None, 1.0, BLOCK, 16, 4096, 5000)


@pytest.mark.gpu
def test_a_second_process_context_shows_in_free_memory_and_is_small() -> None:
    """What the plan counts on for the prefill worker's CUDA context: the worker makes it as it
    starts, while the decode worker loads the weights, and the decode worker's measurement
    (in_use, from free memory) then includes it; nothing reserves it explicitly. This measures
    that context as the decode side sees it. If it were large, a prefill worker that started late
    (after the measurement) would have to fit in the headroom that --gpu-memory-utilization
    leaves (8 GiB at 0.9 on an H100)."""
    import subprocess
    import sys

    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.zeros(1, device="cuda")
    free_before, _ = torch.cuda.mem_get_info()
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, torch; torch.zeros(1, device='cuda'); "
            "torch.cuda.synchronize(); print('ready', flush=True); sys.stdin.readline()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        free_during, _ = torch.cuda.mem_get_info()
    finally:
        child.stdin.close()
        child.wait(60)
    context = free_before - free_during
    print(f"a second process's CUDA context: {context / 2**20:.0f} MiB")
    assert 0 < context < GiB
