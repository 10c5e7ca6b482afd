"""`ppd bench engine`: the engine alone against the hardware's floors, on one device.

In one run it measures the device's two ceilings (copy bandwidth, counting bytes read plus written;
the matmul rate in the model's dtype, float32 for bfloat16 on a CPU without native bfloat16), then
times:
- decode steps at several batch sizes and contexts;
- full prefills at several prompt lengths (prompts batched to about 8K tokens);
- append-prefills of new tokens over a long cached prefix;
- mixed steps: a batch of decodes and one append-prefill in the same step. Decode, append and mixed
  steps run with CUDA graphs (where the runner has them; a step no graph fits runs eagerly inside
  the runner) and with them turned off. Every step records its host time: until it is queued on the
  device. Each time sits beside its floor, max(bytes / bandwidth, FLOPs / matmul rate), and their
  ratio. Every figure is the median over repeated runs. Results go to
  <results>/<device>/engine-<model>.{json,md} ($PPD_RESULTS_DIR, else ./ppd-results).

With --tensor-parallel-size N it runs N ranks (a process each: a GPU each, or an
equal part of the CPU's cores) that step together over their shards; the floors
are one rank's (its shard's bytes and FLOPs against its device's ceilings), and
each step's collectives are timed in a pass of their own (the step once more,
eager, each collective waited for) against their floor: the bytes each rank
sends (a ring all-reduce sends 2 (N - 1) / N of the tensor) over the link's
bandwidth, measured in the same run by an all-reduce of 16 MiB (CPU) or 256 MiB.

On a GPU the default model is Llama-3.1-8B's configuration with random weights
(bench/models/llama-3.1-8b); on the CPU the demo model, at small sizes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import re
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from engine.attention import triton_backend
from engine.config import ModelConfig, ModelError, expected_experts, resolve_dtype
from engine.cpu_isa import has_native_bf16, isa
from engine.demo import DEMO_MODEL, demo_model_path
from engine.engine import Engine, EngineConfig, device_info
from engine.model import kv_block_nbytes
from engine.model_runner import StepInput
from engine.parallel import SINGLE, TensorParallel, init_tensor_parallel
from engine.step_timing import (
    Blocks,
    add_model_args,
    chosen_device,
    chosen_model,
    device_ms,
    fill_random_kv,
    greedy_step,
    median_ms,
    pipelined_ms,
    release_engine,
    sync_device,
    time_step,
)
from profiles import results_dir

log = logging.getLogger("ppd.bench")


@dataclass(frozen=True)
class Grid:
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    prompts: tuple[int, ...]
    appends: tuple[tuple[int, int], ...]  # (new tokens, cached tokens)
    mixed: tuple[
        tuple[int, int, int, int], ...
    ]  # (decodes, their context, the append's new tokens, its cached)
    prefill_tokens: int  # prompts are batched up to about this many tokens per forward
    repeat: int  # timed runs per point (the median is reported)


# The GPU's mixed step is issue 32's target shape: 64 decodes at context 1K beside one 256-token
# append over 4K.
GPU_GRID = Grid(
    (1, 8, 32, 128, 256),
    (1024, 4096),
    (512, 2048, 8192),
    ((256, 4096), (256, 16384)),
    ((64, 1024, 256, 4096),),
    8192,
    20,
)
CPU_GRID = Grid(
    (1, 8, 32),
    (256, 1024, 2048),
    (128, 512, 2048),
    ((64, 512), (64, 2048)),
    ((8, 256, 64, 512),),
    2048,
    5,
)
QUICK_GRID = Grid((1, 4), (64,), (64,), ((16, 128),), ((4, 64, 16, 128),), 128, 2)
# A mixture of experts on a GPU (issue 48's figures): decode from 1 to 128 sequences at 1K, whose
# experts read grow with the batch, a 4K prefill, a 256-token append over 4K, and that append beside
# 64 decodes.
MOE_GPU_GRID = Grid(
    (1, 8, 32, 64, 128), (1024,), (4096,), ((256, 4096),), ((64, 1024, 256, 4096),), 4096, 20
)


@dataclass
class Ceilings:
    copy_gbps: float  # bytes read + written per second / 1e9
    matmul_tflops: float
    link_gbps: float | None = (
        None  # tensor parallelism: the bytes each rank sends per second / 1e9 (bus bandwidth)
    )


@dataclass
class Point:
    kind: str  # decode | prefill | append | mixed
    label: dict
    ms: float | None = None  # median wall time of the step
    host_ms: float | None = None  # median host time until the step was queued
    device_ms: float | None = None  # median time it keeps the device busy, host time out (CUDA)
    pipelined_ms: float | None = (
        None  # median wall time a step takes when each is launched before the one before ends
    )
    sequential_floor_ms: float | None = (
        None  # mixed steps: the floor of GEMMs and attention run one after the other
    )
    floor_ms: float | None = None
    floor_bound: str | None = None  # "memory" or "compute": which term sets the floor
    tokens_per_s: float | None = None
    comm_ms: float | None = (
        None  # tensor parallelism: the step's collectives, timed alone (median per step)
    )
    comm_floor_ms: float | None = None  # their bytes sent per rank / the link's bandwidth
    # a mixture of experts: the experts the step's tokens routed to, per MoE layer (its floor's)
    experts_per_layer: float | None = None
    skipped: str | None = None
    round_ratios: list[float] = field(
        default_factory=list
    )  # several rounds: each round's time / floor

    @property
    def ratio(self) -> float | None:
        if self.round_ratios:
            return statistics.median(self.round_ratios)
        return None if self.ms is None or not self.floor_ms else self.ms / self.floor_ms


@dataclass
class Report:
    device: str
    model: str
    dtype: str
    ceilings: Ceilings
    points: list[Point] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    rounds: int = 1


def merge_rounds(reports: list[Report]) -> Report:
    """One report from rounds of the same grid: each time, floor and ceiling the median over the
    rounds, and each time / floor the median of the rounds' own ratios (a round's steps against the
    ceilings measured with them, so that a shared machine's drift between rounds cancels)."""
    first = reports[0]
    if len(reports) == 1:
        return first

    def median(values: list) -> float | None:
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    ceilings = Ceilings(
        copy_gbps=median([r.ceilings.copy_gbps for r in reports]),
        matmul_tflops=median([r.ceilings.matmul_tflops for r in reports]),
        link_gbps=median([r.ceilings.link_gbps for r in reports]),
    )
    points = []
    for same in zip(*(r.points for r in reports)):
        p = same[0]
        if p.skipped:
            points.append(p)
            continue
        points.append(
            Point(
                p.kind,
                p.label,
                ms=median([q.ms for q in same]),
                host_ms=median([q.host_ms for q in same]),
                device_ms=median([q.device_ms for q in same]),
                pipelined_ms=median([q.pipelined_ms for q in same]),
                sequential_floor_ms=median([q.sequential_floor_ms for q in same]),
                floor_ms=median([q.floor_ms for q in same]),
                floor_bound=p.floor_bound,
                tokens_per_s=median([q.tokens_per_s for q in same]),
                comm_ms=median([q.comm_ms for q in same]),
                comm_floor_ms=median([q.comm_floor_ms for q in same]),
                experts_per_layer=median([q.experts_per_layer for q in same]),
                round_ratios=[q.ratio for q in same],
            )
        )
    return Report(
        first.device, first.model, first.dtype, ceilings, points, first.meta, rounds=len(reports)
    )


