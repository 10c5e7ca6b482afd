"""`vllm serve`'s command line as `ppd serve` takes it.

vLLM's spellings (its FlexibleArgumentParser): `--config FILE.yaml`, `--max_model_len` for
`--max-model-len`, `-O3`, `--compilation-config.mode 3` for a JSON field, `--help=WORD`. And every
flag of `vllm serve` VLLM_VERSION that ppd has no flag of its own for: a no-op said in the log where
it tunes something ppd does not have or need, refused in one line naming what ppd does instead where
ignoring it would serve something other than what the script asked for. The flags ppd implements
with vLLM's meaning are ppd's own (server/args.py add_vllm_args).
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass

log = logging.getLogger("ppd.serve")

VLLM_VERSION = "0.32.0"


class VllmCliError(Exception):
    """A `vllm serve` spelling ppd cannot read (a missing --config file, bad YAML)."""


# ---- spellings -----------------------------------------------------------------------------------


def vllm_argv(argv: list[str]) -> list[str]:
    """`ppd serve`'s arguments with vLLM's spellings rewritten into argparse's: a --config YAML's
    keys inserted after MODEL (the command line wins over the file), underscores in flag names made
    dashes, -O3 / -O 3 made --optimization-level 3, --help=WORD made --help, and dotted fields
    (--compilation-config.mode 3, --a.list+ x,y) gathered into the flag's JSON."""
    argv = with_config_file(argv)
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--help="):
            out.append("--help")
        elif arg.startswith("--") and len(arg) > 2:
            name, eq, value = arg.partition("=")
            head, dot, field = name[2:].partition(".")
            out.append("--" + head.replace("_", "-") + dot + field + eq + value)
        elif arg.startswith("-O") and arg != "-O":
            out += ["--optimization-level", arg[3:] if arg[2:3] == "=" else arg[2:]]
        elif arg == "-O" and i + 1 < len(argv) and argv[i + 1] in ("0", "1", "2", "3"):
            out.append("--optimization-level")
        else:
            out.append(arg)
        i += 1
    return gather_dotted(out)


def gather_dotted(argv: list[str]) -> list[str]:
    """--flag.a.b V (or --flag.a.b=V) folded into one --flag '{"a": {"b": V}}' at the end; V is
    JSON where it parses, else a string; --flag.a+ x,y appends to a list."""
    fields: dict[str, dict] = {}
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg.partition("=")[0]
        if not (arg.startswith("--") and "." in name):
            out.append(arg)
            i += 1
            continue
        if "=" in arg:
            value = arg.partition("=")[2]
            i += 1
        else:
            value = argv[i + 1] if i + 1 < len(argv) else ""
            i += 2
        flag, *keys = name.split(".")
        append = keys[-1].endswith("+")
        keys[-1] = keys[-1].rstrip("+")
        parsed: object = value.split(",") if append else _json_or_text(value)
        node = fields.setdefault(flag, {})
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        if append and isinstance(node.get(keys[-1]), list):
            node[keys[-1]] += parsed
        else:
            node[keys[-1]] = parsed
    for flag, value in fields.items():
        out += [flag, json.dumps(value)]
    return out


def _json_or_text(value: str) -> object:
    try:
        return json.loads(value)
    except ValueError:
        return value


