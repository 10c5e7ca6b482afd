"""`python -m pytest -m gpu tests` on a GPU host that lacks the test extra's packages
(bench/gpu_check.sh's `tests` step): every module is collected, the ones needing such a package
skip, and the gpu tests are there to run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reads pyproject.toml with Python 3.11's tomllib")

ROOT = Path(__file__).resolve().parent.parent
# The test extra's packages a GPU host has anyway (torch brings triton; the rest are carried or come
# with others).
ON_GPU_HOST = {"pytest", "openai", "triton", "hypothesis"}


# Not blocked though the GPU host may lack it: transformers probes accelerate by its spec, which a
# blocking stub has, and then fails to import transformers' own classes; where accelerate is truly
# absent transformers goes on without it (only tests/engine/test_gguf.py's oracle needs it, and that
# module skips then).
NOT_BLOCKABLE = {"accelerate"}


def missing_on_gpu_host() -> list[str]:
    """Import names of the test extra's packages that the GPU host does not have (and that a stub
    can stand for)."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["test"]
    names = {re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower().replace("-", "_") for req in extra}
    return sorted(names - ON_GPU_HOST - NOT_BLOCKABLE)


@pytest.mark.slow  # over 10 s on 2 cores: the second suite keeps the default one under its budget
def test_gpu_tests_collect_without_the_test_extra(tmp_path: Path) -> None:
    blocked = missing_on_gpu_host()
    assert "kubernetes_validate" in blocked and "cbor2" in blocked
    for name in (
        blocked
    ):  # ahead of site-packages on the path: importing one fails as if it were not installed
        message = f"No module named {name!r}"
        (tmp_path / f"{name}.py").write_text(
            f"raise ModuleNotFoundError({message!r}, name={name!r})\n"
        )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
    }
    probe = subprocess.run(
        [sys.executable, "-c", "import kubernetes_validate"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert "No module named 'kubernetes_validate'" in probe.stderr  # the block works
    # A blocked package's pytest plugin (schemathesis has one) is not there on the GPU host either.
    plugins = [
        arg
        for e in entry_points(group="pytest11")
        if e.value.split(".")[0] in blocked
        for arg in ("-p", f"no:{e.name}")
    ]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-m",
            "gpu",
            "-p",
            "no:cacheprovider",
            *plugins,
            "tests",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "ERROR collecting" not in out and "error" not in out.splitlines()[-1].lower(), out[
        -3000:
    ]
    collected = [line for line in result.stdout.splitlines() if "::" in line]
    assert any(line.startswith("tests/server/test_gpu_serve.py::") for line in collected), out[
        -3000:
    ]
