"""`ppd serve --tensor-parallel-size 2` on the CPU: a unit of two ranks per worker (four processes,
gloo) serves the greedy ids of transformers on both routes, maps one shard per rank shared by that
rank's two workers, serves chat, restarts whole when any rank dies, and a size that does not split
the model or the GPUs is refused at start."""

from __future__ import annotations

import argparse
import os
import random
import signal
from pathlib import Path

import httpx
import pytest

from engine.demo import write_byte_tokenizer
from tests.server_process import ServerProcess, greedy_completion, process_title, wait_until
from tests.tiny_models import hf_greedy, write_tiny_model

NEW_TOKENS = 8


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 256) for _ in range(n)]


# mistral has one KV head for the two ranks (both hold it); the default suite serves it, the slow
# one the others.
ARCH_PARAMS = [
    pytest.param("mistral"),
    *(pytest.param(a, marks=pytest.mark.slow) for a in ("llama", "qwen2", "qwen3")),
]


@pytest.fixture(scope="module", params=ARCH_PARAMS)
def tp_server(request, start_server, tmp_path_factory) -> tuple[str, ServerProcess]:
    # qwen2's 321-row vocabulary splits 161 + 160 (the last rank's shard padded).
    folder = write_tiny_model(
        tmp_path_factory.mktemp(request.param),
        request.param,
        vocab_size=321 if request.param == "qwen2" else 320,
    )
    write_byte_tokenizer(folder)
    server = start_server(
        "--model",
        str(folder),
        "--served-model-name",
        "tiny",
        "--policy",
        "ppd",
        "--tensor-parallel-size",
        "2",
        "--max-num-batched-tokens",
        "32",
        "--max-num-seqs",
        "16",
    )
    return str(folder), server


def complete(
    server: ServerProcess, prompt: list[int], route: str | None = None
) -> tuple[list[int], str]:
    resp = greedy_completion(server, "tiny", prompt, NEW_TOKENS, route)
    return resp.json()["choices"][0]["token_ids"], resp.headers["x-ppd-route"]


def test_both_routes_give_transformers_greedy_ids(tp_server) -> None:
    folder, server = tp_server
    rng = random.Random(0)
    for append, route in ((ids(rng, 10), "decode"), (ids(rng, 54), "prefill")):
        prompt = ids(rng, 45)
        first, _ = complete(server, prompt)
        assert first == hf_greedy(folder, prompt, NEW_TOKENS)
        turn2 = prompt + first + append
        second, taken = complete(server, turn2, route)
        assert taken == route
        assert second == hf_greedy(folder, turn2, NEW_TOKENS)


@pytest.mark.slow  # a server of its own (about 15 s on 2 cores)
def test_a_one_process_unit_runs_each_ranks_prefill_as_a_thread(
    start_server, tmp_path_factory
) -> None:
    """--prefill-worker thread (green contexts' shape on a GPU): a process per rank holding its
    decode rank and its prefill rank's thread, each role with its own communicator over the same
    processes; both routes as transformers."""
    folder = write_tiny_model(tmp_path_factory.mktemp("thread"), "qwen3")
    write_byte_tokenizer(folder)
    server = start_server(
        "--model",
        str(folder),
        "--served-model-name",
        "tiny",
        "--policy",
        "ppd",
        "--prefill-worker",
        "thread",
        "--partition",
        "none",
        "-tp",
        "2",
        "--max-num-batched-tokens",
        "32",
        "--max-num-seqs",
        "16",
    )
    workers = server.health()["units"][0]["workers"]
    assert sorted((w["role"], w["rank"], w.get("thread", False)) for w in workers) == [
        ("decode", 0, False),
        ("decode", 1, False),
        ("prefill", 0, True),
        ("prefill", 1, True),
    ]
    rng = random.Random(4)
    for append, route in ((ids(rng, 10), "decode"), (ids(rng, 54), "prefill")):
        prompt = ids(rng, 45)
        first, _ = complete(server, prompt)
        assert first == hf_greedy(str(folder), prompt, NEW_TOKENS)
        second, taken = complete(server, prompt + first + append, route)
        assert taken == route and second == hf_greedy(
            str(folder), prompt + first + append, NEW_TOKENS
        )


def mapped(pid: int, prefix: str) -> dict[str, tuple[str, str]]:
    """Shared-memory file name after prefix (weights, kv, weights-r1, kv-r1) -> (device, inode) the
    process maps."""
    found = {}
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5].startswith(prefix):
            found[fields[5][len(prefix) :]] = (fields[3], fields[4])
    return found


def test_each_rank_maps_its_own_shard_shared_by_its_two_workers(tp_server) -> None:
    _, server = tp_server
    workers = {(w["role"], w["rank"]): w["pid"] for w in server.health()["units"][0]["workers"]}
    assert set(workers) == {("decode", 0), ("decode", 1), ("prefill", 0), ("prefill", 1)}
    assert {process_title(pid) for pid in workers.values()} == {
        f"ppd::u0-rank{r}-{role}" for role, r in workers
    }
    prefix = f"/dev/shm/ppd-{server.proc.pid}-u0-"
    rank0, rank1 = mapped(workers["decode", 0], prefix), mapped(workers["decode", 1], prefix)
    assert set(rank0) == {"weights", "kv"} and set(rank1) == {"weights-r1", "kv-r1"}
    assert (
        mapped(workers["prefill", 0], prefix) == rank0
        and mapped(workers["prefill", 1], prefix) == rank1
    )
    assert not list(
        Path("/dev/shm").glob(f"ppd-{server.proc.pid}-*")
    )  # names released once every rank mapped