def with_config_file(argv: list[str]) -> list[str]:
    """--config FILE.yaml (vLLM's): the file's keys as flags, placed after MODEL and before the
    rest, so a flag on the command line wins over the file's. true is the flag itself, false its
    --no- form, a list its values, a mapping its JSON."""
    spots = [i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")]
    if not spots:
        return argv
    if len(spots) > 1:
        raise VllmCliError("--config given twice; give one YAML file")
    i = spots[0]
    if argv[i].startswith("--config="):
        path, rest = argv[i].partition("=")[2], argv[:i] + argv[i + 1 :]
    elif i + 1 < len(argv):
        path, rest = argv[i + 1], argv[:i] + argv[i + 2 :]
    else:
        raise VllmCliError("--config needs a YAML file: --config FILE.yaml")
    flags = config_file_args(path)
    model_first = bool(rest) and not rest[0].startswith("-")
    return rest[:1] + flags + rest[1:] if model_first else flags + rest


def config_file_args(path: str) -> list[str]:
    """A vLLM config file's keys as command-line flags."""
    import yaml

    if not path.endswith((".yaml", ".yml")):
        raise VllmCliError(f"--config {path}: give a .yaml or .yml file, as vLLM reads")
    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except OSError as exc:
        raise VllmCliError(f"--config {path}: cannot read it ({exc.strerror})") from exc
    except yaml.YAMLError as exc:
        raise VllmCliError(f"--config {path}: not YAML ({exc})") from exc
    if config is None:
        return []
    if not isinstance(config, dict):
        raise VllmCliError(f"--config {path}: give a mapping of flag names to values")
    args: list[str] = []
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            args += [flag, *map(str, value)] if value else []
        elif isinstance(value, dict):
            args += [flag, json.dumps(value)]
        elif value is not None:
            args += [flag, str(value)]
    return args


def human_int(text: str) -> int:
    """vLLM's integers with a suffix: 32k is 32,000, 1m a million, 32K 32,768 (powers of 1024 in
    capitals, which take no decimals), 25.6k 25,600."""
    text = text.strip()
    decimal = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
    binary = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    try:
        if text[-1:] in decimal:
            return int(float(text[:-1]) * decimal[text[-1]])
        if text[-1:] in binary:
            return int(text[:-1]) * binary[text[-1]]
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a whole number such as 32768, 32k (32,000) or 32K (32,768)"
        ) from None


def human_int_or_auto(text: str) -> int | None:
    """--max-model-len: a human_int, or auto / -1 for the model's own (None)."""
    return None if text.strip().lower() in ("auto", "-1") else human_int(text)


DTYPES = {"half": "float16", "float": "float32"}


def dtype_name(text: str) -> str:
    """--dtype with vLLM's other names: half is float16, float is float32."""
    return DTYPES.get(text, text)


def log_level(text: str) -> str:
    """--log-level in either case (vLLM's are capitals); NOTSET is debug and CRITICAL error."""
    level = text.lower()
    return {"notset": "debug", "critical": "error"}.get(level, level)


# ---- vLLM's flags that ppd has none of its own for -----------------------------------------------

IGNORE, REFUSE = "ignore", "refuse"


@dataclass(frozen=True)
class VllmFlag:
    """One `vllm serve` flag: its names, how many values it takes (flag: none, with a --no- form
    where vLLM has one; value; list), and what ppd does with it: IGNORE (said in the log) or REFUSE
    (one line, `why` naming what ppd does instead), except for the values in `fine`, which ask for
    what ppd does anyway."""

    names: tuple[str, ...]
    arity: str
    action: str
    why: str
    fine: tuple[str, ...] = ()
    negatable: bool = True

    @property
    def dest(self) -> str:
        return "vllm_" + self.names[0][2:].replace("-", "_")


def _flags(action: str, why: str, *specs: str, fine: tuple[str, ...] = ()) -> list[VllmFlag]:
    """Flags that share an action and its reason. A spec is 'NAME[ ALIAS] [:value|:list|:switch]'
    (default a boolean flag with a --no- form; :switch is one without)."""
    out = []
    for spec in specs:
        names, _, arity = spec.partition(":")
        out.append(
            VllmFlag(
                tuple(names.split()),
                "flag" if arity in ("", "switch") else arity,
                action,
                why,
                fine,
                arity != "switch",
            )
        )
    return out


