"""bench/gpu_check: what a device call relies on: every step's command for the GPU host and for the
CPU rehearsal, time limits that stop a step with all it started, verdicts for steps that measured
nothing, an archive under the device's 16 MiB that is written whatever happens, and resuming from
an earlier call's results."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest

from bench import gpu_check
from bench.gpu_check import (
    LLAMA,
    STANDIN,
    Mode,
    Step,
    main,
    pack,
    plan,
    resume_from,
    run_call,
    run_step,
)
from bench.interference import GPU_CONFIGS

ALL_STEPS = [
    "host",
    "probe",
    "tests",
    "engine",
    "engine-host",
    "engine-tp",
    "sampling",
    "compare",
    "kernels",
    "gemm-shares",
    "policy",
    "policy-eval:balanced",
    "policy-verdict",
    "partition",
    "partition-compare",
    "interference",
    "frontend",
    "frontend:2",
]
PY = sys.executable


@pytest.mark.parametrize("rehearse", [False, True])
def test_every_step_plans_a_command_that_writes_inside_outdir(
    tmp_path: Path, rehearse: bool
) -> None:
    steps = [s for name in ALL_STEPS for s in plan(name, tmp_path, Mode(rehearse))]
    names = [s.name for s in steps]
    assert len(names) == len(set(names)), "two steps would write the same log"
    for step in steps:
        text = " ".join(step.argv)
        assert 0 < step.limit_s < 600, step
        for glob in step.outputs:
            assert not glob.startswith("/") and ".." not in glob
        for arg in step.argv:  # every path a step writes to is under OUTDIR
            if arg.startswith("/") and arg != sys.executable and "python" not in arg:
                assert arg.startswith(str(tmp_path)), (step.name, arg)
        if "--serve-args" in step.argv and "frontend" not in step.name:
            serve = step.argv[step.argv.index("--serve-args") + 1]
            assert (STANDIN if rehearse else LLAMA) in serve and "--skip-tokenizer-init" in serve
            assert ("--device cpu" if rehearse else "--device cuda") in serve
            if rehearse:
                assert "--partition mps" not in serve and "--partition green" not in serve
        if rehearse and step.name in ("engine", "engine-host", "sampling", "partition"):
            assert STANDIN in text and "--device cpu" in text


def test_gpu_plan_measures_the_issues_shapes(tmp_path: Path) -> None:
    (interference,) = plan("interference", tmp_path, Mode(False))
    args = " ".join(interference.argv)
    assert "--batch 64" in args and "--prefill-tokens 4096" in args and "--gpus 0" in args
    (some,) = plan("interference:aggregated,green", tmp_path, Mode(False))
    assert some.argv[-2:] == ("--only", "aggregated,green")
    compares = plan("partition-compare", tmp_path, Mode(False))
    assert [s.name for s in compares] == [
        "partition-compare-none",
        "partition-compare-mps",
        "partition-compare-green",
    ]
    # aggregated runs one worker per unit: nothing to partition, and `ppd serve` refuses it with
    # green
    policies = [s.argv[s.argv.index("--policies") + 1] for s in compares]
    assert policies == ["pd,aggregated", "pd", "pd"]
    assert [s.name for s in plan("frontend:1,8", tmp_path, Mode(False))] == [
        "frontend-1",
        "frontend-8",
    ]
    both = plan("tests", tmp_path, Mode(False))
    assert [s.name for s in both] == ["tests-gpu", "tests-kernels"]
    assert plan("tests-gpu", tmp_path, Mode(False)) == both[:1]
    assert plan("tests-kernels", tmp_path, Mode(False)) == both[1:]


def test_the_moe_step_times_qwen3_30b_a3b_and_its_kernels(tmp_path: Path) -> None:
    """On the GPU the engine at Qwen3-30B-A3B's configuration, then the fused layer's sweep; the
    rehearsal runs the engine on the CPU's shrunk stand-in."""
    engine, kernels = plan("moe", tmp_path, Mode(False))
    assert "bench/models/qwen3-30b-a3b" in engine.argv and "--quick" not in engine.argv
    assert kernels.argv[-4:-2] == ("--only", "moe")
    assert engine.expected_s + kernels.expected_s <= 8 * 60, "about 8 minutes of GPU time"
    rehearsed, _ = plan("moe", tmp_path, Mode(True))
    text = " ".join(rehearsed.argv)
    assert "qwen3-30b-a3b-standin" in text and "--device cpu" in text and "--quick" in text


