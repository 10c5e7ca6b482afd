"""A device's engine: the model, its weights and KV pool, the step runner and the sampler, started
in order.

The decode worker (or a single process) creates one: load the weights into a
shareable arena, measure memory, size the KV pool, allocate and bind it, warm
up, capture the CUDA graphs. The prefill worker attaches to it: it maps the
same arena and pool (nothing is copied or loaded), warms up on a scratch
pool of its own, so that compiling its kernels never writes into shared blocks,
then captures its own graphs of steps up to max_graph_tokens tokens.

Under tensor parallelism each rank of a role makes its own engine over its
device's shard (create or attach with its TensorParallel); rank 0's engine sends
each step's inputs to its followers (Engine.lead) before running the step, and a
follower runs them in Engine.follow, so that every rank's collectives meet.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import ModelConfig, resolve_dtype
from engine.cuda_graphs import DEFAULT_GRAPH_TOKENS, MAX_GRAPH_TOKENS, graph_buckets
from engine.faults import inject_fault
from engine.guided import GuidedDecoding
from engine.kv_tier import KVCopy, TierStore, block_nbytes, tier_capacity
from engine.loader import arena_nbytes, bind_arena, build_model, kv_scales, load_weights
from engine.memory_plan import (
    GiB,
    KVPlan,
    MemoryMeasurement,
    StartupError,
    check_free_at_start,
    plan_from_measurement,
    plan_from_request,
)
from engine.model import Model, kv_block_nbytes, kv_pool_shape
from engine.model_runner import ModelRunner, StepInput
from engine.parallel import SINGLE, FollowerLink, TensorParallel, receive
from engine.prompt_logprobs import prompt_logprobs
from engine.quant import FP8, QuantError, kv_cache_dtype
from engine.sampler import Drawn, Row, Sampled, Sampler, SampleRow
from engine.sampling_params import MAX_LOGPROBS, RequestFailure, SamplingParams, TokenLogprobs
from engine.shared_memory import SharedHandle, create_shared, open_shared

log = logging.getLogger("ppd.engine")

MAX_FAILED_STEPS = (
    3  # steps in a row where every input fails before step_each gives up on the engine
)


class InputFailure(str):
    """Why an input of a step failed (step_each), and the HTTP status its request ends with: 400 for
    a reason of the request's own (RequestFailure: its grammar, a guided request a worker without
    a tokenizer cannot run), 500 otherwise."""

    status: int

    def __new__(cls, why: str, status: int = 500) -> InputFailure:
        failure = super().__new__(cls, why)
        failure.status = status
        return failure


class UnitFault(RuntimeError):
    """The engine cannot go on: its process must end, and the launcher restarts the unit's processes
    together."""


@dataclass(frozen=True)
class EngineConfig:
    """Everything a device's start-up needs; the launcher builds it from the command line."""

    model: str  # a model folder
    dtype: str = "auto"
    load_format: str = "auto"
    device: str = "cpu"  # "cpu", or "cuda" (the process's one visible GPU)
    attention_backend: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None  # the pool, when the operator fixed it
    kv_cache_memory: float | None = None  # GiB, when the operator fixed it
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None  # None: the model's, capped by the pool
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enforce_eager: bool = False
    max_graph_tokens: int = (
        DEFAULT_GRAPH_TOKENS  # steps of up to this many tokens replay CUDA graphs (0: decode only)
    )
    shares_device: bool = True  # a prefill worker runs on the same device (reserve its activations)
    tokenizer: str | None = (
        None  # the tokenizer's folder, for structured outputs (None: they are refused)
    )
    tensor_parallel_size: int = 1  # devices a unit spans (each holds a shard; engine/parallel.py)
    cublas_sm_target: bool = (
        False  # capture each graph set with cuBLAS(Lt) told its split's SMs (--cublas-sm-target)
    )
    quantization: str | None = None  # "fp8": linear weights in FP8 (engine/quant.py)
    fp8_activations: str = "dynamic"  # FP8 weights' activations: "dynamic" (W8A8) or "none"
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8": e4m3 with per-layer scales
    seed: int | None = None  # the sampling of requests without a seed (--seed); None: random

    def model_config(self, tp_size: int = 1) -> ModelConfig:
        """The model as this engine holds it: quantized as asked, tp_size's shard."""
        cfg = ModelConfig.from_folder(self.model)
        return cfg.quantized(self.quantization, self.fp8_activations).sharded(tp_size)

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV pool's dtype (--kv-cache-dtype)."""
        try:
            return kv_cache_dtype(self.kv_cache_dtype, model_dtype)
        except QuantError as e:
            raise StartupError(str(e)) from e


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # "cpu" or "cuda"
    name: str
    total_memory: int  # bytes (0 on the CPU: the host's memory is not ours to plan)


