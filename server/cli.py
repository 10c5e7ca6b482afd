"""`ppd` command line: `ppd serve` starts the units and the OpenAI-compatible API."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass

from engine.config import ModelConfig, ModelError, check_model_folder, resolve_dtype
from engine.demo import DEMO_MODEL, demo_model_path
from engine.model import kv_block_nbytes
from partition import PARTITIONS
from partition.cpu import available_cores, split_cores
from scheduler.config import POLICIES, UnitConfig
from scheduler.policy import DEFAULT_PPD_MAX_APPEND, Policy
from scheduler.router import Router

log = logging.getLogger("ppd")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEMO_MODEL,
                   help="a local Hugging Face model folder, or 'demo' (default): a small built-in model with random weights")
    p.add_argument("--served-model-name", default=None, help="the name clients use in 'model' (default: the folder name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and KV dtype; auto = the checkpoint's")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                   help="dummy: random weights of the folder's config (for benchmarks without the weights)")
    p.add_argument("--policy", default="ppd", choices=POLICIES,
                   help="where turn-2+ append-prefills run: pd = prefill worker, dlocal = decode worker, ppd = per request, "
                        "aggregated = one worker per unit with chunked prefill (the vLLM-default baseline)")
    p.add_argument("--ppd-max-append", type=int, default=DEFAULT_PPD_MAX_APPEND,
                   help="ppd: append-prefills of at most this many uncached tokens run on the decode worker")
    p.add_argument("--units", type=int, default=1, help="worker units (decode + prefill worker pairs) on this machine")
    p.add_argument("--partition", default="cpu", choices=PARTITIONS,
                   help="cpu: pin each worker to its own cores; none: let the OS schedule them")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--kv-cache-memory", type=float, default=0.5, help="GiB of KV cache per unit")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks per unit (overrides --kv-cache-memory)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length (prompt + output); default: the model's, capped by what the KV pool holds")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences a decode worker batches")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one forward pass")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


class UsageError(Exception):
    """A bad command line or model folder: printed, exit code 2."""


@dataclass
class ServePlan:
    units: list[UnitConfig]
    model_name: str
    model_path: str
    mcfg: ModelConfig
    num_blocks: int
    max_model_len: int
    ipc_dir: str


def plan_serve(args: argparse.Namespace) -> ServePlan:
    """Resolve and check everything before any process starts."""
    for name in ("units", "block_size", "max_num_seqs", "max_num_batched_tokens", "ppd_max_append"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_num_batched_tokens < args.max_num_seqs:
        raise UsageError(f"--max-num-batched-tokens ({args.max_num_batched_tokens}) must be at least --max-num-seqs "
                         f"({args.max_num_seqs}): every running sequence decodes one token per step")
    path = str(demo_model_path()) if args.model == DEMO_MODEL else os.path.abspath(args.model)
    try:
        mcfg = check_model_folder(path, args.load_format)
        dtype = resolve_dtype(args.dtype, mcfg)
    except ModelError as exc:
        raise UsageError(str(exc)) from exc
    num_blocks = args.num_kv_blocks or int(args.kv_cache_memory * 2**30) // kv_block_nbytes(mcfg, args.block_size, dtype)
    capacity = num_blocks * args.block_size
    max_model_len = args.max_model_len or min(mcfg.max_position_embeddings, capacity)
    if max_model_len > mcfg.max_position_embeddings:
        raise UsageError(f"--max-model-len {max_model_len} exceeds the model's {mcfg.max_position_embeddings} positions")
    if max_model_len > capacity:
        raise UsageError(f"--max-model-len {max_model_len} needs more KV than the pool holds ({capacity} tokens); "
                         "raise --kv-cache-memory or lower --max-model-len")
    with_prefill = args.policy != "aggregated"
    shares = split_cores(available_cores(), args.units, with_prefill) if args.partition == "cpu" else [((), ())] * args.units
    ipc_dir = tempfile.mkdtemp(prefix="ppd-")
    units = [UnitConfig(model=path, unit=u, dtype=args.dtype, load_format=args.load_format, block_size=args.block_size,
                        num_kv_blocks=num_blocks, max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, policy=args.policy, ipc_dir=ipc_dir,
                        shm_prefix=f"ppd-{os.getpid()}", decode_cores=decode, prefill_cores=prefill)
             for u, (decode, prefill) in enumerate(shares)]
    name = args.served_model_name or (DEMO_MODEL if args.model == DEMO_MODEL else os.path.basename(path.rstrip("/")))
    return ServePlan(units, name, path, mcfg, num_blocks, max_model_len, ipc_dir)


def serve(args: argparse.Namespace) -> None:
    # Imported here so `ppd --help` and bad command lines answer fast.
    from server.engine_client import EngineClient
    from server.launcher import Launcher
    from server.metrics import Metrics

    plan = plan_serve(args)
    router = Router(len(plan.units), args.block_size, Policy(args.policy, args.ppd_max_append), plan.num_blocks)
    client = EngineClient(plan.units, router, Metrics(plan.model_name))
    launcher = Launcher(plan.units, client)
    launcher.spawn_all()  # the workers load the model while this process loads the tokenizer and the web stack
    import uvicorn
    from transformers import AutoTokenizer

    from server.api import ServedModel, build_app

    try:
        tokenizer = AutoTokenizer.from_pretrained(plan.model_path)
    except Exception as exc:
        launcher.shutdown()
        shutil.rmtree(plan.ipc_dir, ignore_errors=True)
        raise UsageError(f"cannot load the tokenizer from {plan.model_path}: {exc}") from exc
    model = ServedModel(plan.model_name, plan.model_path, tokenizer, plan.max_model_len, plan.mcfg.vocab_size,
                        plan.mcfg.eos_token_ids)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        client.start()
        starting = asyncio.get_running_loop().create_task(launcher.start())
        starting.add_done_callback(lambda t: t.cancelled() or t.exception() or log.info(
            "ready: %s on http://%s:%d (policy %s, %d unit(s), max_model_len %d)", plan.model_name, args.host, args.port,
            args.policy, len(plan.units), plan.max_model_len))
        try:
            yield
        finally:
            starting.cancel()
            launcher.shutdown()
            client.close()
            shutil.rmtree(plan.ipc_dir, ignore_errors=True)

    def health() -> list[dict]:
        return [{"unit": u, "ready": client.unit_ready(u),
                 "workers": [{"role": role, "pid": pid, "alive": alive} for role, (pid, alive) in launcher.pids(u).items()]}
                for u in range(len(plan.units))]

    app = build_app(model, client, health, lifespan)
    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # A signal to the whole process group reaches the workers too: they are not to be restarted.
            launcher.stopping = True
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    Server(config).run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ppd", description="ppd-serve: multi-turn LLM serving with PPD routing")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_args(sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API"))
    from bench.cli import BenchError, add_bench_args
    add_bench_args(sub.add_parser("bench", help="load an OpenAI-compatible server with multi-turn conversations "
                                                "(`ppd bench compare`: policies and peers side by side)"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    try:
        if args.command == "serve":
            serve(args)
        elif args.command == "bench":
            from bench.cli import main as bench_main
            bench_main(args)
    except (UsageError, BenchError) as exc:
        print(f"ppd {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