TEXT_ONLY = "ppd serves text-only models: there is no image, audio or video input to act on"
LORA = (
    "ppd serves one set of weights: merge the adapter into the model (peft's merge_and_unload) and "
    "serve that folder"
)
ONE_NODE = (
    "ppd runs on one node, its units as vLLM's data-parallel ranks (--data-parallel-size); put a "
    "router over nodes (docs/deployment.md)"
)
NO_PLUGINS = "ppd loads no code by import path; its parsers, schedulers and workers are built in"
NO_DOWNLOADS = (
    "ppd serves a local folder as it is and downloads nothing (fetch with `hf download`, choosing "
    "the revision there)"
)
NO_SPEC = "ppd has no speculative decoding; every token comes from the served model"
OWN_KERNELS = "ppd runs its own kernels and CUDA graphs (--enforce-eager, --max-graph-tokens)"
NO_MAMBA = "ppd serves attention-only models: there is no Mamba state to tune"
OWN_LOGS = "ppd's metrics are on /metrics under vLLM's names; it keeps no other log or trace"
OWN_SCHEDULER = (
    "ppd schedules with its own PPD router and workers (--policy, --max-num-seqs, "
    "--max-num-batched-tokens)"
)
NO_OFFLOAD = (
    "ppd keeps every weight in GPU memory: fit a larger model with --tensor-parallel-size or "
    "--quantization fp8 (--kv-offloading-size offloads KV blocks)"
)
NO_POOLING = "ppd serves generative models only (chat and completions)"
MOE_TUNING = (
    "ppd shards experts by tensor parallelism on one node: there is no expert-parallel layout"
)

