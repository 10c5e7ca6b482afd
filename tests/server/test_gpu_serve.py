"""`ppd serve` on a GPU: greedy ids equal transformers' through both workers, one copy of the
weights and the KV pool in the driver's per-process memory, /health names the GPU, and a model
that does not fit is refused with its numbers. Every test needs CUDA and skips cleanly without
it."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from partition.backends import green_available
from partition.mps import existing_mps_pipe_dir
from tests.server_process import ServerProcess
from tests.tiny_models import hf_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def gpu_server(start_server, tiny_llama: Path) -> ServerProcess:
    # A small budget so that the prefill worker chunks prompts; 30% of the GPU makes the pool big
    # and unmistakable.
    return start_server(
        "--model",
        str(tiny_llama),
        "--served-model-name",
        "tiny",
        "--device",
        "cuda",
        "--gpus",
        "0",
        "--dtype",
        "float32",
        "--policy",
        "ppd",
        "--max-num-batched-tokens",
        "32",
        "--max-num-seqs",
        "16",
        "--gpu-memory-utilization",
        "0.3",
    )


def complete(server: ServerProcess, prompt: list[int], route: str) -> tuple[list[int], str]:
    resp = httpx.post(
        f"{server.url}/v1/completions",
        timeout=120,
        headers={"x-ppd-route": route},
        json={
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": NEW_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"], resp.headers["x-ppd-route"]


def test_greedy_ids_match_hf_on_both_routes(gpu_server: ServerProcess, tiny_llama: Path) -> None:
    rng = random.Random(0)
    for append_len, expected_route in ((10, "decode"), (60, "prefill")):
        prompt = [rng.randrange(3, 256) for _ in range(45)]
        out1, route1 = complete(gpu_server, prompt, expected_route)
        assert route1 == "prefill" and out1 == hf_greedy(tiny_llama, prompt, NEW_TOKENS)
        turn2 = prompt + out1 + [rng.randrange(3, 256) for _ in range(append_len)]
        out2, route2 = complete(gpu_server, turn2, expected_route)
        assert route2 == expected_route and out2 == hf_greedy(tiny_llama, turn2, NEW_TOKENS)


def test_health_names_the_gpu(gpu_server: ServerProcess) -> None:
    (unit,) = gpu_server.health()["units"]
    device = unit["device"]
    assert device["kind"] == "cuda" and device["index"] == "0"
    assert device["name"] == torch.cuda.get_device_name(0)
    assert 0 < device["memory_used_bytes"] <= device["memory_total_bytes"]


def test_one_copy_of_weights_and_pool_per_gpu(gpu_server: ServerProcess) -> None:
    pynvml = pytest.importorskip("pynvml")
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        # Under MPS the driver lists the MPS server as the GPU's process, and the workers as MPS
        # clients.
        mps = gpu_server.health()["units"][0]["partition"]["backend"] == "mps"
        listing = (
            pynvml.nvmlDeviceGetMPSComputeRunningProcesses
            if mps
            else pynvml.nvmlDeviceGetComputeRunningProcesses
        )
        used = {p.pid: p.usedGpuMemory for p in listing(handle)}
        total = pynvml.nvmlDeviceGetMemoryInfo(handle).total
    finally:
        pynvml.nvmlShutdown()
    pids = gpu_server.worker_pids()
    assert pids["decode"] in used and pids["prefill"] in used, (
        f"workers {pids} not among the GPU's processes {used}"
    )
    if (
        pids["decode"] == pids["prefill"]
    ):  # green: one process; a second pool would take it past its 30%
        assert 0.15 * total < used[pids["decode"]] < 0.35 * total
        return
    decode, prefill = used[pids["decode"]], used[pids["prefill"]]
    # The decode worker allocated a pool of most of 30% of the GPU; the prefill worker maps it and
    # holds only its context and activations: a second copy would show as a second pool's worth.
    assert decode > 0.15 * total
    assert prefill < 0.05 * total, f"the prefill worker holds {prefill} bytes of {total}: a copy?"


def test_the_default_partition_says_what_it_is_and_holds(gpu_server: ServerProcess) -> None:
    """auto: mps where MPS is installed (the workers must then really be its clients), else green
    where cuda-python is (its splits made), else the time-sliced none."""
    partition = gpu_server.health()["units"][0]["partition"]
    assert partition["backend"] in ("mps", "green", "none")
    assert "problem" not in partition, partition.get("problem")


@pytest.mark.parametrize("partition", ["none", "mps", "green"])
def test_greedy_ids_match_hf_under_each_gpu_partition(
    start_server, tiny_llama: Path, partition: str
) -> None:
    if partition == "mps" and not (
        shutil.which("nvidia-cuda-mps-control") or existing_mps_pipe_dir()
    ):
        pytest.skip("MPS is not installed on this host")
    if partition == "green" and not green_available():
        pytest.skip("green contexts need cuda-python")
    server = start_server(
        "--model",
        str(tiny_llama),
        "--served-model-name",
        "tiny",
        "--device",
        "cuda",
        "--gpus",
        "0",
        "--dtype",
        "float32",
        "--partition",
        partition,
        "--max-num-batched-tokens",
        "32",
        "--max-num-seqs",
        "16",
        "--gpu-memory-utilization",
        "0.2",
    )
    rng = random.Random(1)
    prompt = [rng.randrange(3, 256) for _ in range(45)]
    out1, _ = complete(server, prompt, "prefill")
    turn2 = prompt + out1 + [rng.randrange(3, 256) for _ in range(20)]
    out2, _ = complete(server, turn2, "decode")
    assert out1 == hf_greedy(tiny_llama, prompt, NEW_TOKENS) and out2 == hf_greedy(
        tiny_llama, turn2, NEW_TOKENS
    )
    unit = server.health()["units"][0]
    assert unit["partition"]["backend"] == partition and "problem" not in unit["partition"]
    if (
        partition == "green"
    ):  # one process, on a split of the SMs or, with a side idle, on all of them
        assert {w["pid"] for w in unit["workers"]} == {unit["workers"][0]["pid"]}
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert (
            0 < unit["partition"]["decode_share"] <= sms
            and 0 < unit["partition"]["prefill_share"] <= sms
        )


def test_model_that_does_not_fit_is_refused_with_numbers(tiny_llama: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli",
            "serve",
            "--model",
            str(tiny_llama),
            "--device",
            "cuda",
            "--gpus",
            "0",
            "--gpu-memory-utilization",
            "0.0001",
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "cannot start" in result.stderr and "GiB allowed" in result.stderr
    assert "--gpu-memory-utilization" in result.stderr and "Traceback" not in result.stderr
