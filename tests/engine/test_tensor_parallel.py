"""Tensor parallelism on the CPU: two ranks (two processes, gloo) each holding half of a model give
the greedy ids and logits of one rank holding all of it, and of transformers, for every
architecture and way a step is scheduled, including a model with fewer KV heads than ranks (its
KV head is held by both) and a vocabulary that does not split evenly (the last rank's rows
padded)."""

from __future__ import annotations

import multiprocessing as mp
import random
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import ModelConfig, ModelError, tensor_parallel_sizes
from engine.loader import load_model, rank_slice
from engine.model import kv_pool_shape
from engine.model_runner import ModelRunner, StepInput
from engine.parallel import SINGLE, TensorParallel, init_tensor_parallel
from tests.tiny_models import hf_greedy, write_fp8_checkpoint, write_tiny_model

NEW_TOKENS = 8
BLOCK = 8
# (architecture, vocabulary): mistral's one KV head is below the 2 ranks; qwen2's 321 rows split 161
# + 160.
CASES = [
    ("llama", 320),
    ("mistral", 320),
    ("qwen2", 321),
    ("qwen3", 320),
    ("qwen3_moe", 320),  # each expert's width split, one all-reduce after the experts
    ("mixtral", 320),
]
FP8_CASE = "llama-fp8"  # tiny llama as an FP8 checkpoint with block scales, served weight-only


def ids(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def scenario(folder: str, backend: str, tp: Any = SINGLE) -> dict[str, Any]:
    """Turn 1 (a prompt in two chunks, then decode), turn 2 (an append over the cached turn), and a
    mixed step (a decode beside a fresh prompt), greedy: every sampled id and every logits row."""
    # weight-only where the checkpoint is FP8: a rank's own activations scale alone would differ
    model, cfg = load_model(folder, tp=tp, fp8_activations="none")
    vocab = cfg.vocab_size
    pool = torch.full(kv_pool_shape(model.cfg, 64, BLOCK), float("nan"), dtype=model.dtype)
    runner = ModelRunner(model, pool, BLOCK, backend)
    free = list(range(64))
    random.Random(1).shuffle(free)
    out: dict[str, Any] = {"logits": []}

    def step(seqs: list[dict], limit: int | None = None) -> None:
        inputs = []
        for s in seqs:
            end = len(s["tokens"]) if limit is None else min(len(s["tokens"]), s["cached"] + limit)
            while len(s["table"]) * BLOCK < end:
                s["table"].append(free.pop())
            inputs.append(
                StepInput(
                    s["tokens"][s["cached"] : end],
                    s["cached"],
                    list(s["table"]),
                    sample=end == len(s["tokens"]),
                )
            )
            s["cached"] = end
        logits = runner.forward(inputs)
        out["logits"].append(logits)
        for s, row in zip([s for s, i in zip(seqs, inputs) if i.sample], logits):
            s["tokens"].append(int(row.argmax()))

    a = {"tokens": ids(21, 1, vocab), "cached": 0, "table": []}
    step([a], limit=13)  # a chunk that samples nothing
    while len(a["tokens"]) < 21 + NEW_TOKENS:
        step([a])
    out["turn1"] = a["tokens"][21:]
    a["tokens"] += ids(11, 2, vocab)
    mark = len(a["tokens"])
    while len(a["tokens"]) < mark + NEW_TOKENS:
        step([a])
    out["turn2"] = a["tokens"][mark:]
    b = {"tokens": ids(9, 3, vocab), "cached": 0, "table": []}
    for _ in range(NEW_TOKENS):
        step([a, b])
    out["mixed"] = b["tokens"][9:]
    out["history"] = a["tokens"]
    return out


def rank_main(rank: int, size: int, store: str, cases: list[tuple[str, str]], results: Any) -> None:
    torch.set_num_threads(1)
    try:
        tp = init_tensor_parallel(size, rank, store, "cpu")
        got = {f"{folder}|{backend}": scenario(folder, backend, tp) for folder, backend in cases}
        for (
            value
        ) in got.values():  # by value: a tensor would travel as a handle to this process's memory
            value["logits"] = [t.numpy() for t in value["logits"]]
        results.put((rank, got, None))
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put((rank, None, traceback.format_exc()))


def run_ranks(size: int, cases: list[tuple[str, str]], tmp: Path) -> list[dict]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=rank_main, args=(r, size, str(tmp / "store"), cases, results))
        for r in range(size)
    ]
    for p in procs:
        p.start()
    got: list[Any] = [None] * size
    for _ in range(size):
        rank, value, error = results.get(timeout=300)
        assert error is None, f"rank {rank} failed:\n{error}"
        got[rank] = value
    for p in procs:
        p.join(timeout=30)
    return got


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    made = {
        arch: str(write_tiny_model(tmp_path_factory.mktemp(f"tp-{arch}"), arch, vocab_size=vocab))
        for arch, vocab in CASES
    }
    # an FP8 checkpoint of 32 x 32 blocks: each rank slices its rows' and columns' block scales
    fp8, _ = write_fp8_checkpoint(made["llama"], tmp_path_factory.mktemp("tp") / "fp8", "block")
    made[FP8_CASE] = str(fp8)
    return made


