"""`vllm serve`'s command lines through `ppd serve`: every flag of the vLLM release the README names
(vllm_serve_flags_0.32.0.txt, its own parser's list) taken or refused in one line; vLLM's spellings
(--config YAML, underscores, -O3, dotted JSON fields, half, 32k); the flags ppd takes with vLLM's
meaning reaching what they set."""

from __future__ import annotations

import argparse
import functools
import json
import logging
from pathlib import Path

import pytest

import server.plan
from cli.main import OneLineParser, main
from server.args import add_serve_args
from server.plan import UsageError
from server.vllm_cli import VLLM_FLAGS, VLLM_VERSION, VllmCliError, human_int, vllm_argv

FLAGS = Path(__file__).with_name(f"vllm_serve_flags_{VLLM_VERSION}.txt")
VLLM_ONLY = {flag.names[0] for flag in VLLM_FLAGS}  # the flags ppd has none of its own for


def vllm_flags() -> list[tuple[list[str], str, str]]:
    """(names, arity, a value) of every flag in the list."""
    out = []
    for line in FLAGS.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        names, arity, *value = (part.strip() for part in line.split("|"))
        out.append((names.split(), arity, value[0] if value else ""))
    return out


@functools.cache
def serve_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="ppd serve")
    add_serve_args(parser)
    return parser


def parse(*argv: str) -> argparse.Namespace:
    return serve_parser().parse_args(vllm_argv(list(argv)))


def test_the_list_is_vllms_whole_serve_command_line() -> None:
    flags = vllm_flags()
    assert len(flags) > 300
    known = set(serve_parser()._option_string_actions)
    assert [n for names, _, _ in flags for n in names if n not in known] == [], "every alias too"
    assert all(arity in ("flag", "value", "list", "optional") for _, arity, _ in flags)
    named = {name for names, _, _ in flags for name in names}
    for common in ("--enable-chunked-prefill", "--kv-cache-dtype", "--enable-lora", "-tp"):
        assert common in named


