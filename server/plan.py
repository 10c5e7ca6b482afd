"""`ppd serve`'s plan: the command line checked, the model, the units (one per GPU, or shares of the
CPU), their partitions, share managers and profiles, and MPS started and checked where the plan uses
it. final_plan decides all of it once; serve.py then builds from it and changes none of it."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from engine.attention import BACKENDS as ATTENTION_BACKENDS
from engine.config import (
    ModelConfig,
    ModelError,
    check_model_folder,
    resolve_dtype,
    tensor_parallel_sizes,
)
from engine.cuda_graphs import DEFAULT_GRAPH_TOKENS, MAX_GRAPH_TOKENS
from engine.demo import DEMO_MODEL, demo_model_path
from engine.engine import EngineConfig
from engine.gguf import SMOLLM2, GGUFError, gguf_in
from engine.gguf import model_folder as gguf_folder
from engine.kv_events import BlockHasher, KVEventsConfig, KVEventsError, describe
from engine.memory_plan import StartupError, plan_from_request
from engine.model import kv_block_nbytes
from engine.quant import QuantError, kv_cache_dtype
from engine.sampling_params import MAX_LOGPROBS
from engine.shared_memory import SHM_DIR
from partition.backends import BACKENDS, PartitionError, UnitPartition, plan_partitions
from partition.cpu import available_cores
from partition.mps import MpsDaemon, MpsDaemonPlan
from partition.processes import process_alive
from scheduler.config import UnitConfig, has_prefill_worker
from server.vllm_cli import check_vllm_only_args

log = logging.getLogger("ppd")

# ppd's defaults of the settings vLLM names otherwise (vllm_flags): a vLLM flag replaces them
PPD_DEFAULTS = {"max_graph_tokens": DEFAULT_GRAPH_TOKENS}


class UsageError(Exception):
    """A bad command line or model folder: printed, exit code 2."""


@dataclass
class ServePlan:
    units: list[UnitConfig]
    model_name: str
    model_path: str
    tokenizer_path: str | None  # None: --skip-tokenizer-init
    mcfg: ModelConfig
    max_model_len: (
        int  # the configured or planned context; GPU units may report a smaller one when ready
    )
    ipc_dir: str
    device: str
    partition: str  # the backend chosen (partition/backends.py)
    mps: MpsDaemonPlan | None = (
        None  # the MPS daemon the workers use (start=True: the server starts and stops it)
    )
    model_names: tuple[str, ...] = ()  # every --served-model-name (model_name: the first)
    chat_template: str | None = None  # --chat-template's text
    sampling_defaults: dict = field(
        default_factory=dict
    )  # for requests that leave them unset (generation_defaults)


def visible_gpus() -> list[str]:
    """The CUDA devices this process may use, as CUDA_VISIBLE_DEVICES entries (honouring the
    variable)."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [n.strip() for n in listed.split(",")] if listed else [str(i) for i in range(count)]
    return names[:count]


def choose_gpus(args: argparse.Namespace, gpus: list[str], mcfg: ModelConfig) -> list[str]:
    """Each unit's GPUs (CUDA_VISIBLE_DEVICES entries, comma-separated: --tensor-parallel-size of
    them): --gpus (indices into the visible ones), else all; --units takes the first N units. A
    size that does not divide the GPUs is refused naming the sizes that do (and split the model,
    mcfg)."""
    tp = args.tensor_parallel_size
    chosen = _chosen_gpus(args, gpus, tp)
    if len(chosen) % tp:
        fits = [n for n in tensor_parallel_sizes(mcfg, len(chosen)) if len(chosen) % n == 0]
        raise UsageError(
            f"--tensor-parallel-size {tp} does not divide the {len(chosen)} GPU(s) to serve on: "
            "use one "
            f"of {', '.join(map(str, fits))}, or pick GPUs with --gpus"
        )
    return [",".join(chosen[i : i + tp]) for i in range(0, len(chosen), tp)]