@pytest.fixture(scope="module")
def two_ranks(folders: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    cases = [
        (folder, backend)
        for arch, folder in folders.items()
        for backend in ("torch", "cpu")
        if arch != FP8_CASE or backend == "torch"
    ]
    return run_ranks(2, cases, tmp_path_factory.mktemp("tp-store"))


@pytest.mark.parametrize(
    ("arch", "backend"),
    [(arch, backend) for arch, _ in CASES for backend in ("torch", "cpu")] + [(FP8_CASE, "torch")],
)
def test_two_ranks_equal_one_rank_and_transformers(
    arch: str, backend: str, folders: dict[str, str], two_ranks: list[dict]
) -> None:
    folder = folders[arch]
    one = scenario(folder, backend)
    for rank, got in enumerate(two_ranks):
        mine = got[f"{folder}|{backend}"]
        for part in ("turn1", "turn2", "mixed"):
            assert mine[part] == one[part], f"rank {rank}, {part}"
        # Every rank holds the whole vocabulary's logits, equal to one rank's but for the order of
        # the sums.
        for a, b in zip(mine["logits"], one["logits"]):
            torch.testing.assert_close(torch.from_numpy(a), b, atol=1e-4, rtol=1e-4)
    history = one["history"]
    if arch == FP8_CASE:  # transformers runs the weights the FP8 checkpoint stands for
        folder = folder + "-dequantized"
    assert one["turn1"] == hf_greedy(folder, history[:21], NEW_TOKENS)
    mark = 21 + NEW_TOKENS + 11
    assert one["turn2"] == hf_greedy(folder, history[:mark], NEW_TOKENS)


def test_a_size_that_does_not_split_the_model_is_refused_naming_the_valid_ones(
    folders: dict[str, str],
) -> None:
    cfg = ModelConfig.from_folder(folders["llama"])  # 8 heads, 2 KV heads, MLP width 128
    with pytest.raises(ModelError, match=r"--tensor-parallel-size 3 .*use one of 1, 2, 4, 8"):
        cfg.sharded(3)
    with pytest.raises(ModelError, match="use one of 1, 2, 4"):
        ModelConfig.from_folder(folders["mistral"]).sharded(8)  # 4 heads


def test_each_rank_reads_its_own_slices(folders: dict[str, str]) -> None:
    """Eight KV-replicated ranks of a 2-KV-head model: ranks 0-3 hold KV head 0, ranks 4-7 head 1;
    the vocabulary's rows and the MLP's width in eighths."""
    cfg = ModelConfig.from_folder(folders["llama"]).sharded(8)
    d = cfg.head_dim
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.kv_head_replicas, cfg.intermediate_size) == (
        1,
        1,
        4,
        16,
    )
    k = "model.layers.0.self_attn.k_proj.weight"
    assert [rank_slice(cfg, r, k)[1:3] for r in range(8)] == [(0, d)] * 4 + [(d, 2 * d)] * 4
    assert rank_slice(cfg, 5, "model.layers.1.mlp.down_proj.weight") == (1, 80, 96, 128)
    assert rank_slice(cfg, 7, "model.embed_tokens.weight") == (0, 280, 320, 320)
    assert rank_slice(cfg, 3, "model.norm.weight") is None