@pytest.mark.parametrize(("names", "arity", "value"), vllm_flags(), ids=lambda x: str(x))
def test_every_vllm_flag_is_taken_or_refused_in_one_line(
    names: list[str], arity: str, value: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Each flag, with a value a launch script gives it, either parses and passes ppd's checks of
    vLLM's flags, or is refused with one line naming it; never argparse's usage screen. A flag
    ppd has none of its own for, taken, says in the log that it has no effect."""
    given = {"flag": [], "list": value.split(" ")}.get(arity, [value] if value else [])
    with caplog.at_level(logging.INFO, logger="ppd.serve"):
        try:
            server.plan.vllm_flags(parse(names[0], *given))
        except UsageError as exc:
            assert "\n" not in str(exc) and names[0] in str(exc), str(exc)
            return
        except SystemExit as exc:
            pytest.fail(f"{names[0]} {value}: argparse refused it ({exc})")
    if names[0] in VLLM_ONLY:
        logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith(names[0])]
        assert logged and "no effect in ppd" in logged[0], logged


def test_an_unknown_flag_and_a_refused_one_are_one_line_on_the_command_line(
    capsys: pytest.CaptureFixture,
) -> None:
    for argv, says in (
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag (not a flag of ppd serve nor"),
        (["--enable-lora"], "--enable-lora: ppd serves one set of weights"),
        (["--speculative-config", '{"method": "ngram"}'], "no speculative decoding"),
        (["--dtype", "int3"], "argument --dtype: invalid choice"),
    ):
        try:
            code = main(["serve", *argv])
        except SystemExit as exc:  # argparse's own errors exit from the parser
            code = exc.code
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1, lines
        assert lines[0].startswith("ppd serve: error: ") and says in lines[0], lines[0]


def test_vllm_spellings() -> None:
    assert vllm_argv(["m", "--max_model_len", "4k", "--gpu_memory_utilization=0.8"]) == [
        "m",
        "--max-model-len",
        "4k",
        "--gpu-memory-utilization=0.8",
    ]
    assert vllm_argv(["-O3"]) == ["--optimization-level", "3"]
    assert vllm_argv(["-O", "2"]) == ["--optimization-level", "2"]
    assert vllm_argv(["--help=cache"]) == ["--help"]
    dotted = vllm_argv(
        ["--compilation-config.mode", "3", "--compilation_config.cudagraph_mode=FULL"]
    )
    assert dotted[0] == "--compilation-config"
    assert json.loads(dotted[1]) == {"mode": 3, "cudagraph_mode": "FULL"}
    assert human_int("32k") == 32_000 and human_int("32K") == 32_768 and human_int("1m") == 10**6
    assert human_int("25.6k") == 25_600 and human_int("4096") == 4096
    args = parse("--dtype", "half", "--max-model-len", "32k", "--log-level", "WARNING")
    assert (args.dtype, args.max_model_len, args.log_level) == ("float16", 32_000, "warning")
    assert parse("--dtype", "float").dtype == "float32"
    assert parse("--max-model-len", "auto").max_model_len is None
    assert parse("--max-model-len", "-1").max_model_len is None
    assert parse("--max-num-batched-tokens", "8K").max_num_batched_tokens == 8192
    assert parse("--no-enforce-eager").enforce_eager is False
    assert parse("--attention-backend", "FLASH_ATTN").attention_backend == "FLASH_ATTN"


def test_a_config_file_sets_flags_the_command_line_overrides(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(
        "port: 9001\nmax_num_seqs: 8\nenforce-eager: true\nenable-prefix-caching: true\n"
        "served-model-name: [x, y]\ncompilation-config:\n  mode: 3\n"
    )
    args = parse("demo", "--config", str(config), "--max-num-seqs", "4")
    assert args.model_tag == "demo" and args.port == 9001 and args.max_num_seqs == 4
    assert args.enforce_eager is True and args.served_model_name == ["x", "y"]
    assert json.loads(args.vllm_compilation_config) == {"mode": 3}
    no_model = parse("--config", str(config))
    assert no_model.model_tag is None and no_model.port == 9001
    for bad, says in (
        ("serve.json", "give a .yaml or .yml file"),
        ("missing.yaml", "cannot read it"),
    ):
        path = tmp_path / bad
        if bad.endswith("json"):
            path.write_text("{}")
        with pytest.raises(VllmCliError, match=says):
            vllm_argv(["--config", str(path)])
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(VllmCliError, match="mapping of flag names"):
        vllm_argv(["--config", str(tmp_path / "list.yaml")])


def test_vllm_names_of_ppd_settings_set_them() -> None:
    def checked(*argv: str) -> argparse.Namespace:
        args = parse(*argv)
        server.plan.vllm_flags(args)
        return args

    args = checked(
        "--kv-cache-memory-bytes",
        "2G",
        "--num-gpu-blocks-override",
        "512",
        "--max-num-queued-reqs",
        "64",
        "--device-ids",
        "0,1",
        "--max-cudagraph-capture-size",
        "128",
    )
    assert (args.kv_cache_memory, args.num_kv_blocks, args.max_waiting_requests) == (2.0, 512, 64)
    assert (args.gpus, args.max_graph_tokens) == ("0,1", 128)
    assert checked("--cudagraph-capture-sizes", "1", "2", "4", "64").max_graph_tokens == 64
    assert checked("-dpl", "2").units == 2
    assert checked("--attention-backend", "FLASH_ATTN").attention_backend == "auto"
    with pytest.raises(UsageError, match="the same setting"):
        checked("--num-gpu-blocks-override", "512", "--num-kv-blocks", "256")
    with pytest.raises(UsageError, match="ppd's are auto"):
        checked("--attention-backend", "flash")
    with pytest.raises(UsageError, match="--ssl-keyfile and --ssl-certfile"):
        checked("--ssl-keyfile", "k.pem")
    with pytest.raises(UsageError, match="--reasoning-parser"):
        checked("--enable-reasoning")
    accepted = checked("--runner", "generate", "--distributed-executor-backend", "mp", "-n", "1")
    assert accepted.vllm_runner == "generate"
    with pytest.raises(UsageError, match="--runner pooling: ppd serves generative models only"):
        checked("--runner", "pooling")
    with pytest.raises(UsageError, match="--cpu-offload-gb 4"):
        checked("--cpu-offload-gb", "4")
    assert checked("--cpu-offload-gb", "0").vllm_cpu_offload_gb == "0"


def test_the_docs_list_every_flag_as_the_code_takes_it() -> None:
    from server.vllm_cli import flags_markdown

    docs = Path(__file__).parents[2] / "docs" / "vllm-flags.md"
    assert docs.read_text() == flags_markdown(), (
        "regenerate docs/vllm-flags.md (its header says how)"
    )
