"""Validate a GPU host one device call at a time: `bench/gpu_check.sh [OPTIONS] OUTDIR [STEP ...]`.

A device call runs at most 10 minutes and returns at most 8 files from $OUT, 16 MiB each, so a call
here is built to always come back with its results:
- every step runs under its own time limit, cut to what is left of the call's budget (--budget, 570
  s by default, counted from this program's start), and a step that overruns is stopped with every
  process it started (servers included); the limits leave room inside the budget for stopping the
  last step and packing the archive, and the budget leaves room for gpu_check.sh's wheel install
  inside a device command's 600 s;
- every raw output and log goes into OUTDIR, servers' logs too; each step's verdict into
  OUTDIR/steps.json and status.txt: ok, failed (its exit status), timeout, no-output (exit 0 but a
  file it must write is missing: a step that measured nothing), or skipped (no time left);
- with --archive FILE, OUTDIR is packed into one .tar.gz under 16 MiB at the end, whatever happened
  before (the largest logs are cut in the middle if needed, and TRUNCATED.txt says which);
- --from DIR first copies what an earlier call left (its committed, unpacked results) into OUTDIR,
  so the resumable steps (policy, partition) go on where they stopped and policy-eval finds
  policy.json;
- --plan prints the steps with their limits and expected durations against the budget, and runs
  nothing.

--rehearse runs the same steps on the CPU, with a shrunk stand-in of Llama-3.1-8B
(bench/models/llama-3.1-8b- standin: its vocabulary, rope and head size), small sizes and CPU
partitions in place of MPS and green contexts: every step as far as it goes without CUDA, with the
same checks of exit status and outputs.

Only the standard library is imported here: this must run before the host's packages are known to be
there.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHIVE_LIMIT = 16 * 2**20  # what the device returns of one file
DEVICE_COMMAND_S = 600  # the most a device command runs
# gpu_check.sh's wheel install and Python's start, before the budget's clock starts: 6-8 s on the
# H200 (a call's wall time less its steps' seconds, bench/results/nvidia-h200/call1 and call4,
# packing included), about doubled.
WHEELS_S = 15
DEFAULT_BUDGET_S = 570  # + WHEELS_S = 585 s: inside a device command's 600 s, with 15 s to spare
PACK_RESERVE_S = 20  # kept back from the budget for packing the archive
MIN_STEP_S = 30  # a step is not started with less time than this
KILL_GRACE_S = 10  # from SIGTERM to SIGKILL for a step that overran
COPIER_JOIN_S = 5  # after a step ends, for its last output to reach the log
STOP_RESERVE_S = (
    KILL_GRACE_S + COPIER_JOIN_S
)  # kept back so that the last step, stopped at its limit, ends in time
MARKER = "PPD_GPU_CHECK_STEP"  # in the environment of everything a step starts, to find it again
KEEP_PER_END = 256 * 1024  # bytes kept at each end of a log cut to fit the archive

LLAMA = "bench/models/llama-3.1-8b"
LLAMA_70B = "bench/models/llama-3.1-70b"  # engine-tp: tensor parallelism over the host's GPUs
STANDIN = "bench/models/llama-3.1-8b-standin"
QWEN3_MOE = "bench/models/qwen3-30b-a3b"  # moe: Qwen3-30B-A3B's configuration, random weights
QWEN3_MOE_STANDIN = "bench/models/qwen3-30b-a3b-standin"
DEFAULT_STEPS = ("host", "probe", "tests")
STEP_NAMES = (
    "host probe tests tests-gpu[:FILES] tests-kernels engine engine-host engine-tp[:SIZES] "
    "sampling compare agents moe fp8 "
    "kernels gemm-shares policy "
    "policy-eval:W policy-verdict partition partition-compare[:NAMES] interference[:NAMES] "
    "frontend[:COUNTS] (frontend needs no GPU: run it on the CPU)"
)
# Each gpu test file's pytest time on the H200 (bench/results/nvidia-h200: call4's JUnit XML;
# test_gpu_serve.py from call5), and what a process of its own adds (start, imports, CUDA's start).
GPU_TEST_S = {
    "tests/engine/kernels/test_activation.py": 7,
    "tests/engine/kernels/test_attention.py": 33,
    "tests/engine/kernels/test_norm.py": 5,
    "tests/engine/kernels/test_rope.py": 5,
    "tests/engine/kernels/test_store_kv.py": 2,
    "tests/engine/test_engine.py": 81,
    "tests/engine/test_fp8.py": 40,  # estimated (never run on a GPU): the FP8 kernels JIT-compiled
    "tests/engine/test_guided.py": 8,
    "tests/engine/test_memory_plan.py": 4,
    "tests/engine/test_model_vs_hf.py": 9,
    "tests/engine/test_shared_memory.py": 9,
    "tests/partition/test_backends.py": 1,
    "tests/partition/test_green.py": 10,
    "tests/partition/test_probe.py": 41,
    "tests/partition/test_profiler.py": 11,
    "tests/server/test_gpu_serve.py": 156,
}
GPU_TEST_PROCESS_S = 5
INTERFERENCE = ROOT / "bench" / "interference.py"
# One configuration of `ppd bench interference` on the H200: 40 s measured (call4: 95 s for three;
# call5, call8: 48 s for one), and 10 s estimated (not measured) for its prefill-alone window since:
# six 4K-token prompts (one warming up), each 0.2-0.5 s there, with the 1 s settle after each.
INTERFERENCE_S = 50
# The CPU's stand-in for a GPU configuration, by the partition its serve arguments ask for.
CPU_STANDIN = {"mps": "cpu", "green": "thread", "none": "none"}

# Modules every step needs on the host, beside the project's own (all imported by the host step).
THIRD_PARTY = (
    "torch",
    "triton",
    "transformers",
    "tokenizers",
    "safetensors",
    "numpy",
    "fastapi",
    "starlette",
    "uvicorn",
    "pydantic",
    "zmq",
    "msgspec",
    "prometheus_client",
    "jsonschema",
    "xgrammar",
    "openai",
    "aiohttp",
    "httpx",
    "tqdm",
    "matplotlib",
    "pytest",
    "hypothesis",
    "pynvml",
    "cuda.bindings.driver",
)


@dataclass(frozen=True)
class Step:
    """One command of a call: its time limit (on a GPU, its expected duration plus a margin) and the
    files under OUTDIR (globs) it must leave when it succeeds."""

    name: str
    argv: tuple[str, ...]
    limit_s: int
    outputs: tuple[str, ...] = ()
    expected_s: int | None = (
        None  # on the GPU host: measured there where it ran, else estimated; None: unknown
    )
    resumable: bool = (
        False  # keeps what it measured when stopped and goes on from it (`--from`): last in a call,
    )
    # it takes whatever time is left


@dataclass
class Outcome:
    name: str
    verdict: (
        str  # ok, failed, timeout, no-output, skipped, stopped (the call was stopped while it ran)
    )
    rc: int | None
    seconds: float
    limit_s: int
    command: str
    missing: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Mode:
    """What differs between the GPU host and its rehearsal on the CPU."""

    rehearse: bool

    @property
    def model(self) -> list[str]:
        folder = STANDIN if self.rehearse else LLAMA
        return ["--model", folder, "--load-format", "dummy", "--skip-tokenizer-init"] + self.device

    @property
    def device(self) -> list[str]:
        return ["--device", "cpu"] if self.rehearse else ["--device", "cuda"]

    @property
    def engine_model(self) -> tuple[str, ...]:
        """For the steps that time the engine alone: the stand-in on the CPU; on a GPU their
        default, Llama-3.1-8B."""
        return ("--model", STANDIN, "--device", "cpu") if self.rehearse else ()

    def pick(self, gpu, cpu):
        return cpu if self.rehearse else gpu


def plan(name: str, out: Path, mode: Mode, python: str = "python3") -> list[Step]:
    """The steps STEP name stands for (some names expand to one step per configuration); ValueError
    if unknown."""
    ppd = (python, "-m", "cli")
    serve = shlex.join(mode.model)
    quick = ("--quick",) if mode.rehearse else ()
    load = (
        "--api",
        "completions",
        "--workload",
        "synthetic",
        "--timeout",
        "120",
        "--repeat",
        "1",
        "--no-progress",
    )
    base, _, arg = name.partition(":")
    if name == "host":
        # ../shared/device/host_check.py where it was carried in .whl/, for its record only: it
        # names modules of an older layout (server.cli, now cli.main). What decides the step is our
        # own check: every third-party module the steps need and every module of the project.
        script = (
            f"if [ -f .whl/host_check.py ]; then {python} .whl/host_check.py; fi; "
            f"{python} -m bench.gpu_check --imports"
        )
        return [
            Step("host", ("bash", "-c", script), 120, expected_s=23)
        ]  # 14-23 s on the H200 (calls 4, 6)
    if name == "probe":
        return [
            Step("probe", (*ppd, "probe", "--out", f"{out}/probe.json"), 240, ("probe.json",), 62)
        ]
    if name in ("tests-gpu", "tests-kernels"):  # one of the two, where a call has no time for both
        return [s for s in plan("tests", out, mode, python) if s.name == name]
    if (
        base == "tests-gpu" and arg
    ):  # only these files (each in its own process, as in the whole run)
        files = gpu_test_files(arg.split(","))
        expected = sum(GPU_TEST_S.get(f, 60) + GPU_TEST_PROCESS_S for f in files)
        return [
            Step(
                "tests-gpu",
                ("bash", "-c", _gpu_tests_script(python, "echo " + shlex.join(files)), str(out)),
                min(540, 2 * expected + 30),
                ("tests-gpu/*.xml",),
                expected,
            )
        ]
    if name == "tests":
        # Two steps, so that gpu tests that run long still leave the kernel tests their own time and
        # verdict. The compile check for sm_90 without a GPU is a default-suite test: on the host
        # the kernels run for real. The gpu tests run one file per process: an illegal address
        # poisons a process's CUDA context, and on the H200 one did fail every later test of a
        # single process (bench/results/nvidia-h200/call1). So run, the gpu tests took 430 s there
        # (call4-5), the kernel tests 41 s: "tests" is a call of its own.
        pytest = (python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider")
        collect = (
            f'{shlex.join(pytest)} --collect-only -m gpu tests | grep "::" | cut -d: -f1 | sort -u'
        )
        expected = sum(GPU_TEST_S.values()) + GPU_TEST_PROCESS_S * len(GPU_TEST_S)
        steps = [
            Step(
                "tests-gpu",
                ("bash", "-c", _gpu_tests_script(python, collect), str(out)),
                540,
                ("tests-gpu/*.xml",),
                expected,
            ),
            Step(
                "tests-kernels",
                (
                    *pytest,
                    "--junitxml",
                    f"{out}/tests-kernels.xml",
                    "--ignore",
                    "tests/engine/kernels/test_sm90_compile.py",
                    "tests/engine/kernels",
                ),
                300,
                ("tests-kernels.xml",),
                41,
            ),
        ]
        if (
            mode.rehearse
        ):  # the kernels run in Triton's interpreter here: also compile them for the H100
            steps.append(
                Step(
                    "tests-sm90-compile",
                    (
                        "env",
                        "-u",
                        "TRITON_INTERPRET",
                        python,
                        "-m",
                        "tests.engine.kernels.sm90_compile",
                    ),
                    300,
                )
            )
        return steps
    if name == "engine":
        # 36 s on the H200 (call6), graphs captured and append and mixed steps timed both ways; each
        # step's device time (5 runs) and pipelined time (15 steps) since: about 60 s, an estimate
        # not yet measured.
        argv = (*ppd, "bench", "engine", "--out", str(out), *quick, *mode.engine_model)
        return [Step("engine", argv, 150, ("engine-*.json",), 60)]
    if (
        base == "engine-tp"
    ):  # Llama-3.1-70B's configuration at each size (2, 4 and 8 by default): N GPUs each
        steps = []
        for n in arg.split(",") if arg else ["2", "4", "8"]:
            model = (
                ("--model", STANDIN, "--device", "cpu") if mode.rehearse else ("--model", LLAMA_70B)
            )
            argv = (
                *ppd,
                "bench",
                "engine",
                "--tensor-parallel-size",
                n,
                "--out",
                f"{out}/engine-tp{n}",
                *quick,
                *model,
            )
            steps.append(Step(f"engine-tp{n}", argv, 300, (f"engine-tp{n}/engine-*.json",), 120))
        return steps
    if name == "engine-host":
        # Eager decode, append and mixed steps profiled twice each, then graphs captured and one
        # replay of each profiled: estimated 25 s on the H200, not measured. call6 took 12 s for two
        # eager steps profiled twice each (4 profiles, start and weights included); now 9 profiles
        # (about 1 s each there, estimated), three more plain timings and the capture (0.9 s in
        # call6's engine step).
        argv = (python, "-m", "bench.engine_host", "--out", str(out), *mode.engine_model)
        return [Step("engine-host", argv, 90, ("engine-host.json", "engine-host.md"), 25)]
    if name == "sampling":
        argv = (*ppd, "bench", "sampling", "--out", f"{out}/sampling", *quick, *mode.engine_model)
        return [Step("sampling", argv, 360, ("sampling/sampling-*.json",))]
    if name == "compare":
        argv = (
            *ppd,
            "bench",
            "compare",
            "--policies",
            "pd,dlocal,aggregated",
            "--serve-args",
            serve,
            *load,
            "--profile",
            "balanced",
            "--turn1",
            "short",
            "--turns",
            "3",
            "--qps",
            mode.pick("2", "1"),
            "--duration",
            mode.pick("40", "8"),
            "--goodput",
            "ttft:500",
            "tpot:50",
            "--out",
            f"{out}/compare",
        )
        if mode.rehearse:
            argv += ("--scale", "0.0625")
        # Three servers, each about 35 s to start, 40 s of arrivals and the last turns' tail: 221 s
        # on the H200 (call6).
        return [Step("compare", argv, 360, ("compare/summary.json",), 225)]
    if name == "agents":
        # Agent sessions (issue 47) on a pool cut so that their contexts spill: no second tier,
        # a tier of pinned host memory, and the tier with the clients' retention hints kept. Not
        # yet run on a GPU: three servers of about 35 s to start each, 60 s of sessions and their
        # tail, estimated.
        tier = mode.pick("16", "0.05")
        argv = (
            *ppd,
            "bench",
            "compare",
            "--policies",
            "",
            "--serve-args",
            serve
            + mode.pick(
                " --num-kv-blocks 4096 --max-model-len 32768",
                " --num-kv-blocks 64 --max-model-len 1024",
            ),
            "--variant",
            "notier=--kv-retention-share 0",
            "--variant",
            f"tier=--kv-offloading-size {tier} --kv-retention-share 0",
            "--variant",
            f"hints=--kv-offloading-size {tier}",
            "--api",
            "completions",
            "--workload",
            "agentic",
            "--cache-hints",
            "--time-scale",
            mode.pick("0.25", "0.05"),
            "--concurrency",
            mode.pick("16", "8"),
            "--duration",
            mode.pick("60", "15"),
            "--timeout",
            "120",
            "--repeat",
            "1",
            "--no-progress",
            "--out",
            f"{out}/agents",
        )
        return [Step("agents", argv, 450, ("agents/summary.json",), 330)]
    if name == "fp8":
        # FP8 (issue 49) on Llama-3.1-8B's shapes, random weights: the GEMMs at M = 1-512 in
        # bfloat16 against FP8 (a scale per row through _scaled_mm, 128x128 blocks through our
        # GEMM, weight-only) on the whole GPU and on a 96-SM green share, then `ppd bench engine`
        # with FP8 weights and with FP8 weights and KV (the bfloat16 run is `engine`'s). Not yet
        # run on a GPU: estimates.
        gemm = (python, "-m", "bench.fp8_gemm", *(("--rehearse",) if mode.rehearse else ()))
        fp8_engine = (*ppd, "bench", "engine", *quick, *mode.engine_model, "-q", "fp8")
        return [
            Step("fp8-gemm", (*gemm, "--out", f"{out}/fp8-gemm"), 150, ("fp8-gemm/*.json",), 60),
            Step(
                "fp8-gemm-96",
                (*gemm, "--sms", mode.pick("96", "0"), "--out", f"{out}/fp8-gemm-96"),
                150,
                ("fp8-gemm-96/*.json",),
                60,
            ),
            Step(
                "fp8-engine",
                (*fp8_engine, "--out", f"{out}/fp8-engine"),
                180,
                ("fp8-engine/engine-*.json",),
                80,
            ),
            Step(
                "fp8-engine-kv",
                (*fp8_engine, "--kv-cache-dtype", "fp8", "--out", f"{out}/fp8-engine-kv"),
                180,
                ("fp8-engine-kv/engine-*.json",),
                80,
            ),
        ]
    if name == "moe":
        # A mixture of experts (issue 48) at Qwen3-30B-A3B's shapes, random weights made on the
        # device: the engine's decode at batch 1-128, a 4K prefill and a 256-token append against
        # floors that count the experts each step routed to, then the fused layer's tiles from 1 to
        # 4096 tokens (bench.kernels --only moe). Not yet run on a GPU: estimated 150 s for the
        # engine (61 GB of weights filled, graphs captured, the MoE kernels compiled) and 90 s for
        # the kernels' sweep.
        model = mode.pick(("--model", QWEN3_MOE), ("--model", QWEN3_MOE_STANDIN, "--device", "cpu"))
        engine = (*ppd, "bench", "engine", "--out", f"{out}/moe", *quick, *model)
        kernels = (python, "-m", "bench.kernels", "--only", "moe", "--out", f"{out}/moe-kernels")
        return [
            Step("moe", engine, 300, ("moe/engine-*.json",), 150),
            Step("moe-kernels", kernels, 240, mode.pick(("moe-kernels/kernels-*.json",), ()), 90),
        ]
    if (
        name == "kernels"
    ):  # without CUDA it says so and writes nothing: nothing to check in a rehearsal
        # 224 s on the H200 (call7), most of it the sweep of attention's tiles.
        return [
            Step(
                "kernels",
                (python, "-m", "bench.kernels", "--out", f"{out}/kernels"),
                540,
                mode.pick(("kernels/kernels-*.json",), ()),
                230,
            )
        ]
    if name == "gemm-shares":
        # Without CUDA it reads the shapes from the model's config, says so and writes nothing: a
        # rehearsal checks that it starts. Expected: the estimate (about 40 s: 200 captured
        # GEMM loops, the floors of three shares and a profiler pass), not yet measured.
        return [
            Step(
                "gemm-shares",
                (python, "-m", "bench.gemm_shares", "--out", f"{out}/gemm-shares"),
                120,
                mode.pick(("gemm-shares/gemm-shares.json",), ()),
                40,
            )
        ]
    if name == "policy":
        # On the CPU a turn 1 over the longer context can outlast a short run (its turn 2 never
        # starts): the rehearsal keeps the shorter context, every shape, load and route.
        argv = (
            *ppd,
            "profile",
            "policy",
            "--serve-args",
            serve,
            "--duration",
            mode.pick("10", "8"),
            "--no-progress",
            "--out",
            f"{out}/policy.json",
            *quick,
            *mode.pick((), ("--contexts", "160")),
        )
        return [Step("policy", argv, 540, ("policy.json",), resumable=True)]
    if base == "policy-eval" and arg:
        argv = (
            *ppd,
            "bench",
            "compare",
            "--policies",
            "pd,dlocal,ppd,aggregated",
            "--serve-args",
            f"{serve} --policy-table {out}/policy.json",
            *load,
            "--profile",
            arg,
            "--turn1",
            "mixed",
            "--qps",
            os.environ.get("POLICY_QPS", mode.pick("2", "1")),
            "--duration",
            mode.pick("30", "8"),
            "--out",
            f"{out}/policy-eval/{arg}",
        )
        if mode.rehearse:
            argv += ("--scale", "0.0625")
        return [Step(f"policy-eval-{arg}", argv, 540, (f"policy-eval/{arg}/summary.json",))]
    if name == "policy-verdict":
        # The folders are listed when the step runs (a policy-eval step of the same call comes
        # first); with none, bench.policy_eval says what produces them.
        script = (
            f"shopt -s nullglob; exec {shlex.quote(python)} -m bench.policy_eval "
            '"$0"/policy-eval/*/ '
            f'--out "$0"/policy-eval/verdict.md'
        )
        return [
            Step(
                "policy-verdict", ("bash", "-c", script, str(out)), 60, ("policy-eval/verdict.md",)
            )
        ]
    if name == "partition":
        argv = (
            *ppd,
            "profile",
            "partition",
            "--no-progress",
            "--out",
            f"{out}/partition.json",
            *quick,
            *mode.engine_model,
        )
        return [Step("partition", argv, 540, ("partition.json",), resumable=True)]
    if base == "partition-compare":
        # pd on each partition; aggregated, one worker with nothing to partition, once as the
        # baseline (under none). On the CPU, MPS and green contexts have their nearest stand-ins:
        # each worker on its own cores, and the prefill worker as a thread of the decode worker's
        # process (green's layout, without the SM split).
        partitions = {
            "none": "--partition none",
            "mps": "--partition mps",
            "green": "--partition green",
        }
        if mode.rehearse:
            partitions = {
                "none": "--partition none",
                "cpu": "--partition cpu",
                "thread": "--partition none --prefill-worker thread",
            }
        names = arg.split(",") if arg else list(partitions)
        if unknown := [n for n in names if n not in partitions]:
            raise ValueError(
                f"partition-compare: unknown partitions {unknown} (here: {', '.join(partitions)})"
            )
        return [
            Step(
                f"partition-compare-{p}",
                (
                    *ppd,
                    "bench",
                    "compare",
                    "--policies",
                    "pd,aggregated" if p == "none" else "pd",
                    "--serve-args",
                    f"{serve} {partitions[p]}",
                    *load,
                    "--profile",
                    "balanced",
                    "--turn1",
                    "mixed",
                    "--qps",
                    mode.pick("2", "1"),
                    "--duration",
                    mode.pick("30", "8"),
                    "--goodput",
                    "ttft:500",
                    "tpot:50",
                    "--out",
                    f"{out}/partition-compare/{p}",
                    *mode.pick((), ("--scale", "0.0625")),
                ),
                300,
                (f"partition-compare/{p}/summary.json",),
            )
            for p in names
        ]
    if base == "interference":
        sizes = mode.pick(
            ("--batch", "64", "--context", "1024", "--prefill-tokens", "4096", "--rounds", "5"),
            (
                "--batch",
                "4",
                "--context",
                "256",
                "--prefill-tokens",
                "1024",
                "--rounds",
                "2",
                "--alone-s",
                "1",
            ),
        )
        serve_args = serve + mode.pick(" --gpus 0", "")
        argv = (
            *ppd,
            "bench",
            "interference",
            "--serve-args",
            serve_args,
            *sizes,
            "--out",
            f"{out}/interference",
        )
        names = interference_names(arg, mode)
        if names:
            argv += ("--only", ",".join(names))
        # Without names what bench/interference.py measures by default: four where it cannot be read
        # here.
        gpu, cpu, gpu_default = interference_configs()
        count = len(names or mode.pick(gpu_default or gpu, cpu) or range(4))
        return [
            Step(
                "interference",
                argv,
                min(540, 60 + INTERFERENCE_S * count),
                ("interference/interference.json",),
                INTERFERENCE_S * count,
            )
        ]
    if base == "frontend":
        counts = (arg or "1,4,8").split(",")
        if not all(c.isdigit() and int(c) > 0 for c in counts):
            raise ValueError(f"frontend: API server counts must be positive integers, got {arg!r}")
        streams = mode.pick(
            (
                "--streams",
                "500,1000,2000",
                "--tokens",
                "256",
                "--rounds",
                "3",
                "--client-procs",
                "4",
            ),
            ("--streams", "32,64", "--tokens", "64", "--rounds", "1", "--client-procs", "1"),
        )
        return [
            Step(
                f"frontend-{n}",
                (
                    *ppd,
                    "bench",
                    "frontend",
                    *streams,
                    "--step-ms",
                    "20",
                    "--serve-args",
                    f"--device cpu --api-server-count {n}",
                    "--out",
                    f"{out}/frontend/api-{n}",
                ),
                300,
                (f"frontend/api-{n}/results.json",),
            )
            for n in counts
        ]
    raise ValueError(f"unknown step {name!r}; steps: {STEP_NAMES}")


def _gpu_tests_script(python: str, files: str) -> str:
    """bash: the gpu tests of each file that command `files` prints, one pytest process per file (an
    illegal address poisons a process's CUDA context), a JUnit XML each under $0/tests-gpu; exit 1
    if any failed."""
    pytest = shlex.join((python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"))
    return (
        f'mkdir -p "$0"/tests-gpu; rc=0; files=$({files}); [ -n "$files" ] || {{ echo "no gpu test '
        'collected"; '
        f'exit 1; }}; for f in $files; do n=$(basename "$f" .py); echo "== $f"; '
        f'{pytest} -m gpu --junitxml "$0/tests-gpu/$n.xml" "$f" || rc=1; done; exit $rc'
    )


def gpu_test_files(names: list[str]) -> list[str]:
    """tests-gpu:FILES as paths from the repository's root: each a path, or a file name (.py
    optional) that exactly one test file with gpu-marked tests has. ValueError naming those files
    for any other name."""
    marked = sorted(
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "tests").rglob("test_*.py")
        if "mark.gpu" in p.read_text()
    )
    files = []
    for name in names:
        if "/" in name:
            found = [os.path.normpath(name)] if os.path.normpath(name) in marked else []
        else:
            found = [
                m
                for m in marked
                if Path(m).name == (name if name.endswith(".py") else f"{name}.py")
            ]
        if len(found) != 1:
            why = (
                "is in several places: name its path"
                if found
                else "names no test file with gpu-marked tests"
            )
            raise ValueError(
                f"tests-gpu: {name!r} {why} (those files: {', '.join(found or marked)})"
            )
        files += found
    return files


def interference_configs() -> tuple[
    dict[str, str] | None, dict[str, str] | None, tuple[str, ...] | None
]:
    """bench/interference.py's GPU_CONFIGS and CPU_CONFIGS (name -> serve arguments) and GPU_DEFAULT
    (what it measures on a GPU without --only), read from its source: this program imports only the
    standard library. None for one that is not written as literals (a configuration a string, or a
    call whose first argument is one)."""
    found: dict[str, object] = {}
    for node in ast.parse(INTERFERENCE.read_text()).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id in (
            "GPU_CONFIGS",
            "CPU_CONFIGS",
            "GPU_DEFAULT",
        ):
            found[target.id] = (
                _configs(node.value) if target.id.endswith("CONFIGS") else _names(node.value)
            )
    return found.get("GPU_CONFIGS"), found.get("CPU_CONFIGS"), found.get("GPU_DEFAULT")


def _configs(node: ast.expr | None) -> dict[str, str] | None:
    if not isinstance(node, ast.Dict):
        return None
    configs = {}
    for key, value in zip(node.keys, node.values):
        if isinstance(value, ast.Call) and value.args:
            value = value.args[0]
        if not (
            isinstance(key, ast.Constant)
            and isinstance(value, ast.Constant)
            and isinstance(value.value, str)
        ):
            return None
        configs[key.value] = value.value
    return configs


def _names(node: ast.expr | None) -> tuple[str, ...] | None:
    try:
        return tuple(ast.literal_eval(node)) if node is not None else None
    except ValueError:
        return None


def interference_names(arg: str, mode: Mode) -> list[str]:
    """The configurations interference:NAMES measures ([]: all of the device's). On a GPU the names
    as given, each one of GPU_CONFIGS; in a rehearsal each name of CPU_CONFIGS as it is, and a
    GPU one as the CPU's stand-in for its partition (mps: cpu, green: thread). ValueError for a
    name neither has, saying which exist."""
    if not arg:
        return []
    gpu, cpu, _ = interference_configs()
    names = arg.split(",")
    if not mode.rehearse:
        if gpu is not None and (unknown := [n for n in names if n not in gpu]):
            raise ValueError(
                f"interference: no GPU configuration {', '.join(unknown)} in bench/interference.py "
                f"(there are {', '.join(gpu)})"
            )
        return names
    if cpu is None:  # not readable here: `ppd bench interference --only` says which exist
        return names
    mapped = []
    for n in names:
        standin = n if n in cpu else _cpu_standin(gpu[n]) if gpu and n in gpu else None
        if standin not in cpu:
            raise ValueError(
                f"interference: no configuration {n!r} to rehearse on the CPU (GPU: "
                f"{', '.join(gpu or ())}; CPU: {', '.join(cpu)}; a GPU one is rehearsed as the "
                "CPU's "
                "stand-in for its partition: "
                f"{', '.join(f'{k} as {v}' for k, v in CPU_STANDIN.items())})"
            )
        if standin not in mapped:
            mapped.append(standin)
    return mapped


def _cpu_standin(serve_args: str) -> str | None:
    args = shlex.split(serve_args)
    return CPU_STANDIN.get(
        args[args.index("--partition") + 1] if "--partition" in args[:-1] else "none"
    )


def steps_room_s(budget_s: float, archive: bool = True) -> float:
    """What a call's steps may take of its budget: the rest stops the last step at its limit and
    packs the archive."""
    return budget_s - STOP_RESERVE_S - (PACK_RESERVE_S if archive else 0)


def describe(steps: list[Step], budget_s: float) -> tuple[str, bool]:
    """The call's steps with their limits and expected durations (a step not measured counts its
    limit; a resumable last step takes what is left), and whether the expected durations fit the
    budget."""
    lines = [f"{'step':32} {'limit s':>8} {'expected s':>11} {'done by s':>10}"]
    done = 0
    for i, step in enumerate(steps):
        if step.resumable and i == len(steps) - 1:
            lines.append(f"{step.name:32} {step.limit_s:>8} {'the rest':>11} {'':>10}")
            break
        done += step.expected_s if step.expected_s is not None else step.limit_s
        expected = "?" if step.expected_s is None else str(step.expected_s)
        lines.append(f"{step.name:32} {step.limit_s:>8} {expected:>11} {done:>10}")
    room = steps_room_s(budget_s)
    fits = done <= room
    lines.append(
        f"expected {done} s of the steps' {room:.0f} s (budget {budget_s:.0f} s less "
        f"{STOP_RESERVE_S} s to "
        f"stop the last step and {PACK_RESERVE_S} s to pack): "
        + ("fits" if fits else f"over by {done - room:.0f} s")
    )
    lines.append(
        f"limits sum to {sum(s.limit_s for s in steps)} s (each is cut to what is left); budget + "
        "wheel "
        f"install {budget_s:.0f} + {WHEELS_S} = {budget_s + WHEELS_S:.0f} s of a device command's "
        f"{DEVICE_COMMAND_S} s"
    )
    return "\n".join(lines), fits


# ---- running a call ------------------------------------------------------------------------------


def run_step(step: Step, out: Path, limit_s: float) -> Outcome:
    """Run step with its output in out/<name>.log (and on our stdout), stopped with all it started
    past limit_s."""
    token = uuid.uuid4().hex
    env = {**os.environ, MARKER: token}
    log_path = out / f"{step.name}.log"
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            step.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        copier = threading.Thread(target=_copy, args=(proc.stdout, log), daemon=True)
        copier.start()
        timed_out = False
        try:
            proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop(proc, token)
        except KeyboardInterrupt:  # the call itself is being stopped: take the step down with it
            _stop(proc, token)
            raise
        finally:
            _kill_marked(
                token
            )  # a server the step left behind would hold the device for the next step
            copier.join(timeout=COPIER_JOIN_S)
    seconds = time.monotonic() - started
    missing = [g for g in step.outputs if not any(out.glob(g))]
    verdict = (
        "timeout"
        if timed_out
        else "failed"
        if proc.returncode != 0
        else "no-output"
        if missing
        else "ok"
    )
    return Outcome(
        step.name,
        verdict,
        None if timed_out else proc.returncode,
        round(seconds, 1),
        int(limit_s),
        shlex.join(step.argv),
        missing,
    )


def _copy(src, log) -> None:
    for line in iter(src.readline, b""):
        log.write(line)
        log.flush()
        sys.stdout.buffer.write(line)
        sys.stdout.flush()


def _stop(proc: subprocess.Popen, token: str) -> None:
    """SIGTERM to the step's process group (servers drain), then SIGKILL to whatever still carries
    its marker."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    _kill_marked(token)
    proc.wait()


