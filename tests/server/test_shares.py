"""The share manager in `ppd serve --partition cpu --share-manager`: with a profile that says a side
alone runs faster on every core, the workers are repinned as load comes and goes, /health and
/metrics say so, and greedy ids stay transformers'."""

from __future__ import annotations

import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from partition.profile import DecodePoint, PartitionProfile, PrefillPoint
from tests.tiny_models import hf_greedy

NEW_TOKENS = 16

pytestmark = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="needs two cores to move workers between"
)


def two_core_profile(path: Path) -> Path:
    """Two cores twice as fast as one, for decode and prefill alike: every idle spell pays to spread
    out."""
    decode = [
        DecodePoint(share, batch, context, 4.0 / share, 0.0)
        for share in (1, 2)
        for batch in (1, 16)
        for context in (16, 512)
    ]
    prefill = [
        PrefillPoint(share, prompt, 1000.0 * share) for share in (1, 2) for prompt in (16, 512)
    ]
    return PartitionProfile("cpu-2core", "tiny", "cores", 2, [1, 2], decode, prefill).save(path)


@pytest.fixture(scope="module")
def served(start_server, tiny_llama, tmp_path_factory):
    folder = tiny_llama
    profile = two_core_profile(tmp_path_factory.mktemp("profile") / "two-core.json")
    server = start_server(
        "--model",
        str(folder),
        "--served-model-name",
        "tiny",
        "--policy",
        "pd",
        "--partition",
        "cpu",
        "--partition-profile",
        str(profile),
        "--share-manager",
        "--itl-slo-ms",
        "1000",
        "--max-num-batched-tokens",
        "32",
        "--max-num-seqs",
        "16",
    )
    return folder, server


def complete(server, prompt: list[int]) -> list[int]:
    resp = httpx.post(
        f"{server.url}/v1/completions",
        timeout=120,
        json={
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": NEW_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


def test_workers_move_between_cores_as_load_changes_and_answers_stay_exact(served) -> None:
    folder, server = served
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.choice((20, 90)))] for _ in range(8)]
    assert complete(server, prompts[0]) == hf_greedy(
        folder, prompts[0], NEW_TOKENS
    )  # alone: decode spreads out
    with ThreadPoolExecutor(
        4
    ) as pool:  # prefills beside decodes: the overlap ends, then comes back
        outs = list(pool.map(lambda p: complete(server, p), prompts))
    assert outs == [hf_greedy(folder, p, NEW_TOKENS) for p in prompts]
    metrics = server.metrics()
    assert metrics["ppd:partition_switches_total"] >= 2
    partition = server.health()["units"][0]["partition"]
    assert partition["backend"] == "cpu" and partition["switches"] >= 2
    assert {partition["decode_share"], partition["prefill_share"]} <= {1, 2}


@pytest.mark.slow  # a server of its own (over 10 s on 2 cores): the second suite
def test_without_the_share_manager_the_workers_stay_where_they_started(
    start_server, served
) -> None:
    folder, _ = served
    server = start_server(
        "--model",
        str(folder),
        "--served-model-name",
        "tiny",
        "--policy",
        "pd",
        "--partition",
        "cpu",
        "--max-num-batched-tokens",
        "32",
        "--max-num-seqs",
        "16",
    )
    prompt = list(range(3, 60))
    assert complete(server, prompt) == hf_greedy(folder, prompt, NEW_TOKENS)
    partition = server.health()["units"][0]["partition"]
    assert (partition["decode_share"], partition["prefill_share"], partition["switches"]) == (
        1,
        1,
        0,
    )