def test_chat(tp_server) -> None:
    _, server = tp_server
    resp = httpx.post(
        f"{server.url}/v1/chat/completions",
        timeout=60,
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 5,
            "ignore_eos": True,
        },
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize(
    "victim", [("decode", 1), pytest.param(("prefill", 1), marks=pytest.mark.slow)]
)
def test_killing_any_rank_restarts_the_whole_unit(tp_server, victim: tuple[str, int]) -> None:
    folder, server = tp_server
    before = {(w["role"], w["rank"]): w["pid"] for w in server.health()["units"][0]["workers"]}
    os.kill(before[victim], signal.SIGKILL)

    def restarted() -> bool:
        health = server.health()
        pids = {w["pid"] for w in health["units"][0]["workers"]}
        return health["status"] == "ok" and not pids & set(before.values())

    wait_until(restarted, 120, "every rank of the unit to restart")
    after = {(w["role"], w["rank"]): w["pid"] for w in server.health()["units"][0]["workers"]}
    assert set(after) == set(before) and not set(after.values()) & set(
        before.values()
    )  # every rank anew
    prompt = ids(random.Random(3), 30)
    assert complete(server, prompt)[0] == hf_greedy(folder, prompt, NEW_TOKENS)


# about 75 s on 2 cores: in the second suite, which keeps the default one under 10 minutes
@pytest.mark.slow
def test_a_step_failing_on_one_rank_restarts_the_unit(
    cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that fails on a follower alone (its memory, its device) leaves the other ranks in a
    collective no retry can meet: the follower ends, the request gets an error at once, every rank
    restarts, and the next request is served. The fault is injected once (engine/faults.py), on the
    first step a follower runs."""
    monkeypatch.setenv("PPD_INJECT_FAULT", f"follower-step:{tmp_path / 'fired'}")
    folder = write_tiny_model(tmp_path / "llama", "llama")
    write_byte_tokenizer(folder)
    server = ServerProcess(
        "--model",
        str(folder),
        "--served-model-name",
        "tiny",
        "--policy",
        "ppd",
        "--tensor-parallel-size",
        "2",
        cache_dir=cache_dir,
        log_path=tmp_path / "serve.log",
    )
    try:
        before = {w["pid"] for w in server.health()["units"][0]["workers"]}
        prompt = ids(random.Random(4), 30)
        resp = httpx.post(
            f"{server.url}/v1/completions",
            timeout=120,
            json={"model": "tiny", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0},
        )
        assert resp.status_code in (500, 503) and (tmp_path / "fired").exists()
        wait_until(
            lambda: (
                (h := server.health())["status"] == "ok"
                and not {w["pid"] for w in h["units"][0]["workers"]} & before
            ),
            120,
            "every rank to restart",
        )
        assert complete(server, prompt)[0] == hf_greedy(folder, prompt, NEW_TOKENS)
        assert (
            "tensor-parallel rank 1's step failed (InjectedFault"
            in (tmp_path / "serve.log").read_text()
        )
    finally:
        server.stop()


def plan(*argv: str):
    import server.plan
    from server.args import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return server.plan.plan_serve(parser.parse_args(list(argv)))


def test_a_size_that_does_not_split_the_model_is_refused_at_start(tiny_llama: Path) -> None:
    import server.plan

    with pytest.raises(
        server.plan.UsageError,
        match=r"--tensor-parallel-size 3 does not split .* use one of 1, 2, 4, 8",
    ):
        plan("--model", str(tiny_llama), "-tp", "3")
    with pytest.raises(server.plan.UsageError, match="--pipeline-parallel-size 2"):
        plan("--model", str(tiny_llama), "-pp", "2")


def test_units_take_consecutive_gpus_and_a_size_that_does_not_divide_them_is_refused(
    tiny_llama: Path,
) -> None:
    import server.plan
    from engine.config import ModelConfig

    mcfg = ModelConfig.from_folder(tiny_llama)
    gpus = [str(i) for i in range(8)]

    def units(*argv: str) -> list[str]:
        args = argparse.Namespace(gpus=None, units=None, tensor_parallel_size=1)
        for flag, value in zip(argv[::2], argv[1::2]):
            setattr(args, flag, value if flag == "gpus" else int(value))
        return server.plan.choose_gpus(args, gpus, mcfg)

    assert units("tensor_parallel_size", "4") == ["0,1,2,3", "4,5,6,7"]
    assert units("tensor_parallel_size", "8") == ["0,1,2,3,4,5,6,7"]
    assert units("tensor_parallel_size", "2", "units", "1") == ["0,1"]
    assert units("tensor_parallel_size", "2", "gpus", "6,7,2,3") == ["6,7", "2,3"]
    with pytest.raises(
        server.plan.UsageError, match=r"does not divide the 6 GPU\(s\) .* use one of 1, 2"
    ):
        units(
            "tensor_parallel_size", "4", "gpus", "0,1,2,3,4,5"
        )  # 3 and 6 divide 6 GPUs but not 8 heads