def _kill_marked(token: str) -> None:
    """SIGKILL every process whose environment carries this step's marker (those that left its
    process group too)."""
    needle = f"{MARKER}={token}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue


# A call's own records, never copied into a later call: gpu_check's, and the command and output a
# call's committed folder keeps beside its unpacked archive (bench/results/<device>/callN/).
CALL_FILES = ("steps.json", "status.txt", "host.txt", "TRUNCATED.txt", "command.txt", "stdout.txt")


def resume_from(source: Path, out: Path) -> list[str]:
    """Copy an earlier call's results into out, never over a file out has; not its logs or
    verdicts."""
    copied = []
    for path in sorted(source.rglob("*")):
        rel = path.relative_to(source)
        if path.is_dir() or (
            len(rel.parts) == 1 and (path.suffix == ".log" or path.name in CALL_FILES)
        ):
            continue
        target = out / rel
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
            copied.append(str(rel))
    return copied


def pack(out: Path, archive: Path, limit: int = ARCHIVE_LIMIT) -> list[str]:
    """out as one .tar.gz at archive, under limit bytes: while it is over, the largest file is cut
    to its two ends (named in out/TRUNCATED.txt). Returns what was cut."""
    cut: list[str] = []
    while True:
        archive.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(
            archive, "w:gz"
        ) as tar:  # OUTDIR's contents at the top: unpack into the call's folder
            for child in sorted(out.iterdir()):
                tar.add(child, arcname=child.name)
        if archive.stat().st_size <= limit:
            return cut
        files = sorted(
            (
                p
                for p in out.rglob("*")
                if p.is_file() and p.stat().st_size > 2 * KEEP_PER_END + 1024
            ),
            key=lambda p: p.stat().st_size,
            reverse=True,
        )
        if not files:
            raise RuntimeError(
                f"{archive} is {archive.stat().st_size} bytes, over {limit}, with nothing left to "
                "cut"
            )
        big = files[0]
        data = big.read_bytes()
        dropped = len(data) - 2 * KEEP_PER_END
        note = f"\n[... {dropped} bytes cut by gpu_check to fit the archive ...]\n".encode()
        big.write_bytes(data[:KEEP_PER_END] + note + data[-KEEP_PER_END:])
        cut.append(f"{big.relative_to(out)} ({len(data)} bytes)")
        (out / "TRUNCATED.txt").write_text(
            "cut in the middle to fit the archive:\n" + "\n".join(cut) + "\n"
        )