def _chosen_gpus(args: argparse.Namespace, gpus: list[str], tp: int) -> list[str]:
    """The GPUs to serve on, in order: --gpus (indices into the visible ones), else all; --units
    takes the first."""
    chosen = gpus
    if args.gpus:
        try:
            picks = [int(i) for i in args.gpus.split(",")]
        except ValueError as exc:
            raise UsageError(
                f"--gpus {args.gpus!r}: expected comma-separated indices, e.g. --gpus 0,1"
            ) from exc
        if bad := [i for i in picks if not 0 <= i < len(gpus)]:
            raise UsageError(
                f"--gpus {args.gpus}: no GPU {bad[0]} among the {len(gpus)} visible "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
            )
        if len(set(picks)) != len(picks):
            raise UsageError(f"--gpus {args.gpus}: each GPU at most once (a GPU serves one unit)")
        chosen = [gpus[i] for i in picks]
    if args.units is not None:
        if args.units * tp > len(chosen):
            raise UsageError(
                f"--units {args.units}: only {len(chosen)} GPU(s) to serve on, and a unit is "
                f"{tp} GPU(s) (--tensor-parallel-size)"
            )
        chosen = chosen[: args.units * tp]
    return chosen


def kv_offloading(args: argparse.Namespace) -> None:
    """Check the second KV tier's flags (vLLM's names)."""
    size = args.kv_offloading_size
    if size is not None and not size > 0:
        raise UsageError(
            f"--kv-offloading-size {size}: give the tier's GiB per unit, more than 0 (or leave it "
            "out for no tier)"
        )
    if size is None and (args.kv_offloading_backend or args.kv_offloading_dir):
        flag = "--kv-offloading-backend" if args.kv_offloading_backend else "--kv-offloading-dir"
        raise UsageError(f"{flag} needs --kv-offloading-size GiB: the tier's size")
    if size is not None and args.stub_engine is not None:
        raise UsageError("--kv-offloading-size: the stub engine keeps no KV; drop one of the two")
    if not 0.0 <= args.kv_retention_share <= 1.0:
        raise UsageError(
            f"--kv-retention-share {args.kv_retention_share}: a share of the pool, in [0, 1]"
        )