def test_a_rank_reads_only_its_slices_of_split_tensors(
    folders: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 of 2 loads the slices rank_slice names (the padded vocabulary's last rows zero)
    without reading a split tensor whole: get_tensor, which would, is refused for them."""
    import engine.loader

    folder = folders["qwen2"]
    whole = dict(load_model(folder)[0].named_parameters())
    opened = engine.loader.safe_open

    class SlicesOnly:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.f = opened(*args, **kwargs)

        def __enter__(self) -> SlicesOnly:
            self.f.__enter__()
            return self

        def __exit__(self, *exc: Any) -> None:
            self.f.__exit__(*exc)

        def keys(self) -> Any:
            return self.f.keys()

        def get_slice(self, name: str) -> Any:
            return self.f.get_slice(name)

        def get_tensor(self, name: str) -> torch.Tensor:
            assert rank_slice(cfg, 1, name) is None, f"{name} read whole"
            return self.f.get_tensor(name)

    cfg = ModelConfig.from_folder(folder).sharded(2)
    monkeypatch.setattr(engine.loader, "safe_open", SlicesOnly)
    model, _ = load_model(folder, tp=TensorParallel(2, 1))
    for name, p in model.named_parameters():
        part = rank_slice(cfg, 1, name)
        if part is None:
            assert torch.equal(p, whole[name]), name
            continue
        dim, start, end, _ = part
        mine = whole[name].narrow(dim, start, end - start)
        assert torch.equal(p.narrow(dim, 0, end - start), mine), name
        assert not p.narrow(dim, end - start, p.shape[dim] - (end - start)).any(), (
            name
        )  # padding rows
    assert model.cfg.vocab_rows == 161 and model.model.embed_tokens.weight.shape[0] == 161


def test_eight_kv_heads_split_over_one_two_four_and_eight_ranks(tmp_path: Path) -> None:
    """GQA with 8 KV heads (Llama-3's): at N = 1, 2, 4, 8 each rank holds 8 / N of them, all of them
    once, and the 64 query heads that read them; the 70B configuration shards at the same sizes."""
    folder = write_tiny_model(
        tmp_path, "llama", num_attention_heads=16, num_key_value_heads=8, hidden_size=128
    )
    cfg = ModelConfig.from_folder(folder)
    for n in (1, 2, 4, 8):
        shard = cfg.sharded(n)
        assert (shard.num_heads, shard.num_kv_heads, shard.kv_head_replicas) == (16 // n, 8 // n, 1)
        held = [rank_slice(shard, r, "model.layers.0.self_attn.k_proj.weight") for r in range(n)]
        rows = [(0, 8 * cfg.head_dim)] if n == 1 else [part[1:3] for part in held]
        assert rows == [
            (r * 8 // n * cfg.head_dim, (r + 1) * 8 // n * cfg.head_dim) for r in range(n)
        ]
    big = ModelConfig.from_folder(
        Path(__file__).resolve().parents[2] / "bench" / "models" / "llama-3.1-70b"
    )
    assert [n for n in (1, 2, 3, 4, 5, 6, 7, 8) if n in tensor_parallel_sizes(big)] == [1, 2, 4, 8]


@pytest.mark.slow  # four processes on the CI's two cores
def test_four_ranks_over_two_kv_heads_equal_one_rank(
    folders: dict[str, str], tmp_path: Path
) -> None:
    """llama's 8 heads and 2 KV heads over 4 ranks: each KV head held by two ranks, greedy ids as
    one rank's."""
    folder = folders["llama"]
    one = scenario(folder, "cpu")
    for rank, got in enumerate(run_ranks(4, [(folder, "cpu")], tmp_path)):
        mine = got[f"{folder}|cpu"]
        assert [mine[p] for p in ("turn1", "turn2", "mixed")] == [
            one[p] for p in ("turn1", "turn2", "mixed")
        ], rank