def host_facts(out: Path, python: str) -> None:
    """out/host.txt: when, which commit, the GPUs and the versions the steps run with."""
    commands = [
        ["date", "-u"],
        ["git", "rev-parse", "HEAD"],
        ["git", "status", "--short"],
        ["nvidia-smi"],
        [
            python,
            "-c",
            "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, "
            "'cuda', torch.version.cuda, 'triton', triton.__version__)",
        ],
    ]
    with open(out / "host.txt", "w") as f:
        for argv in commands:
            f.write(f"$ {shlex.join(argv)}\n")
            try:
                done = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT)
                f.write(done.stdout + done.stderr)
            except (OSError, subprocess.TimeoutExpired) as e:
                f.write(f"{type(e).__name__}: {e}\n")


def run_call(
    steps: list[Step],
    out: Path,
    budget_s: float,
    archive: Path | None = None,
    archive_limit: int = ARCHIVE_LIMIT,
) -> list[Outcome]:
    """Run steps within budget_s (stopping the last step and packing included), recording each
    outcome; pack out into archive at the end, also when stopped by SIGTERM or Ctrl-C."""
    deadline = time.monotonic() + steps_room_s(budget_s, archive is not None)
    outcomes: list[Outcome] = []

    def record() -> None:
        (out / "steps.json").write_text(json.dumps([asdict(o) for o in outcomes], indent=1) + "\n")

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_signal)
    started = time.monotonic()
    step = None
    try:
        for step in steps:
            started = time.monotonic()
            left = deadline - started
            if left < MIN_STEP_S:
                outcomes.append(
                    Outcome(step.name, "skipped", None, 0.0, step.limit_s, shlex.join(step.argv))
                )
            else:
                limit = min(step.limit_s, left)
                _status(out, f"== {step.name}: {shlex.join(step.argv)} (limit {limit:.0f} s)")
                outcomes.append(run_step(step, out, limit))
            o = outcomes[-1]
            _status(
                out,
                f"== {o.name}: {o.verdict}"
                + (f", exit {o.rc}" if o.rc is not None else "")
                + f" after {o.seconds:.0f} s"
                + (f"; missing {', '.join(o.missing)}" if o.missing else ""),
            )
            record()
    except KeyboardInterrupt:
        if step is not None and (not outcomes or outcomes[-1].name != step.name):
            outcomes.append(
                Outcome(
                    step.name,
                    "stopped",
                    None,
                    round(time.monotonic() - started, 1),
                    step.limit_s,
                    shlex.join(step.argv),
                )
            )
        _status(out, "== stopped by a signal; packing what there is")
    finally:
        signal.signal(signal.SIGTERM, previous)
        record()
        if archive:
            cut = pack(out, archive, archive_limit)
            print(
                f"packed {out} into {archive} ({archive.stat().st_size} bytes"
                + (f"; cut to fit: {', '.join(cut)}" if cut else "")
                + ")",
                flush=True,
            )
    return outcomes