def plan_serve(args: argparse.Namespace) -> ServePlan:
    """Resolve and check everything that can be checked before any process starts."""
    vllm_flags(args)
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "prefill_batch_tokens"):
        if (value := getattr(args, name)) is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    for name in (
        "w_ttft",
        "w_tpot",
        "ttft_slo_ms",
        "itl_slo_ms",
        "session_ttl_s",
        "max_waiting_requests",
        "max_queue_time_s",
        "shutdown_timeout",
    ):
        if (value := getattr(args, name)) is not None and value < 0:
            raise UsageError(f"--{name.replace('_', '-')} must not be negative")
    if args.stub_engine is not None and not args.stub_engine > 0:
        raise UsageError(
            f"--stub-engine {args.stub_engine}: the step must be a positive number of milliseconds"
        )
    if args.units is not None and args.units < 1:
        raise UsageError("--units must be at least 1")
    kv_offloading(args)
    kv_events = kv_events_config(args)
    if args.api_server_count < 1:
        raise UsageError(f"--api-server-count {args.api_server_count}: at least 1")
    if args.max_num_batched_tokens < args.max_num_seqs:
        raise UsageError(
            f"--max-num-batched-tokens ({args.max_num_batched_tokens}) must be at least "
            "--max-num-seqs "
            f"({args.max_num_seqs}): every running sequence decodes one token per step"
        )
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise UsageError(
            f"--gpu-memory-utilization {args.gpu_memory_utilization}: must be in (0, 1]"
        )
    if args.cublas_sm_target and args.enforce_eager:
        raise UsageError(
            "--cublas-sm-target sets cuBLAS's SM target as graphs are captured; with "
            "--enforce-eager "
            "none are: drop one of the two"
        )
    if not 0 <= args.max_graph_tokens <= MAX_GRAPH_TOKENS:
        raise UsageError(
            f"--max-graph-tokens {args.max_graph_tokens}: give 0 (graphs for decode-only steps) up "
            "to "
            f"{MAX_GRAPH_TOKENS}"
        )
    path = model_path(args.model)
    tp = args.tensor_parallel_size
    try:
        mcfg = check_model_folder(path, args.load_format).quantized(
            args.quantization, args.fp8_activations
        )
        shard = mcfg.sharded(
            tp
        )  # a size that does not split the model: refused, naming the ones that do
        kv_cache_dtype(args.kv_cache_dtype, mcfg.dtype)  # a dtype not served: refused by name
    except (ModelError, QuantError) as exc:
        raise UsageError(str(exc)) from exc
    if args.max_model_len is not None and args.max_model_len > mcfg.max_position_embeddings:
        raise UsageError(
            f"--max-model-len {args.max_model_len} exceeds the model's "
            f"{mcfg.max_position_embeddings} positions"
        )
    if (
        not args.skip_tokenizer_init
        and args.tokenizer is None
        and (problem := tokenizer_missing(path))
    ):
        raise UsageError(problem)
    chat_template, sampling_defaults = (
        chat_template_text(args.chat_template),
        generation_defaults(args, path),
    )

    gpus = visible_gpus()
    device = args.device if args.device != "auto" else ("cuda" if gpus else "cpu")
    if device == "cuda" and not gpus:
        raise UsageError(
            "--device cuda: no CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES), "
            "or serve on the CPU with --device cpu"
        )
    if args.attention_backend == "triton" and device == "cpu":
        raise UsageError(
            "--attention-backend triton runs on CUDA; on the CPU use --attention-backend cpu, "
            "torch or auto"
        )
    fp8 = mcfg.quantization is not None or args.kv_cache_dtype != "auto"
    if fp8 and device == "cpu" and args.attention_backend in ("auto", "cpu"):
        if args.attention_backend == "cpu":
            raise UsageError(
                "--attention-backend cpu: its C kernels read bfloat16, float16 or float32 weights "
                "and KV; FP8 (--quantization fp8, an FP8 checkpoint or --kv-cache-dtype fp8) runs "
                "on the CPU through --attention-backend torch (slow but exact)"
            )
        log.info("FP8 on the CPU: the torch attention backend (the C kernels do not read FP8)")
        args.attention_backend = "torch"
    if args.attention_backend == "cpu" and device != "cpu":
        raise UsageError(
            "--attention-backend cpu runs on the CPU; on a GPU use --attention-backend triton or "
            "auto"
        )
    if args.policy == "auto":
        args.policy, why = auto_policy(
            device, len(available_cores()) // (args.units or 1) if device == "cpu" else 0
        )
        log.info("policy: %s", why)
    with_prefill = has_prefill_worker(args.policy)
    # On the CPU the pool is sized here, as the engine will size it, so a bad size is refused before
    # any process starts; on a GPU only the worker can measure what is left, and reports the size
    # when ready.
    max_model_len = args.max_model_len or mcfg.max_position_embeddings
    num_blocks = args.num_kv_blocks
    if device == "cpu":
        try:
            dtype = resolve_dtype(args.dtype, mcfg, device)
            # A rank's pool holds its KV heads: --kv-cache-memory is per rank, as
            # --gpu-memory-utilization per GPU.
            kv = plan_from_request(
                args.num_kv_blocks,
                args.kv_cache_memory,
                kv_block_nbytes(shard, args.block_size, kv_cache_dtype(args.kv_cache_dtype, dtype)),
                args.block_size,
                mcfg.max_position_embeddings,
                args.max_model_len,
            )
        except StartupError as exc:
            raise UsageError(str(exc)) from exc
        num_blocks, max_model_len = kv.num_blocks, kv.max_model_len
        num_units = args.units or 1
        unit_gpus: list[str | None] = [None] * num_units
    else:
        unit_gpus = list(choose_gpus(args, gpus, mcfg))
        num_units = len(unit_gpus)
    cores = available_cores()
    workers = num_units * (2 if with_prefill else 1) * tp
    if device == "cpu" and workers > len(cores):
        per_unit = workers // num_units
        if per_unit > len(cores):  # one unit is too many already: fewer units cannot help
            roles = 2 if with_prefill else 1
            fix = f"-tp {max(1, len(cores) // roles)} or less" + (
                ", or --policy aggregated (one worker a unit)" if with_prefill else ""
            )
        else:
            fix = f"--units {len(cores) // per_unit} or fewer"
        log.warning(
            "%d unit(s) are %d worker processes on %d core(s): they will share cores and each run "
            "slower; use %s on this machine",
            num_units,
            workers,
            len(cores),
            fix,
        )
    remove_dead_leftovers()
    ipc_dir = tempfile.mkdtemp(prefix=f"ppd-{os.getpid()}-")
    try:
        partition, parts, mps = plan_partitions(
            args.partition,
            device,
            num_units,
            with_prefill,
            cores,
            Path(ipc_dir),
            (args.mps_decode_percent, args.mps_prefill_percent),
            args.prefill_worker,
            args.green_decode_sms or (),
            args.cublas_sm_target,
        )
        share_manager, profile = share_plan(args, device, path, parts[0], tp)
    except (PartitionError, UsageError) as exc:
        shutil.rmtree(ipc_dir, ignore_errors=True)
        raise UsageError(str(exc)) from exc
    log.info("partition: %s", parts[0].why)
    tokenizer = (
        None
        if args.skip_tokenizer_init
        else (os.path.abspath(args.tokenizer) if args.tokenizer else path)
    )
    engine = EngineConfig(
        model=path,
        dtype=args.dtype,
        load_format=args.load_format,
        device=device,
        attention_backend=args.attention_backend,
        block_size=args.block_size,
        num_kv_blocks=num_blocks,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=max_model_len if device == "cpu" else args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
        max_graph_tokens=args.max_graph_tokens,
        shares_device=with_prefill,
        tokenizer=tokenizer,
        tensor_parallel_size=tp,
        cublas_sm_target=args.cublas_sm_target,
        quantization=args.quantization,
        fp8_activations=args.fp8_activations,
        kv_cache_dtype=args.kv_cache_dtype,
        seed=args.seed,
    )
    units = [
        UnitConfig(
            engine=engine,
            unit=u,
            policy=args.policy,
            ipc_dir=ipc_dir,
            shm_prefix=f"ppd-{os.getpid()}",
            gpu=gpu,
            partition=part,
            share_manager=share_manager,
            partition_profile=profile,
            itl_slo_ms=args.itl_slo_ms,
            prefill_batch_tokens=args.prefill_batch_tokens,
            async_scheduling=async_scheduling_on(args.async_scheduling, device, tp),
            log_level=args.log_level,
            stub_step_ms=args.stub_engine,
            api_servers=args.api_server_count,
            kv_events=kv_events,
            hash_algo=args.prefix_caching_hash_algo,
            kv_offloading_gib=args.kv_offloading_size or 0.0,
            kv_offloading_dir=args.kv_offloading_dir,
            kv_retention_share=args.kv_retention_share,
        )
        for u, (gpu, part) in enumerate(zip(unit_gpus, parts))
    ]
    if kv_events is not None and kv_events.publishing:
        log.info("%s", describe(kv_events, len(units)))
    names = args.served_model_name or [
        args.model
        if args.model in (DEMO_MODEL, SMOLLM2)
        else os.path.basename(args.model.rstrip("/")).removesuffix(".gguf")
    ]
    return ServePlan(
        units,
        names[0],
        path,
        tokenizer,
        mcfg,
        max_model_len,
        ipc_dir,
        device,
        partition,
        mps,
        tuple(names),
        chat_template,
        sampling_defaults,
    )


