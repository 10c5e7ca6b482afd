"""Triton kernels of the GPU path: everything in a forward pass except the 16-bit GEMMs, which go
through torch (cuBLAS).

- fp8_linear: FP8 weights' GEMMs, torch._scaled_mm after our activation quantizer, or our GEMM
  with each group's scales (fp8.py)
- store_kv: write the step's new K/V into the paged cache (store_kv.py), quantizing into an FP8 one
- paged_attention: causal attention for prefill, append-prefill and decode over the paged cache,
  with split-KV for small decode batches and appends over long cached prefixes (attention.py;
  choose_num_splits, choose_append_splits and workspace_for size the split)
- rms_norm, add_rms_norm, add_rms_norm_ (norm.py), apply_rope (rope.py), silu_and_mul
  (activation.py): fused elementwise ops; rope_store_kv (rope.py): RoPE and the KV store in one
  launch
- plan_attention, launch_attention (attention.py): paged_attention split in two, so that a step
  plans its launch once and each layer only launches it; plan_mixed_attention plans a step's decode
  and general grids as one launch

Each kernel computes in float32 and rounds once to the output dtype. Tests run them on the CPU under
TRITON_INTERPRET=1, which must be set before this package is imported (triton.jit reads it at
decoration).
"""

from engine.kernels.activation import silu_and_mul
from engine.kernels.attention import (
    choose_append_splits,
    choose_num_splits,
    launch_attention,
    paged_attention,
    plan_attention,
    plan_mixed_attention,
    workspace_for,
)
from engine.kernels.norm import add_rms_norm, add_rms_norm_, rms_norm
from engine.kernels.rope import apply_rope, rope_store_kv
from engine.kernels.store_kv import store_kv

__all__ = [
    "add_rms_norm",
    "add_rms_norm_",
    "apply_rope",
    "choose_append_splits",
    "choose_num_splits",
    "launch_attention",
    "paged_attention",
    "plan_attention",
    "plan_mixed_attention",
    "rms_norm",
    "rope_store_kv",
    "silu_and_mul",
    "store_kv",
    "workspace_for",
]