def test_gemm_shares_is_a_step_of_its_own_that_rehearses_as_a_start(tmp_path: Path, capsys) -> None:
    """On the GPU it must write its JSON; on the CPU it only reads the shapes and says there is no
    CUDA (as `kernels`), so the rehearsal checks that it starts and exits 0, and asks for no
    output."""
    (gpu,) = plan("gemm-shares", tmp_path, Mode(False), PY)
    (cpu,) = plan("gemm-shares", tmp_path, Mode(True), PY)
    assert (
        gpu.argv == cpu.argv == (PY, "-m", "bench.gemm_shares", "--out", f"{tmp_path}/gemm-shares")
    )
    assert gpu.outputs == ("gemm-shares/gemm-shares.json",) and cpu.outputs == ()
    assert gpu.expected_s == 40 and gpu.expected_s < gpu.limit_s < 600
    assert "gemm-shares" in gpu_check.STEP_NAMES
    assert main(["--plan", str(tmp_path / "out"), "gemm-shares"]) == 0
    assert "gemm-shares" in capsys.readouterr().out
    outcome = run_step(cpu, tmp_path, 120)
    assert outcome.verdict == "ok", (tmp_path / "gemm-shares.log").read_text()
    assert "needs a CUDA GPU" in (tmp_path / "gemm-shares.log").read_text()


@pytest.mark.parametrize(
    "name",
    [
        "bogus",
        "policy-eval",
        "partition-compare:mps,warp",
        "frontend:0",
        "frontend:x",
        "tests-gpu:test_cli.py",
        "tests-gpu:tests/engine/nope.py",
        "interference:warp",
    ],
)
def test_a_bad_step_is_refused_before_anything_runs(tmp_path: Path, name: str, capsys) -> None:
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        main([str(out), "host", name])
    assert e.value.code == 2
    assert not out.exists()
    err = capsys.readouterr().err
    assert "error:" in err and name.split(":")[0] in err


def _step(name: str, code: str, limit_s: int = 60, outputs: tuple[str, ...] = ()) -> Step:
    return Step(name, (PY, "-c", textwrap.dedent(code)), limit_s, outputs)