class Engine:
    """Runs steps: forward over a batch of StepInputs, then one sampled token per sampling input."""

    def __init__(
        self,
        cfg: EngineConfig,
        mcfg: ModelConfig,
        runner: ModelRunner,
        plan: KVPlan,
        handles: tuple[SharedHandle, SharedHandle],
    ) -> None:
        self.cfg, self.mcfg, self.runner, self.plan = cfg, mcfg, runner, plan
        self.weights_handle, self.kv_handle = handles
        self.device = runner.device
        guided = GuidedDecoding(
            cfg.tokenizer, mcfg.vocab_size, mcfg.eos_token_ids, pin=self.device.type == "cuda"
        )
        self.sampler = Sampler(mcfg.eos_token_ids, guided, seed=cfg.seed)
        self._failed_steps = 0
        self.followers: FollowerLink | None = (
            None  # tensor-parallel rank 0: where each step's inputs go first (lead)
        )
        self.tier: TierStore | None = None  # the second KV tier's bytes on this rank (add_tier)

    # ---- start-up --------------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        cfg: EngineConfig,
        names: tuple[str, str] = ("ppd-weights", "ppd-kv"),
        graph_streams: dict[Any, torch.cuda.Stream] | None = None,
        graph_sms: dict[Any, int] | None = None,
        tp: TensorParallel = SINGLE,
    ) -> Engine:
        """Owner start-up (the decode worker): names are the host names of the weights and KV memory
        on the CPU; graph_streams: capture one graph set on each of these streams (green-context
        splits), its decode KV splits sized for graph_sms[key] SMs (missing: the whole device);
        tp: this rank's communicator (its shard is loaded, and the KV pool is sized to what fits
        on every rank's device)."""
        if not 0 <= cfg.max_graph_tokens <= MAX_GRAPH_TOKENS:
            raise StartupError(
                f"max_graph_tokens {cfg.max_graph_tokens} is out of range: give 0 (graphs for "
                "decode "
                f"steps only) up to {MAX_GRAPH_TOKENS}"
            )
        started = time.monotonic()
        device = torch.device(cfg.device)
        mcfg = cfg.model_config(tp.size)
        dtype = resolve_dtype(cfg.dtype, mcfg, cfg.device)
        kv_dtype = cfg.kv_dtype(dtype)
        _check_fp8_device(device, mcfg, kv_dtype)
        others = 0
        if device.type == "cuda" and cfg.num_kv_blocks is None and cfg.kv_cache_memory is None:
            # this process's cached blocks are free for the share, not held by others
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(device)
            check_free_at_start(free, total, cfg.gpu_memory_utilization, device_info(device).name)
            others = total - free
        model = build_model(mcfg, dtype)
        model.tp = tp
        arena, weights_handle = create_shared(names[0], (arena_nbytes(model),), torch.uint8, device)
        bind_arena(model, arena)
        load_weights(model, cfg.model, cfg.load_format)
        log.info(
            "weights: %.2f GiB on %s in %.1fs%s",
            arena.numel() / GiB,
            device_info(device).name,
            time.monotonic() - started,
            f" ({mcfg.quantization.describe()})" if mcfg.quantization else "",
        )
        _set_kv_scales(model, cfg, kv_dtype, log_them=tp.rank == 0)

        block_bytes = kv_block_nbytes(mcfg, cfg.block_size, kv_dtype)
        max_len = cfg.max_model_len or mcfg.max_position_embeddings
        if device.type == "cuda":
            # Measure and warm up on a private scratch pool, then free it before the real pool is
            # made.
            scratch = _scratch_pool(mcfg, cfg, kv_dtype, device)
            runner = ModelRunner(
                model, scratch, cfg.block_size, cfg.attention_backend, max_model_len=max_len
            )
            if cfg.num_kv_blocks is None and cfg.kv_cache_memory is None:
                measured = _measure(
                    runner,
                    cfg,
                    arena.numel(),
                    scratch.numel() * scratch.element_size(),
                    others,
                    len(graph_streams) if graph_streams else 1,
                )
                plan = plan_from_measurement(
                    measured,
                    cfg.gpu_memory_utilization,
                    block_bytes,
                    cfg.block_size,
                    mcfg.max_position_embeddings,
                    cfg.max_model_len,
                    device_info(device).name,
                )
                _warm_up_kernels(runner)
            else:
                _warm_up(runner, cfg)
                plan = plan_from_request(
                    cfg.num_kv_blocks,
                    cfg.kv_cache_memory,
                    block_bytes,
                    cfg.block_size,
                    mcfg.max_position_embeddings,
                    cfg.max_model_len,
                )
            model.unbind_kv_cache()
            del scratch, runner.kv_pool
            torch.cuda.empty_cache()
        else:
            plan = plan_from_request(
                cfg.num_kv_blocks,
                cfg.kv_cache_memory,
                block_bytes,
                cfg.block_size,
                mcfg.max_position_embeddings,
                cfg.max_model_len,
            )
        if tp.enabled and (fewest := tp.min_over_ranks(plan.num_blocks)) < plan.num_blocks:
            # Rank 0's block manager hands out block ids that every rank's pool must hold.
            plan = plan_from_request(
                fewest,
                None,
                block_bytes,
                cfg.block_size,
                mcfg.max_position_embeddings,
                cfg.max_model_len,
            )
        log.info("%s; max_model_len %d", plan.summary, plan.max_model_len)

        kv_pool, kv_handle = create_shared(
            names[1], kv_pool_shape(mcfg, plan.num_blocks, cfg.block_size), kv_dtype, device
        )
        if device.type == "cuda":
            runner.max_model_len = plan.max_model_len
            runner.bind_kv_cache(kv_pool)
            if not cfg.enforce_eager and runner.backend.supports_cuda_graphs:
                runner.capture_graphs(
                    cfg.max_num_seqs,
                    graph_streams,
                    graph_sms,
                    cfg.max_graph_tokens,
                    sm_target=cfg.cublas_sm_target,
                )
        else:
            runner = _warmed_cpu_runner(model, mcfg, cfg, kv_dtype, plan.max_model_len)
            runner.bind_kv_cache(kv_pool)
        log.info("engine ready in %.1fs", time.monotonic() - started)
        return cls(cfg, mcfg, runner, plan, (weights_handle, kv_handle))

    @classmethod
    def attach(
        cls,
        cfg: EngineConfig,
        weights: SharedHandle,
        kv: SharedHandle,
        num_kv_blocks: int,
        max_model_len: int,
        tp: TensorParallel = SINGLE,
    ) -> Engine:
        """Peer start-up (the prefill worker): map the owner's weights and pool (of num_kv_blocks
        blocks, sized for max_model_len); warm up on a private scratch pool. tp: this rank's
        communicator (the owner is the decode rank of the same device)."""
        device = torch.device(cfg.device)
        mcfg = cfg.model_config(tp.size)
        dtype = resolve_dtype(cfg.dtype, mcfg, cfg.device)
        kv_dtype = cfg.kv_dtype(dtype)
        block_bytes = kv_block_nbytes(mcfg, cfg.block_size, kv_dtype)
        plan = KVPlan(
            num_kv_blocks,
            block_bytes,
            cfg.block_size,
            max_model_len,
            f"KV cache: {num_kv_blocks} blocks mapped from the decode worker",
        )
        model = build_model(mcfg, dtype)
        model.tp = tp
        bind_arena(model, open_shared(weights))
        _set_kv_scales(model, cfg, kv_dtype)
        if device.type == "cuda":
            runner = ModelRunner(
                model,
                _scratch_pool(mcfg, cfg, kv_dtype, device),
                cfg.block_size,
                cfg.attention_backend,
                max_model_len=plan.max_model_len,
            )
            _warm_up(runner, cfg)
            model.unbind_kv_cache()
            del runner.kv_pool
            torch.cuda.empty_cache()
            runner.bind_kv_cache(open_shared(kv))
            if (
                not cfg.enforce_eager
                and cfg.max_graph_tokens
                and runner.backend.supports_cuda_graphs
            ):
                runner.capture_graphs(
                    cfg.max_num_seqs,
                    max_tokens=cfg.max_graph_tokens,
                    decode=False,
                    sm_target=cfg.cublas_sm_target,
                )
        else:
            runner = _warmed_cpu_runner(model, mcfg, cfg, kv_dtype, plan.max_model_len)
            runner.bind_kv_cache(open_shared(kv))
        # every rank has mapped its pool before rank 0 says the worker is ready (its names may then
        # go)
        tp.barrier()
        return cls(cfg, mcfg, runner, plan, (weights, kv))

    @classmethod
    def sibling(
        cls,
        owner: Engine,
        graph_streams: dict[Any, torch.cuda.Stream] | None = None,
        graph_sms: dict[Any, int] | None = None,
        tp: TensorParallel = SINGLE,
    ) -> Engine:
        """A second engine over owner's weights and KV pool in the same process (the prefill thread
        of a one-process unit): its own runner (attention metadata) and sampler, nothing mapped
        or copied. On a GPU it captures its own graphs of steps up to max_graph_tokens tokens,
        one set on each of graph_streams (its streams of the green splits; graph_sms as for
        create), while the owner's thread may already run steps of its own. tp: the prefill
        ranks' communicator of a tensor-parallel unit: the sibling's model is then its own object
        over the owner's arena (the same weights, its own collectives)."""
        cfg = owner.cfg
        model = owner.runner.model
        if tp.enabled:
            arena = torch.empty(0, dtype=torch.uint8, device=owner.device)
            arena.set_(
                next(model.parameters()).untyped_storage()
            )  # every parameter is a view of the one arena
            scales = [layer.self_attn.kv_scales for layer in model.model.layers]
            model = build_model(owner.mcfg, model.dtype)
            model.tp = tp
            bind_arena(model, arena)
            model.set_kv_scales(scales)
        runner = ModelRunner(
            model,
            owner.runner.kv_pool,
            cfg.block_size,
            cfg.attention_backend,
            max_model_len=owner.plan.max_model_len,
        )
        if (
            runner.device.type == "cuda"
            and not cfg.enforce_eager
            and cfg.max_graph_tokens
            and runner.backend.supports_cuda_graphs
        ):
            runner.capture_graphs(
                cfg.max_num_seqs,
                graph_streams,
                graph_sms,
                cfg.max_graph_tokens,
                decode=False,
                sm_target=cfg.cublas_sm_target,
            )
        return cls(cfg, owner.mcfg, runner, owner.plan, (owner.weights_handle, owner.kv_handle))

    # ---- steps -----------------------------------------------------------------------------------

    def step_each(
        self, inputs: list[StepInput], rows: list[SampleRow]
    ) -> tuple[Sampled, dict[int, InputFailure]]:
        """step(), but a failure ends only the inputs that fail: when the batch raises, each input
        runs again alone (rewriting its KV slots with the same values), and those that still
        raise are returned as {input position: error} with None for their token. Raises when
        every input fails in MAX_FAILED_STEPS steps in a row, none of them for a reason of its
        own request (RequestFailure): the engine itself is broken (on a GPU, a fault poisons the
        context), and the process must restart. A step that raised may have left work on the
        device (a grammar fails after the forward pass was launched): it is waited for before the
        next step or the return, so that a failed input's KV writes are done before its blocks
        are freed and handed to the other worker, whose stream does not wait for ours, and the
        pinned staging buffers are not refilled under a pending copy."""
        try:
            sampled = self.step(inputs, rows)
            self._failed_steps = 0
            return sampled, {}
        except Exception as exc:  # noqa: BLE001 - sorted out below, per input
            if self.followers is not None and not isinstance(exc, RequestFailure):
                # A forward pass that failed here may have failed on this rank alone, its followers
                # waiting in a collective it never joined: no retry can meet them. The unit restarts
                # (every rank, together).
                raise UnitFault(
                    f"tensor-parallel rank 0's step failed ({type(exc).__name__}: {exc}); the unit "
                    "restarts"
                ) from exc
            log.warning(
                "a step of %d input(s) failed (%s: %s); running them one by one",
                len(inputs),
                type(exc).__name__,
                exc,
                exc_info=log.isEnabledFor(logging.DEBUG),  # the trace at --log-level debug
            )
            batch_error = exc
            self._wait_for_device()
        tokens: list[int | None] = []
        logprobs: list[TokenLogprobs | None] = []
        prompt: dict[int, list[TokenLogprobs]] = {}
        failed, k, own_failures = {}, 0, 0
        for pos, inp in enumerate(inputs):
            one = slice(k, k + 1) if inp.sample else slice(k, k)
            k += inp.sample
            try:
                got = self.step([inp], rows[one])
                tokens += got.tokens
                logprobs += got.logprobs
                if got.prompt_logprobs:
                    prompt[pos] = got.prompt_logprobs[0]
            except Exception as exc:  # noqa: BLE001
                self._wait_for_device()
                failed[pos] = InputFailure(
                    f"{type(exc).__name__}: {exc}", 400 if isinstance(exc, RequestFailure) else 500
                )
                tokens += [None] * inp.sample
                logprobs += [None] * inp.sample
                own_failures += isinstance(exc, RequestFailure)
        if len(failed) < len(inputs) or own_failures:
            self._failed_steps = 0
        else:
            self._failed_steps += 1
            if self._failed_steps >= MAX_FAILED_STEPS:
                raise RuntimeError(
                    f"{MAX_FAILED_STEPS} steps in a row failed for every input"
                ) from batch_error
        return Sampled(tokens, logprobs, prompt), failed  # type: ignore[arg-type]

    def step(self, inputs: list[StepInput], rows: list[SampleRow]) -> Sampled:
        """Run one forward pass and sample a token for each input with sample=True (rows: their
        requests, in that order); returns once the step's tokens, and so its KV, are done (launch,
        then Launched.result)."""
        return self.launch(inputs, rows).result()

    def launch(
        self, inputs: list[StepInput], rows: list[SampleRow], previous: Launched | None = None
    ) -> Launched:
        """Queue one forward pass and the sampling of a token for each input with sample=True (rows:
        their requests, in that order) on the device, and the copy of the tokens to the host;
        returns without waiting for the device. previous: the step launched before, whose tokens the
        inputs with `previous` set take on the device (async scheduling: this step was scheduled
        before that one's tokens reached the host). The grammar masks are filled on the host while
        the pass runs. Tensor-parallel rank 0 sends the inputs to its followers first; only it
        samples, from the logits every rank holds alike (a follower cannot take tokens it never
        sampled: no `previous` there)."""
        if self.followers is not None:
            assert previous is None, "tensor-parallel followers do not hold the sampled tokens"
            self.followers.send("step", (inputs, self.runner.graph_key))
        masks = self.sampler.start_masks(rows)
        logits, prompt = self.forward(inputs, None if previous is None else previous.tokens)
        drawn = self.sampler.draw(logits, rows, masks) if rows else None
        return Launched(drawn, prompt, self.device)

    def forward(
        self, inputs: list[StepInput], previous: Any = None
    ) -> tuple[Any, dict[int, list[TokenLogprobs]]]:
        """The step's forward pass: logits, and the prompt logprobs its inputs ask for (whose logits
        are the model's too: every tensor-parallel rank computes them). previous: as for
        ModelRunner.run."""
        logits, hidden = self.runner.run(inputs, previous)
        prompt = {}
        if hidden is not None:  # its copy to the host waits for the step
            asks = [
                (pos, inp.prompt_logprobs)
                for pos, inp in enumerate(inputs)
                if inp.prompt_logprobs is not None
            ]
            prompt = prompt_logprobs(
                self.runner.model, self.runner.backend.ops, hidden, asks, self.cfg.max_num_seqs
            )
        return logits, prompt

    def add_tier(self, size_gib: float, folder: str | None = None) -> TierStore:
        """Give this rank a second KV tier of size_gib (engine/kv_tier.py) behind its pool."""
        pool = self.runner.kv_pool
        nbytes = block_nbytes(pool)
        capacity = tier_capacity(size_gib, nbytes)
        if capacity < 1:
            raise StartupError(
                f"--kv-offloading-size {size_gib:g} GiB holds no KV block of {nbytes} bytes "
                "per rank; give at least one block's worth"
            )
        self.tier = TierStore(pool, capacity, None if folder is None else Path(folder))
        return self.tier

    def copy_kv(self, copies: list[KVCopy]) -> Any:
        """Run the block manager's copies between the pool and the tier on every rank
        (TierStore.run: done on return on the CPU, else the event that marks their end)."""
        assert self.tier is not None, "copies without a tier"
        if self.followers is not None:
            self.followers.send("kv_copy", copies)
        inject_fault("kv-tier-copy")
        return self.tier.run(copies)

    def lead(self, followers: FollowerLink) -> None:
        """Tensor-parallel rank 0: every step from now on runs on the followers too."""
        self.followers = followers

    def follow(self, sock: Any, on_command: Any = None, on_stream: Any = None) -> None:
        """A tensor-parallel follower's life: run each step rank 0 sends (its sampling and
        scheduling are rank 0's) with the graphs of the stream rank 0 ran it on (on_stream(key):
        the context that runs it there, in a one-process unit on a GPU), and hand any other
        message to on_command(kind, payload), for as long as the process lives (the launcher
        stops a unit's ranks together). A step that fails here may fail on this rank alone (its
        memory, its device), leaving the others in a collective it never joins: it raises
        UnitFault, the process ends and the launcher restarts every rank of the unit."""
        while True:
            kind, payload = receive(sock)
            if kind == "step":
                inputs, key = payload
                try:
                    inject_fault("follower-step")
                    self.runner.use_graphs(key)
                    with on_stream(key) if on_stream is not None else contextlib.nullcontext():
                        self.forward(inputs)
                        self._wait_for_device()
                except Exception as exc:
                    raise UnitFault(
                        f"tensor-parallel rank {self.runner.model.tp.rank}'s step failed "
                        f"({type(exc).__name__}: {exc}); the unit restarts"
                    ) from exc
            elif kind == "kv_copy" and self.tier is not None:
                if (done := self.tier.run(payload)) is not None:
                    done.synchronize()  # rank 0 orders its own; a follower just waits
            elif on_command is not None:
                on_command(kind, payload)

    def _wait_for_device(self) -> None:
        """Wait until the work this thread enqueued (on its current stream) has run; nothing to wait
        for on the CPU."""
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    def prepare(self, request_id: str, sampling: SamplingParams) -> None:
        """A request arrived: start what its sampling needs before its first sample (its grammar's
        compile, which then runs while the prompt is prefilled)."""
        if sampling.guided is not None:
            self.sampler.guided.start(request_id, sampling.guided)  # type: ignore[union-attr]

    def release(self, request_id: str) -> None:
        """Forget what sampling kept of a finished request (token counts, grammar state)."""
        self.sampler.release(request_id)

    @property
    def max_model_len(self) -> int:
        return self.plan.max_model_len

    @property
    def num_kv_blocks(self) -> int:
        return self.plan.num_blocks


