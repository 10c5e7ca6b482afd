"""What an eager step asks of the host, per layer, on the GPU path (the Triton backend, in Triton's
interpreter here).

An eager step's host time was per layer (bench/results/nvidia-h200: about 0.45-0.5 ms a layer, 193
launches and 259 allocations a step on Llama-3.1-8B). What a layer does now: five kernel launches
(the two norms, RoPE fused with the KV store, attention, SiLU-and-multiply) beside its GEMMs, one
more in a mixed step when attention's two grids launch one after the other (MIXED_LAUNCH
"sequential": its decode grid for its decodes, its general grid for the rest; "fused" runs both in
one launch), and one allocation (SiLU-and-multiply's output): the rotated queries and attention's
output are made once a step, by the first layer, and the residual stream is updated in place. The
counts are taken as the difference between a 4-layer and a 2-layer model, so that what a step does
once (its metadata, the logits) does not blur them.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime.interpreter import InterpretedFunction

from engine.attention import triton_backend
from engine.loader import load_model
from engine.model import kv_pool_shape
from engine.model_runner import ModelRunner, StepInput
from tests.tiny_models import write_tiny_model

ALLOCATIONS = {
    "empty.memory_format",
    "empty_strided.default",
    "empty_like.default",
    "zeros.default",
    "full.default",
}


class Allocations(TorchDispatchMode):
    """Counts the tensors the host code creates by name (not those a GEMM or a copy makes for its
    own output, nor the interpreter's own while it runs a kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.in_kernel = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__ in ALLOCATIONS and not self.in_kernel:
            self.count += 1
        return func(*args, **(kwargs or {}))


def step_counts(folder: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Counter, int]:
    """Kernel launches by name, and allocations, of one mixed step (a prompt beside a decode; after
    a first one)."""
    model, cfg = load_model(folder)
    runner = ModelRunner(model, torch.zeros(kv_pool_shape(cfg, 16, 16)), 16, "triton")
    inputs = [StepInput([5] * 20, 0, [0, 1]), StepInput([7], 9, [2])]
    runner.forward(inputs)
    launches: Counter = Counter()
    run = InterpretedFunction.run
    allocations = Allocations()

    def counted(self, *args, **kwargs):
        launches[self.fn.__name__] += 1
        allocations.in_kernel = True
        try:
            return run(self, *args, **kwargs)
        finally:
            allocations.in_kernel = False

    with monkeypatch.context() as patch, allocations:
        patch.setattr(InterpretedFunction, "run", counted)
        runner.forward([StepInput([6] * 20, 0, [3, 4]), StepInput([8], 9, [2])])
    return launches, allocations.count


# Each mixed launch on one architecture here, the other two pairs in the second suite.
@pytest.mark.parametrize(
    ("arch", "mixed"),
    [
        ("llama", "fused"),
        ("qwen3", "sequential"),
        pytest.param("llama", "sequential", marks=pytest.mark.slow),
        pytest.param("qwen3", "fused", marks=pytest.mark.slow),
    ],
)
def test_an_eager_mixed_layer_launches_five_or_six_kernels_and_allocates_once(
    arch: str, mixed: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(triton_backend, "MIXED_LAUNCH", mixed)
    two, two_alloc = step_counts(
        write_tiny_model(tmp_path / "2", arch, num_hidden_layers=2), monkeypatch
    )
    four, four_alloc = step_counts(
        write_tiny_model(tmp_path / "4", arch, num_hidden_layers=4), monkeypatch
    )
    per_layer = {name: (four[name] - two[name]) / 2 for name in four}
    expected = {"_rms_norm_kernel": 2.0, "_rope_store_kv_kernel": 1.0, "_silu_and_mul_kernel": 1.0}
    expected.update(
        {"_mixed_attention_kernel": 1.0} if mixed == "fused" else {"_attention_kernel": 2.0}
    )
    if arch == "qwen3":  # its per-head q and k norms: two launches more
        expected["_rms_norm_kernel"] = 4.0
    assert per_layer == expected
    # SiLU-and-multiply's output, and Qwen3's per-head norms' new q and k: the only allocations a
    # layer makes.
    assert (four_alloc - two_alloc) / 2 == (3.0 if arch == "qwen3" else 1.0)