def chat_template_text(arg: str | None) -> str | None:
    """--chat-template, as vLLM takes it: a file, or the template itself."""
    if arg is None or "{{" in arg or "{%" in arg:
        return arg
    try:
        return Path(arg).read_text()
    except OSError as exc:
        raise UsageError(
            f"--chat-template {arg}: neither a readable file ({exc.strerror}) nor a Jinja template"
        ) from exc


def vllm_flags(args: argparse.Namespace) -> None:
    """`vllm serve`'s command line as ppd takes it (server/args.py add_vllm_args): MODEL as an
    argument, and each of vLLM's flags accepted with its meaning or refused saying what ppd does
    instead."""
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise UsageError(f"two models: {args.model_tag} and --model {args.model}; give one")
    args.model = args.model_tag or args.model or DEMO_MODEL
    if args.enable_prefix_caching is False:
        raise UsageError(
            "--no-enable-prefix-caching: ppd always caches prefixes (the PPD policy routes each "
            "append "
            "by the prefix its unit holds); leave it out"
        )
    if args.pipeline_parallel_size != 1:
        raise UsageError(
            f"--pipeline-parallel-size {args.pipeline_parallel_size}: ppd splits a model over GPUs "
            "by "
            "tensor parallelism only (--tensor-parallel-size); leave it at 1"
        )
    if args.tensor_parallel_size < 1:
        raise UsageError(f"--tensor-parallel-size {args.tensor_parallel_size}: at least 1")
    if args.data_parallel_size is not None:
        if args.units is not None and args.units != args.data_parallel_size:
            raise UsageError(
                f"--data-parallel-size {args.data_parallel_size} and --units {args.units}: the "
                "same "
                "setting (ppd's units are vLLM's data-parallel ranks); give one"
            )
        args.units = args.data_parallel_size
    graph_size = args.max_cudagraph_capture_size or max(args.cudagraph_capture_sizes or [0]) or None
    # vLLM's name of one of ppd's settings, its value, and ppd's flag
    for vllm_name, value, ppd_name in (
        ("--device-ids", args.device_ids, "--gpus"),
        ("-dpl", args.data_parallel_size_local, "--units"),
        ("--kv-cache-memory-bytes", args.kv_cache_memory_bytes, "--kv-cache-memory"),
        ("--num-gpu-blocks-override", args.num_gpu_blocks_override, "--num-kv-blocks"),
        ("--max-num-queued-reqs", args.max_num_queued_reqs, "--max-waiting-requests"),
        ("--max-cudagraph-capture-size", graph_size, "--max-graph-tokens"),
    ):
        if value is None:
            continue
        dest = ppd_name[2:].replace("-", "_")
        ppd_value = value / 2**30 if dest == "kv_cache_memory" else value  # bytes to GiB
        if getattr(args, dest) not in (None, ppd_value, PPD_DEFAULTS.get(dest)):
            raise UsageError(
                f"{vllm_name} {value} and {ppd_name} {getattr(args, dest)}: the same setting "
                "(vLLM's name and ppd's); give one"
            )
        setattr(args, dest, ppd_value)
    if args.attention_backend not in ("auto", *ATTENTION_BACKENDS):
        if not args.attention_backend.isupper():
            raise UsageError(
                f"--attention-backend {args.attention_backend}: ppd's are auto, "
                f"{', '.join(ATTENTION_BACKENDS)} (vLLM's names, such as FLASH_ATTN, are taken "
                "as auto)"
            )
        log.info(
            "--attention-backend %s (vLLM's): ppd runs its own attention kernels (auto)",
            args.attention_backend,
        )
        args.attention_backend = "auto"
    if args.enable_reasoning and args.reasoning_parser is None:
        raise UsageError(
            "--enable-reasoning: name the parser with --reasoning-parser (qwen3 or deepseek_r1), "
            "which alone is enough"
        )
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise UsageError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    check_vllm_only_args(args)
    if not 0 <= args.max_logprobs <= MAX_LOGPROBS:
        raise UsageError(
            f"--max-logprobs {args.max_logprobs}: ppd returns 0 to {MAX_LOGPROBS} logprobs per "
            "token"
        )
    if args.trust_remote_code:
        log.info(
            "--trust-remote-code: ppd runs its own code for the architectures it serves, never a "
            "folder's"
        )


GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")


def generation_defaults(args: argparse.Namespace, model_folder: str) -> dict[str, float | int]:
    """The sampling defaults of requests that leave them unset (--generation-config, as vLLM's: the
    model folder's generation_config.json, a folder's, or none), under
    --override-generation-config."""
    source = {"auto": model_folder, "vllm": None}.get(
        args.generation_config, args.generation_config
    )
    found: dict = {}
    if source is not None:
        path = Path(source) / "generation_config.json"
        if args.generation_config not in ("auto", "vllm") and not path.is_file():
            raise UsageError(
                f"--generation-config {source}: no generation_config.json there; give a folder "
                "that "
                "holds one, auto (the model's) or vllm (none)"
            )
        try:
            found = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError) as exc:
            raise UsageError(f"{path}: not readable JSON ({exc})") from exc
        if "max_new_tokens" in found:
            found["max_tokens"] = found["max_new_tokens"]
        if (
            found.get("do_sample") is False
        ):  # transformers' greedy: vLLM reads it as temperature 0 too
            found.setdefault("temperature", 0.0)
    if args.override_generation_config is not None:
        try:
            override = json.loads(args.override_generation_config)
        except ValueError as exc:
            raise UsageError(
                f"--override-generation-config: not JSON ({exc}); e.g. '{{\"temperature\": 0.2}}'"
            ) from exc
        if not isinstance(override, dict) or (
            unknown := set(override) - {*GENERATION_DEFAULTS, "max_new_tokens"}
        ):
            raise UsageError(
                f"--override-generation-config: give an object of {', '.join(GENERATION_DEFAULTS)}"
                + (f" (not {', '.join(sorted(unknown))})" if isinstance(override, dict) else "")
            )
        found.update(override)
        if "max_new_tokens" in override:
            found["max_tokens"] = override["max_new_tokens"]
    defaults = {
        k: found[k]
        for k in GENERATION_DEFAULTS
        if isinstance(found.get(k), (int, float)) and not isinstance(found.get(k), bool)
    }
    if defaults:
        log.info(
            "sampling defaults for requests that leave them unset: %s (--generation-config %s%s)",
            ", ".join(f"{k} {v}" for k, v in defaults.items()),
            args.generation_config,
            ", overridden" if args.override_generation_config else "",
        )
    return defaults


