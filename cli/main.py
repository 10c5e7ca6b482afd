"""`ppd`: the command line. `ppd serve` (the OpenAI-compatible server), `ppd bench` (load it), `ppd
probe` (what this machine supports), `ppd profile` (measure it and build the tables the server
reads). It sits on top of every other folder, and imports each command's code only when that command
runs, so `ppd --help` answers fast."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import NoReturn

from server.args import add_serve_args, show_defaults
from server.vllm_cli import VLLM_VERSION, VllmCliError, vllm_argv


class OneLineParser(argparse.ArgumentParser):
    """A parser whose errors are one line naming the problem, not argparse's usage screen (a `vllm
    serve` flag ppd does not know must not bury its name under two hundred others)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = OneLineParser(
        prog="ppd", description="ppd-serve: multi-turn LLM serving with PPD routing"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_args(sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API"))
    # `ppd serve` builds its own parser only: the others import the benchmarks and the profiler,
    # seconds of every server's start.
    serving = argv[:1] == ["serve"]
    profile_parsers = {} if serving else add_other_commands(sub)
    show_defaults(parser)
    if serving:
        try:
            argv = argv[:1] + vllm_argv(argv[1:])
        except VllmCliError as exc:
            print(f"ppd serve: error: {exc}", file=sys.stderr)
            return 2
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command = f"ppd {args.command}"
        also = f" nor a `vllm serve` {VLLM_VERSION} flag" if serving else ""
        print(
            f"{command}: error: unrecognized arguments: {' '.join(unknown)} (not a flag of "
            f"{command}{also}); see `{command} --help`",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(
        level=getattr(args, "log_level", "info").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    from server.plan import UsageError

    try:
        return run(args, profile_parsers)
    except UsageError as exc:
        print(f"ppd {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: everything was stopped on the way out; no traceback
        print(f"ppd {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if serving:
            raise
        from bench.common import BenchError, Unmeasured
        from partition.profiler import ProfilerError

        if isinstance(exc, Unmeasured):
            # the run went, and what it measured is written: it fails for what it could not
            print(f"ppd {args.command}: {exc}", file=sys.stderr)
            return 1
        if isinstance(exc, (BenchError, ProfilerError)):
            print(f"ppd {args.command}: error: {exc}", file=sys.stderr)
            return 2
        raise


def add_other_commands(sub: argparse._SubParsersAction) -> dict[str, argparse.ArgumentParser]:
    """`ppd bench`, `ppd probe` and `ppd profile`'s parsers; returns the profile subcommands'
    (`ppd profile` alone runs each, in order)."""
    from bench.cli import add_bench_args

    add_bench_args(
        sub.add_parser(
            "bench",
            help="load an OpenAI-compatible server with multi-turn conversations "
            "(`ppd bench compare`: policies and peers side by side; "
            "`ppd bench engine`: the engine against the hardware's floors)",
        )
    )
    from partition.probe import add_probe_args

    add_probe_args(
        sub.add_parser(
            "probe",
            help="what this machine supports: GPUs, CUDA IPC, MPS, green contexts; on a CPU its "
            "vector extensions and the dtype and kernels ppd serve will use",
        )
    )
    profile = sub.add_parser(
        "profile",
        help="measure this machine and build the tables the server uses (no "
        "subcommand: every one, partition then policy, with their defaults)",
    )
    profile.add_argument(
        "--quick",
        dest="profile_quick",
        action="store_true",
        help="with no subcommand: every profile on its small grid",
    )
    profiles = profile.add_subparsers(dest="profile_command")
    from bench.policy_profile import (
        add_policy_args,
    )  # in bench/: it loads a server with the load generator
    from partition.profiler_cli import add_partition_args

    partition_parser = profiles.add_parser(
        "partition",
        help="SM/core shares: decode step time, prefill speed and "
        "their interference, per share ($PPD_CACHE_DIR/profiles/<device>__<model>.json)",
    )
    add_partition_args(partition_parser)
    policy_parser = profiles.add_parser(
        "policy",
        help="the ppd policy's table: turn-2 latency by route, per workload "
        "cell ($PPD_CACHE_DIR/profiles/<device>__<model>__policy.json)",
    )
    add_policy_args(policy_parser)
    from bench.tier_profile import add_tier_args

    tier_parser = profiles.add_parser(
        "tier",
        help="the second KV tier's copy rate for a model's blocks, which the ppd policy counts a "
        "tier-cached prefix's load at ($PPD_CACHE_DIR/profiles/<device>__<model>__tier.json)",
    )
    add_tier_args(tier_parser)
    return {"partition": partition_parser, "policy": policy_parser, "tier": tier_parser}


def run(args: argparse.Namespace, profile_parsers: dict[str, argparse.ArgumentParser]) -> int:
    """The command the arguments name."""
    if args.command == "serve":
        from server.serve import serve

        serve(args)
    elif args.command == "bench":
        from bench.cli import main as bench_main

        bench_main(args)
    elif args.command == "probe":
        from partition.probe import run_probe

        return run_probe(args)
    elif args.command == "profile":
        from bench import policy_profile, tier_profile
        from partition import profiler_cli

        mains = {
            "partition": profiler_cli.main,
            "policy": policy_profile.main,
            "tier": tier_profile.main,
        }
        if args.profile_command:
            mains[args.profile_command](args)
        else:
            for name, run_profile in mains.items():
                run_profile(
                    profile_parsers[name].parse_args(["--quick"] if args.profile_quick else [])
                )
    return 0