VLLM_FLAGS: list[VllmFlag] = [
    # the frontend
    *_flags(REFUSE, "ppd runs its API servers and engines as one command", "--headless:switch"),
    *_flags(REFUSE, "ppd serves HTTP only (the OpenAI, Anthropic and vLLM APIs)", "--grpc:switch"),
    *_flags(REFUSE, "ppd serves HTTP only", "--grpc-port:value"),
    *_flags(REFUSE, LORA, "--lora-modules:list", "--enable-lora"),
    *_flags(
        IGNORE,
        "LoRA settings without --enable-lora, which ppd refuses: nothing to act on",
        "--max-loras:value",
        "--max-lora-rank:value",
        "--lora-dtype:value",
        "--enable-tower-connector-lora",
        "--max-cpu-loras:value",
        "--fully-sharded-loras",
        "--lora-target-modules:list",
        "--default-mm-loras:value",
        "--specialize-active-lora",
        "--enable-mixed-moe-lora-format",
        "--enable-moe-shared-loras",
        "--max-lora-cls-labels:value",
    ),
    *_flags(
        REFUSE,
        "ppd gives a chat template each message's text as a string (a list of text parts is "
        "joined)",
        "--chat-template-content-format:value",
        fine=("auto", "string"),
    ),
    *_flags(
        IGNORE,
        "ppd renders with the served chat template only (--chat-template); a request's own "
        "chat_template is refused",
        "--trust-request-chat-template",
    ),
    *_flags(IGNORE, TEXT_ONLY, "--trust-request-mm-kwargs"),
    *_flags(
        REFUSE,
        "ask for token ids with the request field return_token_ids: true (vLLM's too); logprobs "
        "name tokens by their text",
        "--return-tokens-as-token-ids",
    ),
    *_flags(
        IGNORE,
        "ppd leaves the tools in the prompt under tool_choice none, as vLLM does by default",
        "--exclude-tools-when-tool-choice-none",
    ),
    *_flags(REFUSE, NO_PLUGINS, "--tool-parser-plugin:value", "--reasoning-parser-plugin:value"),
    *_flags(
        IGNORE,
        "ppd checks a forced or strict tool call against its schema with a grammar",
        "--tool-strict-level:value",
    ),
    *_flags(
        REFUSE,
        "ppd runs no tools itself: the client runs them and sends the results back",
        "--tool-server:value",
    ),
    *_flags(
        IGNORE,
        "ppd does not log prompts or outputs (/metrics counts requests under vLLM's names)",
        "--max-log-len:value",
        "--enable-log-outputs",
        "--enable-log-deltas",
        "--enable-log-requests",
        "--disable-log-stats:switch",
        "--aggregate-engine-logging:switch",
        "--log-error-stack",
    ),
    *_flags(
        IGNORE,
        "ppd always reports prompt_tokens_details.cached_tokens in usage",
        "--enable-prompt-tokens-details",
    ),
    *_flags(
        IGNORE,
        "ppd's per-request timings are on /metrics, its load on /health",
        "--enable-per-request-metrics",
        "--enable-server-load-tracking",
    ),
    *_flags(
        IGNORE,
        "ppd streams each token as it comes",
        "--sse-keep-alive-interval:value",
        "--stream-interval:value",
    ),
    *_flags(
        REFUSE,
        "ppd serves /tokenize and /detokenize; GET /tokenizer_info is not served",
        "--enable-tokenizer-info-endpoint",
    ),
    *_flags(
        IGNORE,
        "ppd serves no Cohere API",
        "--cohere-is-reasoning-model",
        "--cohere-format:value",
    ),
    *_flags(
        IGNORE,
        "ppd's /v1/messages sends thinking off to the template as enable_thinking: false",
        "--anthropic-disabled-thinking-effort:value",
    ),
    *_flags(REFUSE, "ppd returns text and token ids (return_token_ids)", "--tokens-only"),
    *_flags(IGNORE, ONE_NODE, "--enable-scale-out"),
    *_flags(
        IGNORE,
        "ppd answers without a system_fingerprint",
        "--fingerprint-mode:value",
        "--fingerprint-value:value",
    ),
    *_flags(
        IGNORE,
        "ppd's launcher watches and restarts its own workers",
        "--data-parallel-supervisor-port:value",
        "--dp-supervisor-probe-interval-s:value",
        "--dp-supervisor-probe-timeout-s:value",
        "--dp-supervisor-probe-failure-threshold:value",
    ),
    *_flags(
        REFUSE,
        "ppd listens on TCP, its API servers sharing the port: --host and --port",
        "--uds:value",
    ),
    *_flags(REFUSE, NO_PLUGINS, "--middleware:value"),
    *_flags(
        IGNORE,
        "ppd's HTTP parser is httptools, not h11",
        "--h11-max-incomplete-event-size:value",
        "--h11-max-header-count:value",
    ),
    *_flags(IGNORE, "ppd's /docs loads nothing from outside", "--enable-offline-docs"),
    *_flags(IGNORE, NO_POOLING, "--enable-flash-late-interaction"),
    *_flags(REFUSE, "reload the certificate by restarting ppd", "--enable-ssl-refresh"),
    # the model
    *_flags(REFUSE, NO_POOLING, "--runner:value", fine=("auto", "generate")),
    *_flags(REFUSE, NO_POOLING, "--convert:value", fine=("auto", "none")),
    *_flags(REFUSE, NO_POOLING, "--task:value", fine=("auto", "generate")),
    *_flags(
        REFUSE,
        "ppd reads the folder's fast tokenizer (tokenizer.json) through transformers",
        "--tokenizer-mode:value",
        fine=("auto", "hf", "slow"),
    ),
    *_flags(
        REFUSE,
        "ppd reads config.json from the model folder; copy the config there",
        "--hf-config-path:value",
    ),
    *_flags(
        REFUSE,
        "ppd reads the folder's Hugging Face config",
        "--config-format:value",
        fine=("auto", "hf"),
    ),
    *_flags(IGNORE, TEXT_ONLY, "--allowed-local-media-path:value", "--allowed-media-domains:list"),
    *_flags(
        IGNORE,
        NO_DOWNLOADS,
        "--revision:value",
        "--code-revision:value",
        "--tokenizer-revision:value",
        "--download-dir:value",
        "--hf-token:optional",
    ),
    *_flags(
        REFUSE,
        "ppd reads the checkpoint's own quantization_config; --quantization fp8 quantizes a "
        "bf16 checkpoint",
        "--quantization-config:value",
    ),
    *_flags(IGNORE, "ppd serves FP8 and GGUF quants only", "--allow-deprecated-quantization"),
    *_flags(REFUSE, "ppd does not return each token's experts", "--enable-return-routed-experts"),
    *_flags(REFUSE, "ppd does not return sampling masks", "--return-sampling-mask"),
    *_flags(
        REFUSE,
        "ppd's logprobs are the model's raw ones (before temperature, penalties and the cuts)",
        "--logprobs-mode:value",
        fine=("raw_logprobs",),
    ),
    *_flags(IGNORE, "ppd samples with float32 exponential noise", "--use-fp64-gumbel"),
    *_flags(IGNORE, "ppd records no traces", "--enable-trace-replay"),
    *_flags(
        IGNORE,
        "ppd attends over the whole context on every model it serves",
        "--disable-sliding-window",
        "--disable-cascade-attn",
    ),
    *_flags(REFUSE, "ppd takes prompts as text or token ids", "--enable-prompt-embeds"),
    *_flags(
        REFUSE,
        "edit the folder's config.json: ppd reads the model's configuration from there",
        "--hf-overrides:value",
        fine=("{}",),
    ),
    *_flags(REFUSE, NO_PLUGINS, "--model-class-overrides:value", fine=("{}",)),
    *_flags(REFUSE, NO_POOLING, "--pooler-config:value"),
    *_flags(
        REFUSE,
        "ppd has no sleep mode: stop the server to free the GPU",
        "--enable-sleep-mode",
        "--sleep-mode-offload-cudagraph",
        "--sleep-preserve-parameter-names:list",
    ),
    *_flags(
        IGNORE,
        "ppd maps its weights and KV cache once, shared by both workers through CUDA IPC",
        "--enable-cumem-allocator",
        "--enable-nccl-comm-suspend",
    ),
    *_flags(IGNORE, "ppd runs its own model code", "--model-impl:value"),
    *_flags(REFUSE, NO_PLUGINS, "--logits-processors:list", "--io-processor-plugin:value"),
    *_flags(
        IGNORE,
        "ppd renders prompts in its API servers (--api-server-count)",
        "--renderer-num-workers:value",
    ),
    # loading
    *_flags(
        IGNORE,
        "ppd reads safetensors straight into the arena both workers map",
        "--safetensors-load-strategy:value",
        "--safetensors-prefetch-num-threads:value",
        "--safetensors-prefetch-block-size:value",
        "--model-loader-extra-config:value",
        "--ignore-patterns:list",
        "--use-tqdm-on-load",
        "--pt-load-map-location:value",
        "--max-parallel-loading-workers:value",
    ),
    *_flags(
        IGNORE,
        NO_MAMBA,
        "--mamba-backend:value",
        "--mamba-ssu-algorithm:value",
        "--enable-mamba-cache-stochastic-rounding",
        "--mamba-cache-philox-rounds:value",
        "--mamba-cache-dtype:value",
        "--mamba-ssm-cache-dtype:value",
        "--mamba-block-size:value",
        "--mamba-cache-mode:value",
        "--enable-mamba-shared-prefix-checkpoint",
        "--replayssm-buffer-len:value",
        "--use-replayssm",
        "--prefix-match-unit:value",
        "--gdn-prefill-backend:value",
        "--kda-prefill-backend:value",
        "--kda-decode-backend:value",
    ),
    # parallelism
    *_flags(
        REFUSE,
        "ppd starts its own worker processes (vLLM's mp)",
        "--distributed-executor-backend:value",
        fine=("mp", "uni"),
    ),
    *_flags(REFUSE, ONE_NODE, "--nnodes -n:value", fine=("1",)),
    *_flags(REFUSE, ONE_NODE, "--node-rank -r:value", fine=("0",)),
    *_flags(
        IGNORE,
        ONE_NODE,
        "--master-addr:value",
        "--master-port:value",
        "--data-parallel-address -dpa:value",
        "--data-parallel-rpc-port -dpp:value",
        "--data-parallel-backend -dpb:value",
    ),
    *_flags(
        REFUSE,
        ONE_NODE,
        "--data-parallel-rank -dpn:value",
        "--data-parallel-start-rank -dpr:value",
        fine=("0",),
    ),
    *_flags(
        REFUSE,
        ONE_NODE,
        "--data-parallel-hybrid-lb -dph",
        "--data-parallel-external-lb -dpe",
        "--data-parallel-multi-port-external-lb -dpm:switch",
    ),
    *_flags(
        IGNORE,
        "ppd's collectives have no timeout to set",
        "--distributed-timeout-seconds:value",
        "--cpu-distributed-timeout-seconds:value",
    ),
    *_flags(
        IGNORE,
        "ppd pins each CPU worker's threads to its own cores",
        "--numa-bind",
        "--numa-bind-nodes:list",
        "--numa-bind-cpus:list",
    ),
    *_flags(
        REFUSE,
        "ppd splits a model over GPUs by tensor parallelism only (--tensor-parallel-size)",
        "--decode-context-parallel-size -dcp:value",
        "--prefill-context-parallel-size -pcp:value",
        fine=("1",),
    ),
    *_flags(
        IGNORE,
        "context parallelism, which ppd does not have",
        "--dcp-comm-backend:value",
        "--dcp-q-replicate",
        "--dcp-kv-cache-interleave-size:value",
        "--cp-kv-cache-interleave-size:value",
    ),
    *_flags(
        IGNORE,
        MOE_TUNING,
        "--enable-expert-parallel -ep",
        "--enable-ep-weight-filter",
        "--all2all-backend:value",
        "--enable-elastic-ep",
        "--elastic-ep-max-dp-size:value",
        "--enable-eplb",
        "--eplb-config:value",
        "--expert-placement-strategy:value",
    ),
    *_flags(
        IGNORE,
        OWN_SCHEDULER,
        "--enable-hc-sp",
        "--enable-batch-sharded-sampling",
        "--enable-dbo",
        "--enable-shm-tensor-arena",
        "--ubatch-size:value",
        "--dbo-decode-token-threshold:value",
        "--dbo-prefill-token-threshold:value",
        "--dp-sync-interval:value",
        "--disable-nccl-for-dp-synchronization",
    ),
    *_flags(IGNORE, "ppd profiles with `ppd bench engine`", "--ray-workers-use-nsight"),
    *_flags(
        IGNORE,
        "ppd's all-reduce is NCCL's (shared memory on the CPU)",
        "--disable-custom-all-reduce",
    ),
    *_flags(REFUSE, NO_PLUGINS, "--worker-cls:value", fine=("auto",)),
    *_flags(REFUSE, NO_PLUGINS, "--worker-extension-cls:value", fine=("",)),
    *_flags(
        IGNORE,
        "ppd's launcher restarts a dead worker and fails its requests loudly",
        "--enable-fault-tolerance",
        "--fault-tolerance-config:value",
    ),
    # the KV cache
    *_flags(
        IGNORE,
        "ppd keeps a cached prefix until its blocks are needed (--kv-retention-share)",
        "--prefix-cache-retention-interval:value",
    ),
    *_flags(
        REFUSE,
        "ppd's FP8 KV cache covers every layer (--kv-cache-dtype fp8)",
        "--kv-cache-dtype-skip-layers:list",
    ),
    *_flags(
        IGNORE,
        "ppd serves attention-only models whose layers each keep their KV",
        "--kv-sharing-fast-prefill",
        "--swa-bounded-replay",
        "--disable-hybrid-kv-cache-manager",
    ),
    *_flags(REFUSE, NO_OFFLOAD, "--cpu-offload-gb:value", fine=("0", "0.0")),
    *_flags(
        REFUSE,
        NO_OFFLOAD,
        "--cpu-offload-params:list",
        "--offload-params:list",
    ),
    *_flags(
        IGNORE,
        NO_OFFLOAD,
        "--offload-backend:value",
        "--offload-group-size:value",
        "--offload-num-in-group:value",
        "--offload-prefetch-step:value",
    ),
    *_flags(
        IGNORE,
        "ppd does not swap a preempted request's KV to host memory (--kv-offloading-size keeps "
        "evicted prefix blocks there)",
        "--swap-space:value",
    ),
    # multimodal
    *_flags(
        IGNORE,
        TEXT_ONLY,
        "--language-model-only",
        "--limit-mm-per-prompt:value",
        "--enable-mm-embeds",
        "--media-io-kwargs:value",
        "--mm-processor-kwargs:value",
        "--mm-processor-cache-gb:value",
        "--mm-processor-cache-type:value",
        "--mm-hasher-algorithm:value",
        "--mm-shm-cache-max-object-size-mb:value",
        "--mm-encoder-only",
        "--mm-encoder-tp-mode:value",
        "--mm-encoder-attn-backend:value",
        "--mm-encoder-attn-dtype:value",
        "--mm-encoder-fp8-scale-path:value",
        "--mm-encoder-fp8-scale-save-path:value",
        "--mm-encoder-fp8-scale-save-margin:value",
        "--interleave-mm-strings",
        "--skip-mm-profiling",
        "--video-pruning-rate:value",
        "--video-pruning-method:value",
        "--mm-tensor-ipc:value",
        "--mm-processor-device:value",
        "--mm-ipc-gpu-memory-gb:value",
        "--mm-device-do-normalize",
        "--disable-chunked-mm-input",
        "--disable-mm-preprocessor-cache:switch",
    ),
    # observability
    *_flags(
        IGNORE,
        OWN_LOGS,
        "--logging-config:value",
        "--log-config-file:value",
        "--show-hidden-metrics-for-version:value",
        "--otlp-traces-endpoint:value",
        "--collect-detailed-traces:list",
        "--per-request-spec-decode-metrics:value",
        "--kv-cache-metrics",
        "--kv-cache-metrics-sample:value",
        "--custom-histogram-buckets:value",
        "--cudagraph-metrics",
        "--enable-layerwise-nvtx-tracing",
        "--enable-mfu-metrics",
        "--enable-logging-iteration-details",
        "--jit-monitor-mode:value",
        "--jit-monitor-verbose",
        "--fail-on-environ-validation",
    ),
    # scheduling
    *_flags(
        IGNORE,
        OWN_SCHEDULER,
        "--max-num-scheduled-tokens:value",
        "--max-num-active-seqs:value",
        "--max-num-queued-tokens:value",
        "--long-prefill-token-threshold:value",
        "--long-prefill-token-threshold-adaptive",
        "--scheduler-reserve-full-isl",
        "--watermark:value",
        "--prefill-schedule-interval:value",
        "--num-scheduler-steps:value",
        "--scheduler-delay-factor:value",
        "--preemption-mode:value",
        "--use-v2-block-manager:switch",
        "--disable-async-output-proc:switch",
        "--multi-step-stream-outputs",
    ),
    *_flags(
        IGNORE,
        "ppd always chunks prompts: inline ones beside the decodes within "
        "--max-num-batched-tokens, the prefill worker's by --prefill-batch-tokens",
        "--enable-chunked-prefill",
    ),
    *_flags(
        REFUSE,
        "ppd serves requests first come, first served (per unit, under the PPD router)",
        "--scheduling-policy:value",
        fine=("fcfs",),
    ),
    *_flags(REFUSE, NO_PLUGINS, "--scheduler-cls:value"),
    *_flags(
        IGNORE,
        OWN_KERNELS,
        "--ir-op-priority:value",
        "--enable-flashinfer-autotune",
        "--moe-backend:value",
        "--linear-backend:value",
        "--sparse-indexer-topk-backend:value",
        "--compilation-config -cc:value",
        "--attention-config -ac:value",
        "--kernel-config:value",
        "--additional-config:value",
        "--optimization-level:value",
        "--performance-mode:value",
        "--max-seq-len-to-capture:value",
        "--max-context-len-to-capture:value",
    ),
    *_flags(
        REFUSE,
        NO_SPEC,
        "--speculative-config -sc:value",
        "--spec-method:value",
        "--spec-model:value",
        "--spec-tokens:value",
    ),
    *_flags(REFUSE, "ppd does not watermark its output", "--watermark-config:value"),
    *_flags(REFUSE, "ppd serves autoregressive models only", "--diffusion-config -dc:value"),
    *_flags(
        REFUSE,
        "ppd's prefill and decode workers share one KV cache on each GPU: there is nothing to "
        "transfer (--kv-events-config feeds a router)",
        "--kv-transfer-config:value",
    ),
    *_flags(
        IGNORE,
        TEXT_ONLY,
        "--ec-transfer-config:value",
        "--ec-manager-config:value",
    ),
    *_flags(IGNORE, "ppd has no n-gram memory", "--engram-config:value"),
    *_flags(
        IGNORE,
        "ppd splits the thinking off by --reasoning-parser alone",
        "--reasoning-config:value",
    ),
    *_flags(
        IGNORE,
        "ppd's structured outputs use xgrammar, always",
        "--structured-outputs-config:value",
        "--guided-decoding-backend:value",
    ),
    *_flags(IGNORE, "ppd returns no auxiliary outputs", "--aux-output-config:value"),
    *_flags(IGNORE, "ppd profiles with `ppd bench engine`", "--profiler-config:value"),
    *_flags(
        REFUSE, "ppd loads weights from the model folder only", "--weight-transfer-config:value"
    ),
    *_flags(
        IGNORE,
        "ppd's API servers are their own processes already (--api-server-count)",
        "--disable-frontend-multiprocessing:switch",
    ),
    *_flags(REFUSE, "edit rope_scaling in the folder's config.json", "--rope-scaling:value"),
    *_flags(REFUSE, "edit rope_theta in the folder's config.json", "--rope-theta:value"),
    *_flags(IGNORE, "ppd tokenizes in its API servers", "--tokenizer-pool-size:value"),
    *_flags(
        REFUSE,
        "ppd starts its own worker processes (vLLM's mp)",
        "--worker-use-ray:switch",
        "--engine-use-ray:switch",
    ),
]