def model_path(model: str) -> str:
    """The folder --model stands for: the demo's, a Hugging Face folder, or the cache folder of a
    GGUF (`smollm2`, a .gguf file, a folder holding one), converted on first use; UsageError for
    a GGUF this server does not serve."""
    if model == DEMO_MODEL:
        return str(demo_model_path())
    if (
        not os.path.exists(model)
        and re.fullmatch(r"[\w.-]+/[\w.-]+", model)
        and not model.endswith(".gguf")
    ):
        raise UsageError(
            f"{model} is not a folder here; as a Hugging Face hub id it is not fetched: ppd "
            "downloads "
            f"nothing. Fetch it first (`hf download {model} --local-dir DIR`, or huggingface-cli) "
            "and serve "
            "the folder: ppd serve DIR; or serve the packaged SmolLM2-135M-Instruct: ppd serve "
            "smollm2"
        )
    try:
        gguf = gguf_in(model)
        return str(gguf_folder(gguf)) if gguf is not None else os.path.abspath(model)
    except GGUFError as exc:
        raise UsageError(str(exc)) from exc


# What a tokenizer is made of on disk: one of these files (or pairs) is enough for transformers to
# load one.
TOKENIZER_FILES = (
    ("tokenizer.json",),
    ("tokenizer.model",),
    ("vocab.json", "merges.txt"),
    ("vocab.txt",),
    ("tiktoken.model",),
    ("qwen.tiktoken",),
)


def tokenizer_missing(folder: str) -> str | None:
    """Why folder cannot give a tokenizer (None: it can): a folder of config and weights alone must
    not start with whatever tokenizer transformers improvises, nor fail later with transformers'
    own message."""
    path = Path(folder)
    if any(all((path / name).exists() for name in files) for files in TOKENIZER_FILES):
        return None
    return (
        f"{folder} has no tokenizer files ({', '.join(' + '.join(f) for f in TOKENIZER_FILES)}): "
        "give one with "
        "--tokenizer FOLDER, or serve token ids only with --skip-tokenizer-init"
    )


# On the CPU a split gives each worker its own cores; below this many per unit one engine on every
# core serves more.
CPU_SPLIT_MIN_CORES = 4


def auto_policy(device: str, cores_per_unit: int) -> tuple[str, str]:
    """--policy auto: (the policy, why). ppd on a GPU (the workers share its SMs); on the CPU, where
    a split pins each worker to its own cores, aggregated below CPU_SPLIT_MIN_CORES cores per unit:
    on 2 cores one engine on both served more requests/s, at a lower TPOT, than the 1+1-core split
    (docs/serving.md#on-the-cpu)."""
    if device != "cpu":
        return (
            "ppd",
            "auto: ppd (each turn-2+ append-prefill on the decode or the prefill worker, per "
            "request)",
        )
    if cores_per_unit < CPU_SPLIT_MIN_CORES:
        return "aggregated", (
            f"auto: aggregated: {cores_per_unit} core(s) per unit would leave each worker of a "
            "split "
            f"{max(1, cores_per_unit // 2)}, and one engine on every core serves more (measured on "
            "2 "
            f"cores); --policy ppd splits them anyway"
        )
    return "ppd", (
        f"auto: ppd: {cores_per_unit} cores per unit, each worker of the split gets at least "
        f"{cores_per_unit // 2}"
    )