def _status(out: Path, line: str) -> None:
    print(line, flush=True)
    with open(out / "status.txt", "a") as f:
        f.write(line + "\n")


def project_modules() -> list[str]:
    """Every module of the project's packages, but a package's __main__ (importing it runs it)."""
    import pkgutil

    names = []
    for package in ("cli", "engine", "scheduler", "partition", "server", "bench", "profiles"):
        names.append(package)
        names += [
            m.name
            for m in pkgutil.walk_packages([str(ROOT / package)], prefix=f"{package}.")
            if not m.name.endswith(".__main__")
        ]
    return names


def check_imports() -> int:
    """Import every module the steps need and every module of the project; print each failure. 1 if
    any failed."""
    import importlib

    failed = 0
    names = [*THIRD_PARTY, *project_modules()]
    for name in names:
        try:
            module = importlib.import_module(name)
            print(f"ok   {name} {getattr(module, '__version__', '')}".rstrip())
        except Exception as e:  # noqa: BLE001 (every failure is reported, not only the first)
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}")
    try:
        import torch

        cuda = torch.cuda.is_available()
        print("cuda", cuda, torch.version.cuda, torch.cuda.get_device_name(0) if cuda else "")
        print("torch green contexts:", hasattr(torch.cuda, "green_contexts"))
    except Exception as e:  # noqa: BLE001
        print("torch check failed:", e)
    print(f"{len(names) - failed} modules imported, {failed} failed")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="bench/gpu_check.sh",
        description=__doc__.split("\n")[0],
        epilog=f"steps: {STEP_NAMES}; default: {' '.join(DEFAULT_STEPS)}",
    )
    p.add_argument(
        "--rehearse", action="store_true", help="run the steps on the CPU with the stand-in model"
    )
    p.add_argument(
        "--archive",
        type=Path,
        default=None,
        help="pack OUTDIR into this .tar.gz at the end (< 16 MiB)",
    )
    p.add_argument(
        "--from",
        dest="resume",
        type=Path,
        action="append",
        default=[],
        help="an earlier call's unpacked results (repeatable): copied into OUTDIR first, so "
        "resumable "
        "steps go on",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=DEFAULT_BUDGET_S,
        help=f"seconds this call may take from this program's start, packing included (default "
        f"{DEFAULT_BUDGET_S}; with gpu_check.sh's wheel install, about {WHEELS_S} s more)",
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="print the steps' limits and expected durations against the budget; run nothing",
    )
    p.add_argument("--imports", action="store_true", help=argparse.SUPPRESS)  # the host step
    p.add_argument("outdir", nargs="?", type=Path)
    p.add_argument("steps", nargs="*")
    started = time.monotonic()
    args = p.parse_args(argv)
    if args.imports:
        return check_imports()
    if args.outdir is None:
        p.error("OUTDIR is required")
    out = args.outdir.resolve()
    archive = args.archive.resolve() if args.archive else None
    resume = [r.resolve() for r in args.resume]
    os.chdir(ROOT)
    python = sys.executable
    try:
        steps = [
            s
            for name in args.steps or DEFAULT_STEPS
            for s in plan(name, out, Mode(args.rehearse), python)
        ]
    except ValueError as e:
        p.error(str(e))
    if missing := [str(r) for r in resume if not r.is_dir()]:
        p.error(
            f"--from {', '.join(missing)}: no such folder (give the unpacked results of an earlier "
            "call)"
        )
    text, fits = describe(steps, args.budget)
    print(text, flush=True)
    if args.plan:
        return 0 if fits else 1
    if not args.rehearse and args.budget + WHEELS_S > DEVICE_COMMAND_S:
        print(
            f"warning: --budget {args.budget:.0f} leaves no room for the wheel install (about "
            f"{WHEELS_S} s) inside "
            f"a device command's {DEVICE_COMMAND_S} s",
            flush=True,
        )
    out.mkdir(parents=True, exist_ok=True)
    for folder in resume:
        copied = resume_from(folder, out)
        print(f"resuming from {folder}: {len(copied)} files copied into {out}", flush=True)
    host_facts(out, python)
    _status(
        out,
        f"== call: {shlex.join(sys.argv)} (rehearsal on the CPU)"
        if args.rehearse
        else f"== call: {shlex.join(sys.argv)}",
    )
    outcomes = run_call(steps, out, args.budget - (time.monotonic() - started), archive)
    bad = [o for o in outcomes if o.verdict != "ok"]
    print(
        f"{len(outcomes) - len(bad)} of {len(outcomes)} steps ok"
        + (": " + ", ".join(f"{o.name} {o.verdict}" for o in bad) if bad else ""),
        flush=True,
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