def add_vllm_only_args(p: argparse.ArgumentParser) -> None:
    """VLLM_FLAGS, hidden from --help (docs/vllm-flags.md lists them), each storing what
    was given under its dest for check_vllm_only_args."""
    for flag in VLLM_FLAGS:
        if flag.arity == "flag":
            p.add_argument(
                *flag.names,
                dest=flag.dest,
                action=argparse.BooleanOptionalAction if flag.negatable else "store_true",
                default=None,
                help=argparse.SUPPRESS,
            )
        else:
            nargs = {"value": None, "list": "+", "optional": "?"}[flag.arity]
            p.add_argument(
                *flag.names,
                dest=flag.dest,
                nargs=nargs,
                const="" if flag.arity == "optional" else None,
                default=None,
                help=argparse.SUPPRESS,
            )


def check_vllm_only_args(args: argparse.Namespace) -> None:
    """Each of VLLM_FLAGS given: logged as a no-op, or refused (UsageError) in one line."""
    from server.plan import UsageError

    for flag in VLLM_FLAGS:
        value = getattr(args, flag.dest, None)
        if value is None:
            continue
        shown = shown_flag(flag, value)
        if flag.action == REFUSE and value is not False and not _fine(flag, value):
            raise UsageError(f"{shown}: {flag.why}; leave it out")
        log.info("%s (vLLM's): no effect in ppd: %s", shown, flag.why)