def test_verdicts_ok_failed_and_a_step_that_wrote_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    steps = [
        _step("writes", f"open({str(out / 'r.json')!r}, 'w').write('{{}}')", outputs=("r.json",)),
        _step("fails", "raise SystemExit(3)", outputs=("f.json",)),
        _step("silent", "print('nothing to measure')", outputs=("s/*.json",)),
    ]
    outcomes = run_call(steps, out, budget_s=300)
    assert [(o.verdict, o.rc) for o in outcomes] == [("ok", 0), ("failed", 3), ("no-output", 0)]
    assert outcomes[2].missing == ["s/*.json"]
    assert "nothing to measure" in (out / "silent.log").read_text()
    recorded = json.loads((out / "steps.json").read_text())
    assert [r["verdict"] for r in recorded] == ["ok", "failed", "no-output"]
    assert "== silent: no-output, exit 0" in (out / "status.txt").read_text()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_step_past_its_limit_is_stopped_with_what_it_started(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    pid_file = tmp_path / "server.pid"
    # The step starts a "server" in a session of its own (out of the step's process group) that
    # ignores SIGTERM, then hangs: both must be gone when the call goes on, and the archive must
    # still be written.
    code = f"""
        import subprocess, sys, time
        server = subprocess.Popen([sys.executable, "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"],
            start_new_session=True)
        open({str(pid_file)!r}, "w").write(str(server.pid))
        time.sleep(600)
    """
    started = time.monotonic()
    archive = tmp_path / "call.tar.gz"
    outcomes = run_call(
        [_step("hangs", code, limit_s=3), _step("after", "print('next')")],
        out,
        budget_s=300,
        archive=archive,
    )
    assert time.monotonic() - started < 60
    assert [o.verdict for o in outcomes] == ["timeout", "ok"]
    server = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(server), "the step's server outlived it"
    with tarfile.open(archive) as tar:
        assert {"steps.json", "hangs.log", "after.log"} <= set(tar.getnames())


def test_steps_past_the_budget_are_skipped_not_started(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    budget = gpu_check.MIN_STEP_S + gpu_check.STOP_RESERVE_S + 0.5  # room for one step, not two
    outcomes = run_call(
        [_step("first", "import time; time.sleep(1)"), _step("second", "print('ran')")],
        out,
        budget_s=budget,
    )
    assert [o.verdict for o in outcomes] == ["ok", "skipped"]
    assert not (out / "second.log").exists()


def test_the_archive_fits_the_limit_by_cutting_the_largest_log(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "summary.json").write_text('{"a": 1}')
    (out / "sub" / "serve.log").write_bytes(os.urandom(3 * 2**20))  # incompressible
    (out / "small.log").write_bytes(os.urandom(600 * 1024))
    archive = tmp_path / "a.tar.gz"
    cut = pack(out, archive, limit=2**20 + 200 * 1024)
    assert archive.stat().st_size <= 2**20 + 200 * 1024
    assert cut and cut[0].startswith("sub/serve.log")
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
        assert {"summary.json", "TRUNCATED.txt", "sub/serve.log"} <= names
        assert tar.extractfile("summary.json").read() == b'{"a": 1}'


def test_resuming_copies_results_but_not_the_earlier_calls_logs(tmp_path: Path) -> None:
    earlier, out = tmp_path / "call1", tmp_path / "out"
    (earlier / "policy-eval" / "balanced").mkdir(parents=True)
    (earlier / "policy.json").write_text("old table")
    (earlier / "policy-eval" / "balanced" / "summary.json").write_text("[]")
    (earlier / "policy-eval" / "balanced" / "serve.log").write_text(
        "kept: a server's log inside a result"
    )
    for name in ("policy.log", "steps.json", "status.txt", "host.txt", "command.txt", "stdout.txt"):
        (earlier / name).write_text("the earlier call's")
    out.mkdir()
    (out / "policy.json").write_text("newer table")
    copied = resume_from(earlier, out)
    assert sorted(copied) == ["policy-eval/balanced/serve.log", "policy-eval/balanced/summary.json"]
    assert (out / "policy.json").read_text() == "newer table"
    assert not any(
        (out / name).exists() for name in ("steps.json", "policy.log", "command.txt", "stdout.txt")
    )


def test_sigterm_during_a_step_still_writes_the_archive(tmp_path: Path) -> None:
    out, archive = tmp_path / "out", tmp_path / "call.tar.gz"
    out.mkdir()
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from bench.gpu_check import Step, run_call
        code = "import time; print('started', flush=True); time.sleep(600)"
        run_call([Step("long", (sys.executable, "-c", code), 300)], Path({str(out)!r}), 300,
                 Path({str(archive)!r}))
    """)
    proc = subprocess.Popen(
        [PY, "-c", script], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2]
    )
    for line in proc.stdout:
        if line.startswith("started"):
            break
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    with tarfile.open(archive) as tar:
        assert "long.log" in tar.getnames()
    assert "stopped by a signal" in (out / "status.txt").read_text()
    assert [o["verdict"] for o in json.loads((out / "steps.json").read_text())] == ["stopped"]


def test_every_server_the_gpu_plan_starts_passes_the_servers_partition_planning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each (serve arguments, policy) a GPU step starts is one `ppd serve` accepts on a GPU host
    with MPS installed and cuda-python: a combination it refuses would cost a device call to find
    out (aggregated under green did)."""
    import argparse
    import shlex

    from partition import backends, mps
    from server.args import add_serve_args

    monkeypatch.setattr(backends, "green_available", lambda: True)
    monkeypatch.setattr(backends.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(mps, "existing_mps_pipe_dir", lambda: None)
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    started = 0
    for name in ALL_STEPS + ["partition-compare:green", "interference"]:
        for step in plan(name, tmp_path, Mode(False)):
            if "--serve-args" not in step.argv or "frontend" in step.name:
                continue
            serve = shlex.split(step.argv[step.argv.index("--serve-args") + 1])
            if "--policies" in step.argv:
                extras = [
                    ["--policy", p] for p in step.argv[step.argv.index("--policies") + 1].split(",")
                ]
            else:  # interference: its configurations on a GPU
                extras = [shlex.split(config.args) for config in GPU_CONFIGS.values()]
            for extra in extras:
                args = parser.parse_args([*serve, *extra])
                with_prefill = args.policy != "aggregated"
                backends.plan_partitions(
                    args.partition,
                    "cuda",
                    1,
                    with_prefill,
                    [0],
                    tmp_path,
                    prefill_worker=args.prefill_worker,
                    green_sms=args.green_decode_sms or (),
                    cublas_sm_target=args.cublas_sm_target,
                )
                started += 1
    assert started >= 10


def test_tests_gpu_can_be_narrowed_to_named_files(tmp_path: Path) -> None:
    (step,) = plan(
        "tests-gpu:test_engine.py,tests/server/test_gpu_serve.py,test_green", tmp_path, Mode(False)
    )
    script = step.argv[2]
    # test_engine.py is also tests/bench/'s, which has no gpu test: the name means the one that has
    assert (
        "echo tests/engine/test_engine.py tests/server/test_gpu_serve.py "
        "tests/partition/test_green.py" in script
    )
    assert (
        "--collect-only" not in script
        and step.name == "tests-gpu"
        and step.outputs == ("tests-gpu/*.xml",)
    )
    assert step.expected_s == sum(
        gpu_check.GPU_TEST_S[f] + gpu_check.GPU_TEST_PROCESS_S
        for f in (
            "tests/engine/test_engine.py",
            "tests/server/test_gpu_serve.py",
            "tests/partition/test_green.py",
        )
    )
    assert step.expected_s < step.limit_s < 600


def test_a_narrowed_tests_gpu_step_runs_each_file_in_its_own_process(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    steps = plan(
        "tests-gpu:test_backends", out, Mode(True), PY
    )  # one gpu test: it skips without CUDA
    (outcome,) = run_call(steps, out, budget_s=300)
    assert outcome.verdict == "ok", (out / "tests-gpu.log").read_text()[-2000:]
    assert [p.name for p in (out / "tests-gpu").iterdir()] == ["test_backends.xml"]
    assert "== tests/partition/test_backends.py" in (out / "tests-gpu.log").read_text()


# bench/interference.py's configurations in both the forms it has had: strings, and records made
# from them.
STATIC_CONFIGS = """
CPU_CONFIGS = {"aggregated": "--policy aggregated", "none": "--policy pd --partition none",
               "cpu": "--policy pd --partition cpu",
               "thread": "--policy pd --partition none --prefill-worker thread"}
GPU_CONFIGS: dict[str, Config] = {
    "none": Config("--policy pd --partition none", "every SM"),
    "mps": Config("--policy pd --partition mps"),
    "green-static-64": Config("--policy pd --partition green --green-decode-sms 64", "64 SMs"),
    "green-static-96": Config("--policy pd --partition green --green-decode-sms 96", "96 SMs"),
    "mps-40": Config("--policy pd --partition mps --mps-prefill-percent 40", "every SM")}
GPU_DEFAULT = ("none", "mps")
"""


def test_interference_takes_any_gpu_configuration_and_rehearses_each_as_its_partitions_cpu_standin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "interference.py"
    source.write_text(STATIC_CONFIGS)
    monkeypatch.setattr(gpu_check, "INTERFERENCE", source)
    names = "none,green-static-64,mps-40,green-static-96"
    (gpu,) = plan(f"interference:{names}", tmp_path, Mode(False))
    assert gpu.argv[-2:] == ("--only", names) and gpu.expected_s == 4 * gpu_check.INTERFERENCE_S
    (cpu,) = plan(f"interference:{names}", tmp_path, Mode(True))
    assert cpu.argv[-2:] == ("--only", "none,thread,cpu")  # green's stand-in once
    (same,) = plan(
        "interference:cpu,aggregated", tmp_path, Mode(True)
    )  # the CPU's own names as they are
    assert same.argv[-2:] == ("--only", "cpu,aggregated")
    with pytest.raises(
        ValueError,
        match="no GPU configuration green-static-128 .*there are none, mps, green-static",
    ):
        plan("interference:none,green-static-128", tmp_path, Mode(False))
    with pytest.raises(
        ValueError, match="no configuration 'warp' to rehearse on the CPU .*CPU: aggregated, none"
    ):
        plan("interference:none,warp", tmp_path, Mode(True))
    (default,) = plan("interference", tmp_path, Mode(False))  # GPU_DEFAULT's
    assert "--only" not in default.argv and default.expected_s == 2 * gpu_check.INTERFERENCE_S


def test_the_default_budget_leaves_room_for_the_wheels_inside_a_device_command() -> None:
    assert gpu_check.DEFAULT_BUDGET_S + gpu_check.WHEELS_S <= gpu_check.DEVICE_COMMAND_S
    # What the H200's calls spent outside their steps (wheel install, host facts, packing): wall
    # less steps.
    for call, wall in (("call1", 371.6), ("call4", 535.6)):
        steps = json.loads(
            (
                Path(__file__).parents[2] / "bench/results/nvidia-h200" / call / "steps.json"
            ).read_text()
        )
        assert wall - sum(s["seconds"] for s in steps) < gpu_check.WHEELS_S


def test_a_call_whose_last_step_overruns_still_ends_packed_within_its_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last step ignores SIGTERM and never ends: it is stopped at what is left less the time to
    stop it, so the kill's grace and the packing both fit the budget."""
    for name, value in (
        ("MIN_STEP_S", 1),
        ("KILL_GRACE_S", 2),
        ("COPIER_JOIN_S", 1),
        ("STOP_RESERVE_S", 3),
        ("PACK_RESERVE_S", 2),
    ):
        monkeypatch.setattr(gpu_check, name, value)
    out, archive = tmp_path / "out", tmp_path / "call.tar.gz"
    out.mkdir()
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    started = time.monotonic()
    outcomes = run_call(
        [_step("stubborn", stubborn, limit_s=500)], out, budget_s=9, archive=archive
    )
    assert time.monotonic() - started <= 9
    assert [o.verdict for o in outcomes] == ["timeout"] and outcomes[0].limit_s <= 9 - 3 - 2
    assert archive.exists()


def planned_calls() -> list[list[str]]:
    """The gpu_check.sh commands of docs/gpu.md's "Next on a GPU", as argument lists."""
    import shlex

    text = (Path(__file__).parents[2] / "docs" / "gpu.md").read_text()
    section = text[text.index("**Next on a GPU.**") : text.index("### Tensor parallelism")]
    return [
        shlex.split(line)[1:]
        for line in section.splitlines()
        if line.startswith("bench/gpu_check.sh")
    ]


def test_the_planned_calls_fit_the_window(tmp_path: Path, capsys) -> None:
    """The next window's two commands, as docs/gpu.md writes them: each fits its budget; the first's
    fixed steps leave `policy` (resumable, last) at least 250 s, the second (the same OUTDIR on the
    warm machine) checks greedy ids first; with a machine start of 2 minutes both fit 15 minutes of
    device time."""
    first, second = planned_calls()
    device_s = 120
    for argv in (first, second):
        assert main(["--plan", *[a.replace("$OUT", str(tmp_path)) for a in argv]]) == 0
        assert ": fits" in capsys.readouterr().out
        budget = (
            float(argv[argv.index("--budget") + 1])
            if "--budget" in argv
            else gpu_check.DEFAULT_BUDGET_S
        )
        device_s += budget + gpu_check.WHEELS_S
    assert device_s <= 15 * 60
    steps = [
        s
        for name in first[first.index("/tmp/gc") + 1 : -1]
        for s in plan(name, tmp_path, Mode(False))
    ]
    assert sum(s.expected_s for s in steps) + 250 <= gpu_check.steps_room_s(
        gpu_check.DEFAULT_BUDGET_S
    )
    assert (
        first[-1] == second[-1] == "policy"
        and second[second.index("/tmp/gc") + 1] == "tests-gpu:test_engine.py"
    )
    # A budget the fixed steps do not fit is refused by --plan.
    assert (
        main(
            [
                "--plan",
                "--budget",
                "120",
                str(tmp_path / "out"),
                *first[first.index("/tmp/gc") + 1 :],
            ]
        )
        == 1
    )


def test_the_import_check_covers_every_module_but_never_runs_a_main() -> None:
    """`host` imports every module of the project: a package's __main__ would run the command line
    (cli/__main__.py: ppd's usage and exit 2, failing the step on the GPU host)."""
    names = gpu_check.project_modules()
    assert {"cli", "cli.main", "bench.gpu_check", "server.routing.policy"} <= set(names)
    assert not [name for name in names if name.endswith("__main__")]
