"""How many KV blocks a device gets.

On the CPU the pool is what the operator asks for (--num-kv-blocks or
--kv-cache-memory). On a GPU, --gpu-memory-utilization is this instance's share
of the device, as vLLM's flag is: what other processes held when the engine
started is outside it (two servers at 0.5 each share a GPU), and a device
without that much free at start is refused. The pool gets what remains of the
share after everything else this instance uses: what it has in use after
loading (the weights, the peer's CUDA context when it has started by then), the
activation peak of the largest step (measured by running it), as much again for
the prefill worker that shares the device, and the decode graphs' memory pool
(measured as the peak of the largest decode step). A model that does not fit
gets an error that names every number.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 2**30
DEFAULT_CPU_KV_GIB = 0.5


class StartupError(RuntimeError):
    """The engine cannot start with this configuration on this device; the message names the numbers
    and the fix."""


@dataclass(frozen=True)
class MemoryMeasurement:
    """What the start-up measured on a GPU, in bytes."""

    total: int  # the device's memory
    in_use: int  # used on the device by this instance after the weights were loaded (not `others`)
    weights: int
    activation_peak: int  # the largest eager step (token budget, most sampled rows), above weights
    graph_peak: int  # the largest captured decode step, for the graphs' pool (0 without graphs)
    peer_activation_peak: (
        int  # the prefill worker's steps on the same device (0 when there is none)
    )
    others: int = (
        0  # held on the device when the engine started (other processes, this one's CUDA context)
    )


@dataclass(frozen=True)
class KVPlan:
    num_blocks: int
    block_bytes: int
    block_size: int
    max_model_len: int
    summary: str  # one log line: what the pool got and why

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def plan_from_request(
    num_blocks: int | None,
    kv_cache_memory: float | None,
    block_bytes: int,
    block_size: int,
    model_max_len: int,
    max_model_len: int | None,
    default_gib: float = DEFAULT_CPU_KV_GIB,
) -> KVPlan:
    """The pool the operator asked for: num_blocks, else kv_cache_memory GiB, else default_gib."""
    if num_blocks is None:
        num_blocks = (
            int((kv_cache_memory if kv_cache_memory is not None else default_gib) * GiB)
            // block_bytes
        )
    size = gib(num_blocks * block_bytes)
    summary = f"KV cache: {num_blocks} blocks of {block_size} tokens ({size}), as configured"
    return _finish(
        num_blocks,
        block_bytes,
        block_size,
        model_max_len,
        max_model_len,
        summary,
        "raise --kv-cache-memory or --num-kv-blocks, or lower --max-model-len",
    )


def plan_from_measurement(
    m: MemoryMeasurement,
    utilization: float,
    block_bytes: int,
    block_size: int,
    model_max_len: int,
    max_model_len: int | None,
    device_name: str,
) -> KVPlan:
    """The pool a GPU can hold at this utilization after what was measured."""
    allowed = int(m.total * utilization)
    reserved = m.in_use + m.activation_peak + m.peer_activation_peak + m.graph_peak
    num_blocks = max(0, (allowed - reserved) // block_bytes)
    parts = (
        f"{utilization:.2f} x {gib(m.total)} = {gib(allowed)} allowed on {device_name}; in use "
        f"{gib(m.in_use)} "
        f"(weights {gib(m.weights)}), activation peak {gib(m.activation_peak)}"
    )
    if m.peer_activation_peak:
        parts += f", prefill worker's peak {gib(m.peer_activation_peak)}"
    if m.graph_peak:
        parts += f", CUDA graphs {gib(m.graph_peak)}"
    if m.others:
        parts += f"; {gib(m.others)} held before start, outside this share"
    size = gib(num_blocks * block_bytes)
    summary = f"KV cache: {num_blocks} blocks of {block_size} tokens ({size}): {parts}"
    return _finish(
        num_blocks,
        block_bytes,
        block_size,
        model_max_len,
        max_model_len,
        summary,
        "raise --gpu-memory-utilization, lower --max-model-len, --max-num-batched-tokens or "
        "--max-num-seqs, "
        "or use a GPU with more memory",
    )


def check_free_at_start(free: int, total: int, utilization: float, device_name: str) -> None:
    """Refuse a share of the device larger than what is free as the engine starts (other processes
    hold the rest)."""
    if free < utilization * total:
        held = total - free
        raise StartupError(
            f"--gpu-memory-utilization {utilization:.2f} asks for {gib(utilization * total)} of "
            f"{device_name}'s "
            f"{gib(total)}, but only {gib(free)} is free as the engine starts ({gib(held)} is held "
            "by other processes "
            "and this one's CUDA context). Fix: lower --gpu-memory-utilization to at most "
            f"{free / total:.2f}, or stop "
            f"what holds the memory (nvidia-smi lists it)"
        )


def _finish(
    num_blocks: int,
    block_bytes: int,
    block_size: int,
    model_max_len: int,
    max_model_len: int | None,
    summary: str,
    fix: str,
) -> KVPlan:
    capacity = num_blocks * block_size
    if max_model_len is None:
        max_model_len = min(model_max_len, capacity)
    if max_model_len > model_max_len:
        raise StartupError(
            f"--max-model-len {max_model_len} exceeds the model's {model_max_len} positions"
        )
    if capacity < max(max_model_len, 1) or num_blocks < 1:
        need = -(-max(max_model_len, 1) // block_size)
        raise StartupError(
            f"the KV cache cannot hold one sequence of {max_model_len} tokens: {summary}; it needs "
            f"{need} blocks ({gib(need * block_bytes)}). Fix: {fix}"
        )
    return KVPlan(num_blocks, block_bytes, block_size, max_model_len, summary)