def _fine(flag: VllmFlag, value: object) -> bool:
    if not flag.fine:
        return False
    values = value if isinstance(value, list) else [value]
    return all(str(v).strip() in flag.fine for v in values)


def shown_flag(flag: VllmFlag, value: object) -> str:
    """The flag as given, for messages."""
    if value is True:
        return flag.names[0]
    if value is False:
        return "--no-" + flag.names[0][2:]
    if isinstance(value, list):
        return f"{flag.names[0]} {' '.join(map(str, value))}"
    return f"{flag.names[0]} {value}".rstrip()


def flags_markdown() -> str:
    """docs/vllm-flags.md's table of VLLM_FLAGS (tests/server/test_vllm_flags.py keeps the file
    equal to it)."""
    rows = [
        f"| `{' '.join(f.names)}` | "
        + ("refused" if f.action == REFUSE else "no effect, logged")
        + (f" (taken as given: {', '.join(f'`{v}`' for v in f.fine if v)})" if f.fine else "")
        + f" | {f.why} |"
        for f in VLLM_FLAGS
    ]
    return (
        f"# vLLM's flags ppd has none of its own for\n\n"
        f"`ppd serve` takes every flag of `vllm serve` {VLLM_VERSION}. The flags ppd implements "
        "with vLLM's meaning are in [serving.md](serving.md#vllms-flags); these are the rest: a "
        "no-op said in the log where it tunes something ppd does not have or need, refused in "
        "one line where ignoring it would serve something other than what was asked. Generated "
        "from `server/vllm_cli.py` (`python -c 'from server.vllm_cli import flags_markdown; "
        'print(flags_markdown(), end="")\' > docs/vllm-flags.md`).\n\n'
        "| flag | ppd | why, and what ppd does instead |\n| --- | --- | --- |\n"
        + "\n".join(rows)
        + "\n"
    )