def kv_events_config(args: argparse.Namespace) -> KVEventsConfig | None:
    """--kv-events-config, checked (with the hash algorithm it needs) before any process starts."""
    if args.kv_events_config is None:
        return None
    try:
        cfg = KVEventsConfig.parse(args.kv_events_config)
        BlockHasher(args.prefix_caching_hash_algo)
    except KVEventsError as exc:
        raise UsageError(str(exc)) from exc
    if cfg.publishing and args.stub_engine is not None:
        raise UsageError(
            "--kv-events-config: the stub engine keeps no KV cache, so it has no events to "
            "publish; "
            "drop one of the two"
        )
    return cfg


def share_manager_on(asked: bool | None, partition: str) -> bool:
    """--share-manager / --no-share-manager, else on for green (a switch picks another stream) and
    off for cpu (moving threads between cores cost more than it gained on the 2-core demo)."""
    return BACKENDS[partition].manages_by_default if asked is None else asked


def tp_share_manager(on: bool, partition: str, tp: int) -> bool:
    """The share manager under tensor parallelism: a green split chosen by decode rank 0 reaches
    every rank with each step (its stream's key), but the cpu backend's cores are repinned in
    rank 0's processes only: off there."""
    if on and tp > 1 and partition == "cpu":
        log.info(
            "share manager: off with --tensor-parallel-size %d on the CPU (it repins rank 0's "
            "processes only; "
            "each rank keeps the cores it starts on)",
            tp,
        )
        return False
    return on


def share_plan(
    args: argparse.Namespace,
    device: str,
    model_path: str,
    part: UnitPartition,
    tp: int,
) -> tuple[bool, str | None]:
    """Whether a share manager runs under this unit partition, and the partition profile it reads
    (None: none found, or no manager). A --partition-profile that no manager would read is refused
    (UsageError), never dropped."""
    kind = part.backend
    manager = (
        tp_share_manager(share_manager_on(args.share_manager, kind), kind, tp)
        and part.runtime_shares
    )
    if manager:
        return True, partition_profile_for(args, device, model_path)
    if args.partition_profile is not None:
        chosen = f"auto chose {kind} here" if args.partition == "auto" else f"--partition {kind}"
        if kind in ("none", "mps"):
            why = (
                f"{chosen} fixes each worker's share when it starts, so no share manager reads a "
                "profile; drop it, "
                f"or use --partition {'cpu' if device == 'cpu' else 'green'}"
            )
        elif not part.runtime_shares:
            why = (
                f"{chosen} gives each worker of a unit one core, so there is none to move; drop it"
            )
        elif args.share_manager is False:
            why = "the share manager that reads it is off (--no-share-manager); drop one of the two"
        elif tp > 1 and kind == "cpu":
            why = (
                "the share manager that reads it is off with"
                f" --tensor-parallel-size {tp} on the CPU; drop it"
            )
        else:
            why = (
                f"the share manager that reads it is off by default under {chosen}:"
                " add --share-manager, or drop it"
            )
        raise UsageError(f"--partition-profile: {why}")
    return False, None


def partition_profile_for(args: argparse.Namespace, device: str, model_path: str) -> str | None:
    """The partition profile the share manager reads: --partition-profile, else this device's and
    model's, the user's ($PPD_CACHE_DIR/profiles) before the shipped one (None: there is none, and
    the manager splits evenly)."""
    from partition.profile import PartitionProfile, ProfileError, shipped_profile
    from profiles import cpu_device_name

    if args.partition_profile is not None:
        try:
            PartitionProfile.load(args.partition_profile)
        except ProfileError as exc:
            raise UsageError(str(exc)) from exc
        return os.path.abspath(args.partition_profile)
    if device != "cpu":
        # the decode worker looks for its GPU's shipped profile (the name is known once CUDA is up
        # there)
        return None
    return shipped_profile(cpu_device_name(), model_path)