# ---- the device's ceilings -----------------------------------------------------------------------


def _copy_ms(nbytes: int, device: torch.device, repeat: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    return median_ms(lambda: dst.copy_(src), device, repeat=repeat)


def measure_ceilings(device: torch.device, dtype: torch.dtype, quick: bool) -> Ceilings:
    """Copy bandwidth (a large device-to-device copy, bytes read + written) and the matmul rate on
    random data, in dtype, or in float32 for bfloat16 on a CPU without native bfloat16 (the engine's
    linear layers run in float32 there, engine/attention/cpu_linear.py, and PyTorch's bfloat16
    matmul is no ceiling of the hardware's)."""
    nbytes = (64 if quick else 256) * 2**20 if device.type == "cpu" else 2 * 2**30
    copy_gbps = 2 * nbytes / (_copy_ms(nbytes, device, repeat=5 if quick else 20) / 1000) / 1e9
    if device.type == "cpu" and dtype == torch.bfloat16 and not has_native_bf16():
        dtype = torch.float32
    n = (256 if quick else 1024) if device.type == "cpu" else 8192
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    ms = median_ms(lambda: a @ b, device, repeat=3 if quick else 10)
    return Ceilings(copy_gbps=copy_gbps, matmul_tflops=2 * n**3 / (ms / 1000) / 1e12)


# ---- floors --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelCost:
    weight_bytes: int  # every weight read once per step
    kv_bytes_per_token: int  # K and V of one token, all layers
    matmul_params: (
        int  # parameters in the per-token GEMMs (all layers' projections; not the embedding)
    )
    lm_head_params: int
    attn_flops_per_pair: int  # FLOPs of one (query, key) pair across layers and heads: QK^T and PV
    num_layers: int = 0
    layer_gemms: tuple[
        tuple[int, int], ...
    ] = ()  # (out, in) of a layer's weights as the model fuses them (a dense layer's)
    itemsize: int = 2
    weight_itemsize: int = (
        2  # the projections' bytes a value: 1 in FP8 (their scales in weight_bytes)
    )
    # A mixture of experts: weight_bytes and matmul_params above leave the experts out; a step reads
    # the experts its tokens route to (expert_bytes each, gate|up and down, in moe_layers layers)
    # and multiplies each token by top_k of them.
    moe_layers: int = 0
    num_experts: int = 0
    top_k: int = 0
    expert_params: int = 0

    @classmethod
    def of(
        cls,
        cfg: ModelConfig,
        dtype: torch.dtype,
        block_size: int,
        kv_dtype: torch.dtype | None = None,
    ) -> ModelCost:
        """The model's costs in dtype; its projections in FP8 where cfg.quantization says (a byte a
        value and a float32 scale a row and group), its KV in kv_dtype (default: dtype)."""
        h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        attention = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h
        moe_layers = len(cfg.moe_layers)
        dense_layers = cfg.num_layers - moe_layers
        expert = 3 * h * cfg.moe_intermediate_size
        # every layer's attention, each dense layer's MLP, each MoE layer's router
        always = (
            cfg.num_layers * attention
            + dense_layers * 3 * h * inter
            + moe_layers * cfg.num_experts * h
        )
        lm_head = cfg.vocab_rows * h  # a tensor-parallel rank's part of the vocabulary
        gemms = (
            ((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h),
            (h, cfg.num_heads * d),
            (2 * inter, h),
            (h, inter),
        )
        weight_itemsize = dtype.itemsize
        scales = 0
        if cfg.quantization is not None:
            weight_itemsize = 1
            scales = 4 * sum(
                -(-k // cfg.quantization.group(k)) * n * count
                for (n, k), count in zip(gemms, (cfg.num_layers,) * 2 + (dense_layers,) * 2)
            )
        # the embedding is gathered, not read
        weight_bytes = always * weight_itemsize + scales + lm_head * dtype.itemsize
        return cls(
            weight_bytes=weight_bytes,
            kv_bytes_per_token=kv_block_nbytes(cfg, block_size, kv_dtype or dtype) // block_size,
            matmul_params=always + moe_layers * cfg.num_experts_per_tok * expert,
            lm_head_params=lm_head,
            attn_flops_per_pair=4 * cfg.num_layers * cfg.num_heads * d,
            num_layers=cfg.num_layers,
            layer_gemms=gemms,
            itemsize=dtype.itemsize,
            weight_itemsize=weight_itemsize,
            moe_layers=moe_layers,
            num_experts=cfg.num_experts,
            top_k=cfg.num_experts_per_tok,
            expert_params=expert,
        )

    def expected_experts(self, tokens: int) -> float:
        """Experts read in all MoE layers by `tokens` tokens under uniform routing: each of a
        layer's experts escapes a token with probability 1 - top_k / E."""
        return expected_experts(tokens, self.moe_layers, self.num_experts, self.top_k)

    def floor(
        self,
        ceil: Ceilings,
        new_tokens: int,
        kv_read_tokens: int,
        attn_pairs: int,
        sampled: int,
        experts_read: float | None = None,
    ) -> tuple[float, str]:
        """(milliseconds, "memory"|"compute") for a step: weights and the KV it reads, against its
        FLOPs (the overlap floor: the attention's KV reads hidden under the GEMMs' compute, or the
        reverse). experts_read: of a mixture of experts, the experts the step's tokens routed to,
        summed over the layers (measured: routed_experts; by default, uniform routing's
        expectation)."""
        if experts_read is None:
            experts_read = self.expected_experts(new_tokens)
        mem_ms = (
            (
                self.weight_bytes
                + experts_read * self.expert_params * self.itemsize
                + kv_read_tokens * self.kv_bytes_per_token
            )
            / (ceil.copy_gbps * 1e9)
            * 1000
        )
        flops = (
            2 * self.matmul_params * new_tokens
            + 2 * self.lm_head_params * sampled
            + self.attn_flops_per_pair * attn_pairs
        )
        compute_ms = flops / (ceil.matmul_tflops * 1e12) * 1000
        return (mem_ms, "memory") if mem_ms >= compute_ms else (compute_ms, "compute")

    def sequential_floor(
        self,
        ceil: Ceilings,
        new_tokens: int,
        sampled: int,
        attention: list[tuple[int, int]],
        experts_read: float | None = None,
    ) -> float:
        """Milliseconds for a step run kernel after kernel, each at its own floor: every GEMM (each
        layer's four weights at new_tokens rows, the LM head at sampled rows; a mixture's experts
        as one grouped GEMM a layer over the experts read) its weight's bytes against its FLOPs,
        then each attention launch of `attention` (its KV tokens read, its query-key pairs) its KV
        against its FLOPs."""
        bw, rate = ceil.copy_gbps * 1e9, ceil.matmul_tflops * 1e12
        itemsize = self.itemsize

        def gemm(params: int, rows: int, size: int = self.weight_itemsize) -> float:
            return max(params * size / bw, 2 * params * rows / rate)

        layers = self.num_layers - self.moe_layers
        gemms = self.num_layers * sum(gemm(n * k, new_tokens) for n, k in self.layer_gemms[:2])
        gemms += layers * sum(gemm(n * k, new_tokens) for n, k in self.layer_gemms[2:])
        if self.moe_layers:
            read = self.expected_experts(new_tokens) if experts_read is None else experts_read
            per_layer = read / self.moe_layers * self.expert_params
            gemms += self.moe_layers * max(
                per_layer * itemsize / bw, 2 * self.top_k * self.expert_params * new_tokens / rate
            )
        gemms += gemm(self.lm_head_params, sampled, itemsize)
        attn = sum(
            max(kv * self.kv_bytes_per_token / bw, self.attn_flops_per_pair * pairs / rate)
            for kv, pairs in attention
        )
        return (gemms + attn) * 1000


# ---- the timed steps -----------------------------------------------------------------------------


def timed_step(
    engine: Engine,
    ceil: Ceilings,
    inputs: list[StepInput],
    repeat: int,
    warmup: int = 3,
    graphs: bool = True,
    pipelined: bool = True,
) -> tuple[float, float, dict]:
    """time_step's (wall ms, host ms), and its device time and pipelined time
    (engine/step_timing.py; the latter not under tensor parallelism, whose followers cannot take
    tokens they did not sample); under tensor parallelism the step's collectives: the step run
    `repeat` times more, eagerly, each collective waited for and timed (median per step), beside
    their floor."""
    ms, host = time_step(engine, inputs, repeat, warmup=warmup, graphs=graphs)
    # Fewer runs for these two: a median of 5 (device) and of 3 rounds of 5 steps (pipelined) keeps
    # the GPU's run short.
    extra = {"device_ms": device_ms(engine, inputs, min(repeat, 5), graphs, host)}
    tp = engine.runner.model.tp
    if not tp.enabled and pipelined:
        extra["pipelined_ms"] = pipelined_ms(engine, inputs, 3, graphs)
    if not tp.enabled:
        return ms, host, extra
    saved, engine.runner.graphs = (
        engine.runner.graphs,
        None,
    )  # a graph's collectives are not Python calls
    per_step, wire = [], 0.0
    try:
        tp.timed = True
        for _ in range(repeat):
            tp.reset_timing()
            greedy_step(engine, inputs)
            per_step.append(tp.seconds * 1000)
            wire = tp.wire_bytes
    finally:
        tp.timed = False
        engine.runner.graphs = saved
    floor = wire / (ceil.link_gbps * 1e9) * 1000 if ceil.link_gbps else None
    return ms, host, {**extra, "comm_ms": statistics.median(per_step), "comm_floor_ms": floor}


def routed_experts(engine: Engine, inputs: list[StepInput]) -> int | None:
    """The experts a step's tokens route to, summed over the layers: the step run once more,
    eagerly, with the router's choices counted (None for a dense model). Steps repeat on the same
    tokens and KV, so the timed runs route the same way."""
    if not engine.runner.model.cfg.is_moe:
        return None
    ops, counted = engine.runner.backend.ops, []
    route = ops.route

    def counting(logits: torch.Tensor, top_k: int, renormalize: bool):
        weights, ids = route(logits, top_k, renormalize)
        counted.append(int(ids.unique().numel()))
        return weights, ids

    saved, engine.runner.graphs = engine.runner.graphs, None
    ops.route = counting
    try:
        greedy_step(engine, inputs)
    finally:
        del ops.route
        engine.runner.graphs = saved
    return sum(counted)


def token_ids(engine: Engine, n: int, seed: int) -> list[int]:
    """n token ids for a timed step: random for a mixture of experts, whose cost depends on where
    its tokens route (one id repeated would send them all to the same experts), else all 1."""
    cfg = engine.runner.model.cfg
    if not cfg.is_moe:
        return [1] * n
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist()


def _experts(experts: int | None, cost: ModelCost) -> dict:
    """A point's record of the experts its step read: per MoE layer, and uniform routing's."""
    return {} if experts is None else {"experts_per_layer": experts / cost.moe_layers}


def measure_link(tp: TensorParallel, device: torch.device, quick: bool) -> float:
    """The bytes each rank sends per second (GB/s) in an all-reduce of 16 MiB on the CPU, 256 MiB on
    a GPU (float32 elements): the link's bus bandwidth, as nccl-tests reports it."""
    nbytes = (4 if quick else 16) * 2**20 if device.type == "cpu" else 256 * 2**20
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    tp.all_reduce(x)  # warm-up: connections made, buffers registered
    sync_device(device)
    rates = []
    tp.timed = True
    try:
        for _ in range(3 if quick else 10):
            tp.reset_timing()
            tp.all_reduce(x)
            rates.append(tp.wire_bytes / tp.seconds / 1e9)
    finally:
        tp.timed = False
    return statistics.median(rates)


def _no_graphs(engine: Engine, kind: str, label: dict) -> Point | None:
    if label["graphs"] and engine.runner.graphs is None:
        return Point(kind, label, skipped="no CUDA graphs on this device/backend")
    return None


def time_decode(
    engine: Engine,
    cost: ModelCost,
    ceil: Ceilings,
    batch: int,
    context: int,
    graphs: bool,
    repeat: int,
) -> Point:
    label = {"batch": batch, "context": context, "graphs": graphs}
    blocks = Blocks(engine.num_kv_blocks, engine.plan.block_size)
    if context + 1 > engine.max_model_len or not blocks.fits(context + 1, batch):
        need = batch * (context + 1) * cost.kv_bytes_per_token
        return Point(
            "decode",
            label,
            skipped=f"needs {need / 2**30:.1f} GiB of KV; the pool holds "
            f"{engine.num_kv_blocks * engine.plan.block_size} tokens",
        )
    if skipped := _no_graphs(engine, "decode", label):
        return skipped
    inputs = [
        StepInput(token_ids(engine, 1, i), context, blocks.table(context + 1)) for i in range(batch)
    ]
    experts = routed_experts(engine, inputs)
    ms, host, extra = timed_step(engine, ceil, inputs, repeat, graphs=graphs)
    floor, bound = cost.floor(ceil, batch, batch * context, batch * (context + 1), batch, experts)
    extra.update(_experts(experts, cost))
    return Point(
        "decode",
        label,
        ms=ms,
        host_ms=host,
        floor_ms=floor,
        floor_bound=bound,
        tokens_per_s=batch / (ms / 1000),
        **extra,
    )


def time_prefill(
    engine: Engine, cost: ModelCost, ceil: Ceilings, prompt: int, total: int, repeat: int
) -> Point:
    num = max(1, total // prompt)
    label = {"prompt": prompt, "prompts_per_step": num}
    blocks = Blocks(engine.num_kv_blocks, engine.plan.block_size)
    if prompt > engine.max_model_len or not blocks.fits(prompt, num):
        return Point(
            "prefill",
            label,
            skipped=f"{num} x {prompt} tokens do not fit the pool or max_model_len",
        )
    inputs = [StepInput(token_ids(engine, prompt, i), 0, blocks.table(prompt)) for i in range(num)]
    experts = routed_experts(engine, inputs)
    ms, host, extra = timed_step(
        engine, ceil, inputs, repeat, warmup=2, pipelined=False
    )  # no host time to hide
    floor, bound = cost.floor(ceil, num * prompt, 0, num * prompt * (prompt + 1) // 2, num, experts)
    extra.update(_experts(experts, cost))
    return Point(
        "prefill",
        label,
        ms=ms,
        host_ms=host,
        floor_ms=floor,
        floor_bound=bound,
        tokens_per_s=num * prompt / (ms / 1000),
        **extra,
    )


def time_append(
    engine: Engine,
    cost: ModelCost,
    ceil: Ceilings,
    new: int,
    cached: int,
    graphs: bool,
    repeat: int,
) -> Point:
    label = {"new": new, "cached": cached, "graphs": graphs}
    blocks = Blocks(engine.num_kv_blocks, engine.plan.block_size)
    if new + cached > engine.max_model_len or not blocks.fits(new + cached, 1):
        return Point(
            "append", label, skipped=f"{new + cached} tokens do not fit the pool or max_model_len"
        )
    if skipped := _no_graphs(engine, "append", label):
        return skipped
    inputs = [StepInput(token_ids(engine, new, 0), cached, blocks.table(new + cached))]
    experts = routed_experts(engine, inputs)
    ms, host, extra = timed_step(engine, ceil, inputs, repeat, graphs=graphs)
    pairs = new * cached + new * (new + 1) // 2
    floor, bound = cost.floor(ceil, new, cached, pairs, 1, experts)
    extra.update(_experts(experts, cost))
    return Point(
        "append",
        label,
        ms=ms,
        host_ms=host,
        floor_ms=floor,
        floor_bound=bound,
        tokens_per_s=new / (ms / 1000),
        **extra,
    )


def time_mixed(
    engine: Engine,
    cost: ModelCost,
    ceil: Ceilings,
    decodes: int,
    context: int,
    new: int,
    cached: int,
    graphs: bool,
    repeat: int,
    launch: str | None = None,
) -> Point:
    """One step of `decodes` decodes at `context` and one append of `new` tokens over `cached`: its
    floor reads the weights and all the KV of both, against the FLOPs of decodes + new tokens.
    launch: the Triton backend's mixed launch it runs with, where not the default."""
    label = {"decodes": decodes, "context": context, "new": new, "cached": cached, "graphs": graphs}
    if launch is not None:
        label["launch"] = launch
    bs = engine.plan.block_size
    blocks = Blocks(engine.num_kv_blocks, bs)
    if (
        max(context + 1, new + cached) > engine.max_model_len
        or decodes * -(-(context + 1) // bs) + -(-(new + cached) // bs) > engine.num_kv_blocks
    ):
        return Point(
            "mixed",
            label,
            skipped=f"{decodes} x {context + 1} + {new + cached} tokens do not fit the pool or "
            "max_model_len",
        )
    if skipped := _no_graphs(engine, "mixed", label):
        return skipped
    inputs = [
        StepInput(token_ids(engine, 1, i), context, blocks.table(context + 1))
        for i in range(decodes)
    ]
    inputs.append(StepInput(token_ids(engine, new, decodes), cached, blocks.table(new + cached)))
    experts = routed_experts(engine, inputs)
    ms, host, extra = timed_step(engine, ceil, inputs, repeat, graphs=graphs)
    pairs = decodes * (context + 1) + new * cached + new * (new + 1) // 2
    floor, bound = cost.floor(
        ceil, decodes + new, decodes * context + cached, pairs, decodes + 1, experts
    )
    extra["sequential_floor_ms"] = cost.sequential_floor(
        ceil,
        decodes + new,
        decodes + 1,
        [
            (decodes * context, decodes * (context + 1)),
            (cached, new * cached + new * (new + 1) // 2),
        ],
        experts,
    )
    extra.update(_experts(experts, cost))
    return Point(
        "mixed",
        label,
        ms=ms,
        host_ms=host,
        floor_ms=floor,
        floor_bound=bound,
        tokens_per_s=(decodes + new) / (ms / 1000),
        **extra,
    )


@contextlib.contextmanager
def mixed_launch(mode: str):
    """Within: the Triton backend plans a mixed step's attention as `mode` (fused or sequential)."""
    saved, triton_backend.MIXED_LAUNCH = triton_backend.MIXED_LAUNCH, mode
    try:
        yield
    finally:
        triton_backend.MIXED_LAUNCH = saved


# ---- the run -------------------------------------------------------------------------------------


def device_slug(device: torch.device) -> str:
    if device.type == "cuda":
        return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")
    return f"cpu-{len(os.sched_getaffinity(0))}core"


def engine_config(
    folder: str,
    device: torch.device,
    grid: Grid,
    dtype: str = "auto",
    attention_backend: str = "auto",
    *,
    eager: bool = False,
    exact_pool: bool | None = None,
    tensor_parallel_size: int = 1,
    fp8: Fp8Options | None = None,
) -> EngineConfig:
    """The engine that can run every step of grid, with dummy weights. exact_pool: a KV pool of just
    the blocks the grid needs (by default on the CPU; a GPU's is planned from its free memory)."""
    mcfg = ModelConfig.from_folder(folder)
    block_size = 16

    def blocks(tokens: int) -> int:
        return -(-tokens // block_size)

    max_batch = max([*grid.batches, *(d + 1 for d, *_ in grid.mixed)])
    longest = max(
        [c + 1 for c in grid.contexts]
        + list(grid.prompts)
        + [n + c for n, c in grid.appends]
        + [max(c + 1, n + k) for _, c, n, k in grid.mixed]
    )
    needed_blocks = max(
        [b * blocks(c + 1) for b in grid.batches for c in grid.contexts]
        + [max(1, grid.prefill_tokens // p) * blocks(p) for p in grid.prompts]
        + [blocks(n + c) for n, c in grid.appends]
        + [d * blocks(c + 1) + blocks(n + k) for d, c, n, k in grid.mixed]
    )
    step_tokens = max(
        [
            grid.prefill_tokens,
            max_batch,
            *(n for n, _ in grid.appends),
            *(d + n for d, _, n, _ in grid.mixed),
        ]
    )
    exact = device.type == "cpu" if exact_pool is None else exact_pool
    return EngineConfig(
        model=folder,
        dtype=dtype,
        load_format="dummy",
        device=device.type,
        attention_backend=attention_backend,
        block_size=block_size,
        max_model_len=min(longest, mcfg.max_position_embeddings),
        max_num_seqs=max_batch,
        max_num_batched_tokens=step_tokens,
        num_kv_blocks=needed_blocks if exact else None,
        enforce_eager=eager,
        shares_device=False,
        tensor_parallel_size=tensor_parallel_size,
        **(asdict(fp8) if fp8 else {}),
    )


def start_engine(cfg: EngineConfig, tp: TensorParallel = SINGLE) -> Engine:
    """Engine.create under names of this process, its KV random on a GPU; release it with
    release_engine."""
    engine = Engine.create(
        cfg, (f"ppd-bench-{os.getpid()}-weights", f"ppd-bench-{os.getpid()}-kv"), tp=tp
    )
    if engine.device.type == "cuda":
        fill_random_kv(engine)
    return engine


@dataclass(frozen=True)
class Fp8Options:
    """FP8 weights and KV cache as serve takes them (EngineConfig's fields of the same names)."""

    quantization: str | None = None
    fp8_activations: str = "dynamic"
    kv_cache_dtype: str = "auto"

    @classmethod
    def of(cls, args: argparse.Namespace) -> Fp8Options | None:
        """The options the command line gives; None where it asks for none (the plain model)."""
        got = cls(args.quantization, args.fp8_activations, args.kv_cache_dtype)
        return None if got.quantization is None and got.kv_cache_dtype == "auto" else got

    @property
    def suffix(self) -> str:
        """What the report's model name gets, so FP8 runs do not overwrite the plain one's."""
        weights = "" if self.quantization is None else f"-fp8-{self.fp8_activations}"
        return weights + ("-kv-fp8" if self.kv_cache_dtype != "auto" else "")


def model_folder(model: str) -> str:
    return str(demo_model_path()) if model == DEMO_MODEL else model


def run(
    model: str,
    device: torch.device,
    grid: Grid,
    dtype: str = "auto",
    quick: bool = False,
    attention_backend: str = "auto",
    tp: TensorParallel = SINGLE,
    fp8: Fp8Options | None = None,
) -> Report:
    """The grid on this device; under tensor parallelism every rank runs it in step with the others
    (its shard); fp8: FP8 weights or KV (--quantization, --kv-cache-dtype)."""
    folder = model_folder(model)
    cfg = engine_config(
        folder, device, grid, dtype, attention_backend, tensor_parallel_size=tp.size, fp8=fp8
    )
    mcfg = cfg.model_config(tp.size)
    torch_dtype = resolve_dtype(dtype, mcfg, device.type)
    ceil = measure_ceilings(device, torch_dtype, quick)
    if tp.enabled:
        ceil.link_gbps = measure_link(tp, device, quick)
    log.info(
        "ceilings: copy %.0f GB/s, matmul %.1f TFLOP/s%s",
        ceil.copy_gbps,
        ceil.matmul_tflops,
        f", link {ceil.link_gbps:.1f} GB/s" if ceil.link_gbps else "",
    )
    engine = start_engine(cfg, tp)
    try:
        cost = ModelCost.of(mcfg, torch_dtype, cfg.block_size, cfg.kv_dtype(torch_dtype))
        report = Report(
            device_info(device).name,
            os.path.basename(folder.rstrip("/")) + (fp8.suffix if fp8 else ""),
            str(torch_dtype).split(".")[-1],
            ceil,
            meta={**run_meta(engine, cfg), "tensor_parallel_size": tp.size},
        )
        ways = [True, False] if engine.runner.graphs is not None else [False]
        for graphs in ways:
            for context in grid.contexts:
                for batch in grid.batches:
                    report.points.append(
                        time_decode(engine, cost, ceil, batch, context, graphs, grid.repeat)
                    )
        for prompt in grid.prompts:
            report.points.append(
                time_prefill(
                    engine, cost, ceil, prompt, grid.prefill_tokens, max(3, grid.repeat // 4)
                )
            )
        for new, cached in grid.appends:
            for graphs in ways:
                report.points.append(
                    time_append(engine, cost, ceil, new, cached, graphs, max(3, grid.repeat // 2))
                )
        for decodes, context, new, cached in grid.mixed:
            for graphs in ways:
                report.points.append(
                    time_mixed(
                        engine,
                        cost,
                        ceil,
                        decodes,
                        context,
                        new,
                        cached,
                        graphs,
                        max(3, grid.repeat // 2),
                    )
                )
            if engine.runner.backend.name == "triton":
                # Graphs keep the launch they were captured with: the other one is timed eagerly
                # (its device time says which launch is faster, the host's cost apart).
                other = "sequential" if triton_backend.MIXED_LAUNCH == "fused" else "fused"
                with mixed_launch(other):
                    report.points.append(
                        time_mixed(
                            engine,
                            cost,
                            ceil,
                            decodes,
                            context,
                            new,
                            cached,
                            False,
                            max(3, grid.repeat // 2),
                            launch=other,
                        )
                    )
        return report
    finally:
        release_engine(engine)


def run_meta(engine: Engine, cfg: EngineConfig) -> dict:
    """What a report keeps of the run's software and engine: versions, attention backend, KV pool,
    threads."""
    meta = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host_cpus": os.cpu_count(),
        "attention_backend": engine.runner.backend.name,
        "kv_blocks": engine.num_kv_blocks,
        "block_size": cfg.block_size,
        "kv_plan": engine.plan.summary,
        "threads": torch.get_num_threads(),
    }
    if engine.device.type == "cpu":
        meta["cpu_build"] = cpu_build()
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    return meta


def cpu_build() -> str:
    """Which build of our CPU kernels ran (engine/cpu_isa.py) and the instruction set PyTorch's
    kernels ran with."""
    limits = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")
    held = [f"{name}={os.environ[name]}" for name in limits if os.environ.get(name)]
    return f"our kernels: {isa()} build; PyTorch's: {torch.backends.cpu.get_cpu_capability()}" + (
        f" ({', '.join(held)})" if held else ""
    )


# ---- output --------------------------------------------------------------------------------------


def to_json(report: Report) -> dict:
    data = asdict(report)
    for point, raw in zip(report.points, data["points"]):
        raw["ratio"] = point.ratio
    return data


def markdown(report: Report) -> str:
    c = report.ceilings
    n = report.meta.get("tensor_parallel_size", 1)
    lines = [
        f"# Engine benchmark: {report.model} ({report.dtype}) on {report.device}"
        + (f", tensor parallelism {n}" if n > 1 else ""),
        "",
        f"Ceilings measured in the same run: copy {c.copy_gbps:.0f} GB/s (read + write), "
        f"matmul {c.matmul_tflops:.1f} TFLOP/s"
        + (
            f", link {c.link_gbps:.2f} GB/s sent per rank (an all-reduce's bus bandwidth)"
            if c.link_gbps
            else ""
        )
        + ". Floor = max(bytes / bandwidth, FLOPs / matmul rate); every time is the median of "
        "repeated runs."
        + (
            f" Each of the {n} ranks holds 1/{n} of the model: a step's floor is one rank's shard "
            "against one "
            "rank's ceilings; its collectives (two all-reduces a layer, the embedding's, the "
            "logits' all-gather) "
            "are timed in a pass of their own, each waited for, against their floor: the bytes a "
            "rank sends over "
            "the link's bandwidth."
            if n > 1
            else ""
        )
        + (
            f" {report.rounds} rounds, each measuring the ceilings and then the grid: times, "
            "floors and ceilings "
            "are the medians over the rounds, time / floor the median of each round's ratio."
            if report.rounds > 1
            else ""
        )
        + (f" CPU: {report.meta['cpu_build']}." if report.meta.get("cpu_build") else "")
        + (
            " A mixture of experts' floor reads the experts its step's tokens routed to (counted "
            "from the router's choices in an eager run of the same step, random token ids; shown "
            "per MoE layer in the shape) and multiplies each token by its top-k experts."
            if any(p.experts_per_layer is not None for p in report.points)
            else ""
        ),
        "",
        "Host ms: until the step is queued on the device; device ms: the time it keeps the device "
        "busy, queued "
        "behind a sleep so that no host time is in it (CUDA only); pipelined ms: a step's time "
        "when each is "
        "launched before the one before is taken, as `--async-scheduling` runs them (a step then "
        "costs about "
        "the larger of its host and device time).",
        "",
        "| step | shape | time ms | host ms | device ms | pipelined ms | floor ms (bound) | time / "
        "floor | tokens/s |"
        + (" collectives ms | their floor ms | collectives / floor |" if n > 1 else ""),
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
        + (" ---: | ---: | ---: |" if n > 1 else ""),
    ]
    for p in report.points:
        shape = ", ".join(f"{k} {v}" for k, v in p.label.items())
        if p.experts_per_layer is not None:
            shape += f", experts {p.experts_per_layer:.1f}/layer"
        if p.skipped:
            lines.append(
                f"| {p.kind} | {shape} | skipped: {p.skipped} | | | | | | |"
                + (" | | |" if n > 1 else "")
            )
            continue
        host, device, pipelined = (
            f"{v:.3f}" if v is not None else "" for v in (p.host_ms, p.device_ms, p.pipelined_ms)
        )
        comm = ""
        if n > 1 and p.comm_ms is not None:
            floor = p.comm_floor_ms or 0.0
            comm = (
                f" {p.comm_ms:.3f} | {floor:.4f} | {p.comm_ms / floor:.1f} |"
                if floor
                else f" {p.comm_ms:.3f} | | |"
            )
        lines.append(
            f"| {p.kind} | {shape} | {p.ms:.3f} | {host} | {device} | {pipelined} | "
            f"{p.floor_ms:.3f} ({p.floor_bound}) | "
            f"{p.ratio:.2f} | {p.tokens_per_s:,.0f} |{comm}"
        )
    mixed = [p for p in report.points if p.sequential_floor_ms and p.ms is not None]
    if mixed:
        lines += [
            "",
            "A mixed step's floor above assumes its attention's KV reads overlap its GEMMs' "
            "compute; run "
            "kernel after kernel (each GEMM, then the decodes' attention, then the append's), each "
            "at its own "
            "floor, the best it can do is the sequential floor:",
            "",
            "| step | shape | time ms | overlap floor ms | sequential floor ms | time / sequential "
            "floor |",
            "| --- | --- | ---: | ---: | ---: | ---: |",
        ]
        for p in mixed:
            shape = ", ".join(f"{k} {v}" for k, v in p.label.items())
            lines.append(
                f"| {p.kind} | {shape} | {p.ms:.3f} | {p.floor_ms:.3f} | "
                f"{p.sequential_floor_ms:.3f} | "
                f"{p.ms / p.sequential_floor_ms:.2f} |"
            )
    return "\n".join(lines) + "\n"


def write(report: Report, out: Path) -> tuple[Path, Path]:
    return write_results(out, f"engine-{report.model}", to_json(report), markdown(report))


def write_results(out: Path, stem: str, data: dict, md: str) -> tuple[Path, Path]:
    """out/stem.json and out/stem.md (out made if missing)."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
    json_path.write_text(json.dumps(data, indent=2) + "\n")
    md_path.write_text(md)
    return json_path, md_path


def add_engine_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "cpu", "triton"],
        help="auto: triton on CUDA, cpu on the CPU",
    )
    p.add_argument(
        "--out",
        default=None,
        help="folder for the JSON and markdown (default: $PPD_RESULTS_DIR, else ./ppd-results, "
        "/<device>)",
    )
    p.add_argument("--quick", action="store_true", help="a tiny grid (seconds; what the tests run)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the grid this many times, ceilings included, and report medians (a shared "
        "machine)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="ranks that each hold 1/N of the model (a GPU each, or an equal part of the CPU's "
        "cores), "
        "stepping together; reports each step's collectives against their floor",
    )
    p.add_argument(
        "--quantization", "-q", default=None, choices=["fp8"], help="fp8: FP8 weights (as serve's)"
    )
    p.add_argument("--fp8-activations", default="dynamic", choices=["dynamic", "none"])
    p.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="fp8: an FP8 KV cache"
    )


def main(args: argparse.Namespace) -> None:
    device = chosen_device(args)
    model = chosen_model(args, device)
    grid = QUICK_GRID if args.quick else (GPU_GRID if device.type == "cuda" else CPU_GRID)
    if grid is GPU_GRID and ModelConfig.from_folder(model_folder(model)).is_moe:
        grid = MOE_GPU_GRID
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1 (got {args.rounds})")
    if args.tensor_parallel_size > 1:
        report = run_ranks(args, model, device, grid)
    else:
        report = merge_rounds(
            [
                run(
                    model,
                    device,
                    grid,
                    args.dtype,
                    args.quick,
                    args.attention_backend,
                    fp8=Fp8Options.of(args),
                )
                for _ in range(args.rounds)
            ]
        )
    out = Path(args.out or results_dir() / device_slug(device))
    json_path, md_path = write(report, out)
    print(markdown(report))
    print(f"written to {json_path} and {md_path}")


def run_ranks(args: argparse.Namespace, model: str, device: torch.device, grid: Grid) -> Report:
    """The grid on --tensor-parallel-size ranks, a process each; rank 0's report (its times are the
    unit's: every step ends with the ranks' collectives)."""
    import multiprocessing as mp
    import tempfile

    n = args.tensor_parallel_size
    try:
        ModelConfig.from_folder(model_folder(model)).sharded(n)
    except ModelError as exc:
        raise SystemExit(str(exc)) from exc
    if device.type == "cuda" and torch.cuda.device_count() < n:
        raise SystemExit(
            f"--tensor-parallel-size {n}: only {torch.cuda.device_count()} GPU(s) visible"
        )
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="ppd-bench-tp-") as folder:
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(rank, n, f"{folder}/store", args, model, device.type, grid, results),
            )
            for rank in range(n)
        ]
        for p in procs:
            p.start()
        report, error = results.get()
        for p in procs:
            p.join()
    if error is not None:
        raise SystemExit(f"a rank failed: {error}")
    return report


def _rank_main(
    rank: int,
    size: int,
    store: str,
    args: argparse.Namespace,
    model: str,
    kind: str,
    grid: Grid,
    results,
) -> None:
    """One rank of run_ranks: its GPU (the rank-th visible one) or its part of the cores, then the
    rounds."""
    import traceback

    from partition.cpu import available_cores, pin_to_cores, rank_cores

    try:
        if kind == "cuda":
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            gpus = visible.split(",") if visible else [str(i) for i in range(size)]
            os.environ["CUDA_VISIBLE_DEVICES"] = gpus[rank]
        else:
            pin_to_cores(rank_cores(tuple(available_cores()), rank, size))
        tp = init_tensor_parallel(size, rank, store, kind)
        report = merge_rounds(
            [
                run(
                    model,
                    torch.device(kind),
                    grid,
                    args.dtype,
                    args.quick,
                    args.attention_backend,
                    tp,
                    Fp8Options.of(args),
                )
                for _ in range(args.rounds)
            ]
        )
        if rank == 0:
            results.put((report, None))
    except BaseException as exc:  # noqa: BLE001 - reported by rank 0's parent
        results.put((None, f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
