from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# triton.jit reads TRITON_INTERPRET when a kernel is decorated (at import): set it before any kernel
# module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The test process runs tiny models (the transformers oracle, engine units) next to the servers'
# workers; on a 2-core machine extra intra-op threads only spin-wait, which made those tests several
# times slower.
torch.set_num_threads(1)

from tests.server_process import ServerProcess  # noqa: E402


@pytest.fixture(autouse=True)
def interpreter_rounds_fp8(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's interpreter (3.9) casts float32 to e4m3 wrongly where rounding up carries into the
    exponent (125.9 becomes 64, not 128); the GPU rounds to nearest even (cvt.rn.satfinite), as
    PyTorch does. Under the interpreter every test's casts go as PyTorch's do, but to NaN past 448
    (PyTorch and the GPU saturate, a cast need not): the kernels' clamp must saturate. Its e4m3
    loads are exact."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    cast = interpreter._convert_float

    def convert(data: np.ndarray, src: tl.dtype, dst: tl.dtype, rounding: object) -> np.ndarray:
        if src == tl.float32 and dst == tl.float8e4nv:
            x = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
            out = x.to(torch.float8_e4m3fn).view(torch.uint8)
            out[x.abs() > 448] |= 0x7F
            return out.numpy()
        return cast(data, src, dst, rounding)

    monkeypatch.setattr(interpreter, "_convert_float", convert)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A module's SLOW_CASES, dicts of parameter values (its fixtures' and parametrize's), mark the
    tests whose parameters include one of them `slow`: combinations of a fixture's and a
    parametrize's values that run in the second suite (the default one keeps under its 10 minutes
    on 2 cores)."""
    for item in items:
        cases = getattr(item.module, "SLOW_CASES", ())
        params = getattr(getattr(item, "callspec", None), "params", {})
        if any(all(params.get(k, object()) == v for k, v in case.items()) for case in cases):
            item.add_marker(pytest.mark.slow)
    # The heaviest files first, the quick ones last, so that the two test processes end together:
    # pytest-xdist hands out whole files in this order (with --no-loadscope-reorder, which the
    # README's command gives; it would otherwise order them by their number of tests), and a file of
    # a minute started last runs alone at the end. First the modules that set RUN_FIRST (a minute
    # or more of one subprocess's work, or of Triton's interpreter), then those that start servers.
    items.sort(key=lambda item: RUN_ORDER.index(cost_class(item)))


RUN_ORDER = ("heavy", "servers", "quick")


def cost_class(item: pytest.Item) -> str:
    if getattr(getattr(item, "module", None), "RUN_FIRST", False):
        return "heavy"
    return "servers" if "start_server" in getattr(item, "fixturenames", ()) else "quick"


@pytest.fixture
def nan_filled_empty() -> Iterator[None]:
    """torch.empty returns NaN here (deterministic mode fills new memory), so an output element a
    kernel never writes fails the test instead of passing on stale memory (the kernel tests)."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One demo-model cache for the whole session, so the demo folder is built once. Its CPU kernels
    are the test processes' own (profiles.cache_dir()'s, where the kernel tests build them): the
    servers of both test processes load the one build instead of compiling their own."""
    from profiles import cache_dir as test_process_cache

    cache = tmp_path_factory.mktemp("ppd-cache")
    kernels = test_process_cache() / "cpu-kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (cache / "cpu-kernels").symlink_to(kernels, target_is_directory=True)
    return cache


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama folder with the byte-level tokenizer, built once (tests only read it)."""
    from engine.demo import write_byte_tokenizer
    from tests.tiny_models import write_tiny_model

    folder = write_tiny_model(tmp_path_factory.mktemp("llama"), "llama")
    write_byte_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def weights_only(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model's config and weights without its tokenizer files (as a configuration with
    dummy weights, such as bench/models/llama-3.1-8b, has none)."""
    import shutil

    from engine.demo import demo_model_path

    folder = tmp_path_factory.mktemp("weights-only")
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        if (demo_model_path(cache_dir) / name).exists():
            shutil.copy(demo_model_path(cache_dir) / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def start_server(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """start_server(*args) -> a running ServerProcess, stopped at the end of the module."""
    servers: list[ServerProcess] = []

    def start(*args: str) -> ServerProcess:
        server = ServerProcess(
            *args, cache_dir=cache_dir, log_path=tmp_path_factory.mktemp("serve") / "serve.log"
        )
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
    # A worker that crashed between requests would otherwise go unnoticed: the launcher restarts it.
    for server in servers:
        log = server.log_path.read_text()
        assert "Traceback" not in log, f"ppd serve logged an exception:\n{log}"