def async_scheduling_on(asked: bool | None, device: str, tp: int) -> bool:
    """--async-scheduling: on a GPU by default; never under tensor parallelism (rank 0 alone holds
    the sampled tokens the next step takes, so its followers could not run it); on the CPU only
    when asked (a step there runs on the host, so building the next one beside it gains nothing,
    and a step's tokens would reach the client a step late)."""
    if tp > 1:
        if asked:
            log.warning(
                "--async-scheduling is off under --tensor-parallel-size %d: only rank 0 samples", tp
            )
        return False
    return device.startswith("cuda") if asked is None else asked


def remove_dead_leftovers(
    folders: tuple[Path, ...] = (Path(tempfile.gettempdir()), SHM_DIR),
) -> list[Path]:
    """Remove what servers that died without cleaning up (kill -9) left: their socket folders and
    shared-memory files are named ppd-<the server's pid>-..., and a pid that no longer runs owns
    nothing."""
    removed = []
    for folder in folders:
        for path in folder.glob("ppd-*"):
            match = re.match(r"ppd-(\d+)-", path.name)
            if match is None or process_alive(int(match.group(1))):
                continue
            try:
                if path.lstat().st_uid != os.getuid():
                    continue
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
            except OSError:
                continue  # gone meanwhile, or not ours to remove
            removed.append(path)
    if removed:
        log.info(
            "removed %d leftover(s) of servers that did not exit cleanly: %s",
            len(removed),
            ", ".join(p.name for p in removed),
        )
    return removed


def start_mps(args: argparse.Namespace, plan: ServePlan) -> tuple[MpsDaemon | None, ServePlan]:
    """Under --partition mps (or auto's choice of it): start the MPS daemon where the plan says so,
    then check that a CUDA client really runs under it. Returns the daemon we started (to stop at
    exit; None: none) and the plan to serve: `plan`, or where MPS does not work under auto a new one
    on green contexts or the time-sliced baseline (saying why; `plan` is left as it was); under mps
    that is a UsageError."""
    if plan.mps is None:
        return None, plan
    from partition.mps import MpsDaemon, check_mps_client

    daemon = MpsDaemon(plan.mps) if plan.mps.start else None
    try:
        if daemon is not None:
            daemon.start()
        check_mps_client(plan.mps)
        return daemon, plan
    except PartitionError as exc:
        if daemon is not None:
            daemon.stop()  # once; start() stopped a half-started one already
        if args.partition != "auto":
            raise UsageError(str(exc)) from exc
        problem = exc
    # auto promised the best that works here: green contexts in one process where the other settings
    # allow them (planned as --partition green would be: not with --prefill-worker process, nor
    # without cuda-python), else the time-sliced baseline, said plainly.
    why = f"auto: MPS does not work here ({problem})"
    request = (
        plan.device,
        len(plan.units),
        plan.units[0].prefill_worker != "none",
        available_cores(),
        Path(plan.ipc_dir),
    )
    tp = plan.units[0].tensor_parallel_size
    try:
        kind, parts, _ = plan_partitions(
            "green",
            *request,
            prefill_worker=args.prefill_worker,
            green_sms=args.green_decode_sms or (),
        )
    except PartitionError as no_green:
        why = f"{why}; green contexts are out too ({no_green})"
        kind, parts, _ = plan_partitions("none", *request, prefill_worker=args.prefill_worker)
    parts = [dataclasses.replace(part, why=why) for part in parts]
    log.warning("partition: %s; going on with --partition %s", why, kind)
    manager, profile = share_plan(args, plan.device, plan.model_path, parts[0], tp)
    units = [
        dataclasses.replace(u, partition=part, share_manager=manager, partition_profile=profile)
        for u, part in zip(plan.units, parts)
    ]
    return None, dataclasses.replace(plan, units=units, partition=kind, mps=None)


def final_plan(args: argparse.Namespace) -> tuple[ServePlan, MpsDaemon | None]:
    """plan_serve, then MPS where the plan uses it, started and checked with a CUDA client
    (start_mps: where it does not work under auto, the plan falls back): the plan the server is
    built from, and the MPS daemon started for it (to stop at exit; None: none). Nothing is
    planned after this."""
    plan = plan_serve(args)
    try:
        daemon, plan = start_mps(args, plan)
    except UsageError:
        shutil.rmtree(plan.ipc_dir, ignore_errors=True)
        raise
    return plan, daemon