class Launched:
    """A step queued on the device (Engine.launch): its sampled tokens there (`tokens`, for the next
    step to read), and result() for them on the host."""

    def __init__(
        self, drawn: Drawn | None, prompt: dict[int, list[TokenLogprobs]], device: torch.device
    ) -> None:
        self.drawn, self.prompt = drawn, prompt
        self.tokens = drawn.tokens if drawn is not None else None
        self.event: torch.cuda.Event | None = None
        if drawn is None and device.type == "cuda":  # nothing sampled: wait for the pass itself
            self.event = torch.cuda.Event()
            self.event.record()

    def result(self) -> Sampled:
        """The tokens and logprobs on the host, once the step ran (its KV is then written)."""
        if self.drawn is None:
            if self.event is not None:
                self.event.synchronize()
            return Sampled([], [], self.prompt)
        sampled = self.drawn.host()
        sampled.prompt_logprobs = self.prompt
        return sampled


def device_info(device: torch.device) -> DeviceInfo:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return DeviceInfo("cuda", props.name, props.total_memory)
    return DeviceInfo("cpu", "cpu", 0)


def _dummy_inputs(num_tokens: int, num_seqs: int, block_size: int) -> list[StepInput]:
    """num_seqs sequences sharing num_tokens new tokens, each sampling, over consecutive scratch
    blocks."""
    num_seqs = max(1, min(num_seqs, num_tokens))
    inputs, next_block = [], 0
    for i in range(num_seqs):
        n = num_tokens // num_seqs + (1 if i < num_tokens % num_seqs else 0)
        blocks = -(-n // block_size)
        inputs.append(StepInput([1] * n, 0, list(range(next_block, next_block + blocks))))
        next_block += blocks
    return inputs


def _check_fp8_device(device: torch.device, mcfg: ModelConfig, kv_dtype: torch.dtype) -> None:
    """FP8 on a GPU needs e4m3 in hardware (compute capability 8.9: Ada, Hopper and later): a
    StartupError naming the GPU otherwise."""
    if device.type != "cuda" or (mcfg.quantization is None and kv_dtype != FP8):
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise StartupError(
            f"FP8 weights or KV cache need a GPU of compute capability 8.9 or later (Ada, Hopper); "
            f"{torch.cuda.get_device_name(device)} is {major}.{minor}: leave out --quantization "
            "and --kv-cache-dtype (or serve an unquantized checkpoint)"
        )


def _set_kv_scales(
    model: Model, cfg: EngineConfig, kv_dtype: torch.dtype, log_them: bool = False
) -> None:
    """An FP8 pool's per-layer scales (loader.kv_scales), the same in every process that maps the
    weights."""
    if kv_dtype != FP8:
        return
    scales = kv_scales(model, cfg.model, cfg.load_format)
    model.set_kv_scales(scales)
    if log_them:
        log.info(
            "KV cache in FP8 e4m3: key scales %.3g-%.3g, value scales %.3g-%.3g over %d layers",
            min(k for k, _ in scales),
            max(k for k, _ in scales),
            min(v for _, v in scales),
            max(v for _, v in scales),
            len(scales),
        )


def _scratch_pool(
    mcfg: ModelConfig, cfg: EngineConfig, kv_dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A private pool big enough for the dummy steps of start-up (the largest step, as sequences of
    one block or more)."""
    num_blocks = -(-cfg.max_num_batched_tokens // cfg.block_size) + min(
        cfg.max_num_seqs, cfg.max_num_batched_tokens
    )
    shape = kv_pool_shape(mcfg, num_blocks, cfg.block_size)
    return torch.zeros(shape, dtype=kv_dtype, device=device)


def _warmed_cpu_runner(
    model: Model, mcfg: ModelConfig, cfg: EngineConfig, kv_dtype: torch.dtype, max_model_len: int
) -> ModelRunner:
    """A CPU runner that has run a prefill step and a decode step on a private pool of a few blocks:
    the CPU ops pack each weight for the path that first needs it (oneDNN's layout for steps of
    many rows, AMX's tiles for a decode step's few) and load the kernels, each packing a pass
    over every weight that the first requests would otherwise wait for. The caller binds the real
    pool after."""
    tokens = max(1, min(256, cfg.max_num_batched_tokens, max_model_len - 1))
    blocks = -(-(tokens + 1) // cfg.block_size)
    scratch = torch.zeros(kv_pool_shape(mcfg, blocks, cfg.block_size), dtype=kv_dtype)
    runner = ModelRunner(
        model, scratch, cfg.block_size, cfg.attention_backend, max_model_len=max_model_len
    )
    table = list(range(blocks))
    runner.forward([StepInput([1] * tokens, 0, table)])
    if tokens < max_model_len:
        runner.forward([StepInput([1], tokens, table)])
    return runner


def _largest_step(runner: ModelRunner, cfg: EngineConfig) -> None:
    """The step that needs the most activation memory: the whole token budget, the most sampled
    rows, sampled with top-p (which sorts the logits), penalties (whose per-request token counts
    stay on the device while a request runs) and the most logprobs."""
    inputs = _dummy_inputs(cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.block_size)
    logits = runner.forward(inputs)
    costly = SamplingParams(
        temperature=1.0,
        top_p=0.9,
        repetition_penalty=1.1,
        frequency_penalty=0.1,
        logprobs=MAX_LOGPROBS,
    )
    Sampler(runner.model.cfg.eos_token_ids)(
        logits, [Row(costly, request_id=str(i)) for i in range(len(inputs))]
    )


def _largest_decode(runner: ModelRunner, cfg: EngineConfig) -> None:
    runner.forward(_dummy_inputs(cfg.max_num_seqs, cfg.max_num_seqs, cfg.block_size))


def _largest_graph_step(runner: ModelRunner, cfg: EngineConfig) -> None:
    """The largest step a token bucket captures: max_graph_tokens tokens over as many sequences as
    it holds."""
    runner.forward(
        _dummy_inputs(
            cfg.max_graph_tokens, min(cfg.max_num_seqs, cfg.max_graph_tokens), cfg.block_size
        )
    )


def _warm_up(runner: ModelRunner, cfg: EngineConfig) -> None:
    """Run the shapes a worker will see once, so kernels compile now rather than on the first
    request."""
    _largest_step(runner, cfg)
    _largest_decode(runner, cfg)
    _warm_up_kernels(runner)


def _warm_up_kernels(runner: ModelRunner) -> None:
    """Compile each attention variant a request can select: every prefill tile height, alone, beside
    a decode (the mixed launch) and split over a cached prefix of 1,024 keys; the append tile
    unsplit; every decode split count (tile heights, whether a grid splits and the merge's split
    count are compile-time constants of the kernels)."""
    cfg = runner.model.cfg
    group = cfg.num_heads // cfg.num_kv_heads
    capacity = min(runner.kv_pool.shape[2] * runner.block_size, runner.max_model_len)
    bs = runner.block_size

    def seq(new: int, cached: int = 0) -> StepInput:
        return StepInput([1] * new, cached, list(range(-(-(cached + new) // bs))))

    lengths = {max(2, rows // group) for rows in (16, 32, 64, 128)} | {128 // group + 1}
    for n in sorted(lengths):
        if n + 1 <= capacity:
            runner.forward([seq(n)])
            runner.forward([seq(1, 1), seq(n)])
        if 1024 + n <= capacity:
            runner.forward([seq(n, 1024)])
    if 5 * 1024 <= capacity:  # an append of many query tiles: the append tile unsplit
        runner.forward([seq(1024, 4 * 1024)])
    for context in (256, 512, 1024, 2048, 4096, 8192):
        if context + 1 <= capacity:
            runner.forward([seq(1, context)])
    torch.cuda.synchronize()


def _measure(
    runner: ModelRunner,
    cfg: EngineConfig,
    weights: int,
    scratch: int,
    others: int,
    graph_sets: int = 1,
) -> MemoryMeasurement:
    """Run the largest step and the largest decode step, measuring the memory each needs above what
    is allocated. others: what the device held when the engine started, outside this instance's
    share. graph_sets: graph sets to be captured (one per green split and one whole; each on its
    own stream, whose blocks the allocator does not share with another stream's, so each set is
    counted whole)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _largest_step(runner, cfg)
    torch.cuda.synchronize()
    activation = torch.cuda.max_memory_allocated() - base
    graph_steps = [_largest_decode] + ([_largest_graph_step] if cfg.max_graph_tokens else [])
    peaks = []
    for step in graph_steps:
        torch.cuda.reset_peak_memory_stats()
        step(runner, cfg)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
    # Each set holds the largest captured step's activations (its own stream's blocks of the shared
    # pool; its decode KV-split partials are in the decode step's peak); all sets write one float32
    # logits buffer.
    logits = (
        max(cfg.max_num_seqs, min(cfg.max_num_seqs, cfg.max_graph_tokens))
        * runner.model.cfg.vocab_size
        * 4
    )
    # Each set's static metadata (block tables for the longest context, the KV-split partials its
    # buckets are captured with) is allocated outside the pool, beside it.
    static = runner.backend.graph_metadata_bytes(
        graph_buckets(cfg.max_num_seqs, cfg.max_graph_tokens)
    )
    peer_static = runner.backend.graph_metadata_bytes(
        graph_buckets(cfg.max_num_seqs, cfg.max_graph_tokens, False)
    )
    graphs = 0 if cfg.enforce_eager else graph_sets * (max(peaks) + static) + logits
    # The prefill worker captures steps of up to max_graph_tokens tokens, a set per split stream as
    # here: its own pool and logits buffer.
    peer_graphs = (
        graph_sets * (peaks[-1] + peer_static) + logits
        if cfg.shares_device and cfg.max_graph_tokens and not cfg.enforce_eager
        else 0
    )
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    # The scratch pool is still allocated here, and freed before the real pool is made: it is not in
    # use after.
    return MemoryMeasurement(
        total=total,
        in_use=total - free - scratch - others,
        weights=weights,
        activation_peak=activation,
        graph_peak=graphs,
        peer_activation_peak=activation + peer_graphs if cfg.shares_device else 0,
        others=others,
    )
