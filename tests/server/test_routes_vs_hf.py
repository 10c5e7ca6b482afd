"""Greedy token ids through the whole server equal Hugging Face's, for every architecture, on both
routes.

One `ppd` server per architecture. A turn-2 append asks for its route with the x-ppd-route request
header, so both routes run over a cached prefix; a small token budget makes both workers split
prompts into chunks.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from engine.demo import write_byte_tokenizer
from tests.server_process import ServerProcess, greedy_completion
from tests.tiny_models import ARCHS, MOE_ARCHS, assert_prompt_logprobs, hf_greedy, write_tiny_model

NEW_TOKENS = 8


# Served in the default suite: llama and mixtral (whose checkpoint names only the server's tests
# load in that suite); in the second (15-30 s each on 2 cores), mistral (llama's layers), qwen2,
# qwen3, qwen3_moe (mixtral's experts with q/k norms) and olmoe, whose layers differ from those by
# biases and q/k norms that tests/engine/test_model_vs_hf.py checks in the default suite.
SLOW_ARCHS = ("mistral", "qwen2", "qwen3", "qwen3_moe", "olmoe")


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(a, marks=pytest.mark.slow) if a in SLOW_ARCHS else a
        for a in (*ARCHS, *MOE_ARCHS)
    ],
)
def arch_server(request, start_server, tmp_path_factory) -> tuple[str, ServerProcess]:
    folder = write_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    write_byte_tokenizer(folder)
    server = start_server(
        "--model",
        str(folder),
        "--served-model-name",
        "tiny",
        "--policy",
        "ppd",
        "--max-num-batched-tokens",
        "32",
        "--max-num-seqs",
        "16",
    )
    return str(folder), server


def complete(
    server: ServerProcess, prompt: list[int], route: str | None = None
) -> tuple[list[int], str, int]:
    """Greedy ids, the route header and the cached prompt tokens; route asks for one for an
    append-prefill."""
    resp = greedy_completion(server, "tiny", prompt, NEW_TOKENS, route)
    body = resp.json()
    return (
        body["choices"][0]["token_ids"],
        resp.headers["x-ppd-route"],
        body["usage"]["prompt_tokens_details"]["cached_tokens"],
    )


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 256) for _ in range(n)]


def test_turn_one_and_two_on_both_routes(arch_server) -> None:
    folder, server = arch_server
    rng = random.Random(0)
    for append, expected_route in ((ids(rng, 10), "decode"), (ids(rng, 54), "prefill")):
        prompt = ids(rng, 45)
        out1, route1, cached1 = complete(
            server, prompt, route=expected_route
        )  # a miss: the prefill worker anyway
        assert out1 == hf_greedy(folder, prompt, NEW_TOKENS)
        assert (route1, cached1) == ("prefill", 0)
        turn2 = prompt + out1 + append
        out2, route2, cached2 = complete(server, turn2, route=expected_route)
        assert out2 == hf_greedy(folder, turn2, NEW_TOKENS)
        assert route2 == expected_route
        assert cached2 == (len(prompt + out1) - 1) // 16 * 16  # whole blocks whose KV was computed


def test_concurrent_mixed_batches(arch_server) -> None:
    folder, server = arch_server
    rng = random.Random(1)
    base = ids(rng, 40)
    first, _, _ = complete(server, base)
    prompts = [ids(rng, n) for n in (5, 17, 33, 70)] + [
        base + first + ids(rng, 6),
        base + first + ids(rng, 40),
    ]
    routes = [None] * 4 + ["decode", "prefill"]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda pr: complete(server, *pr), zip(prompts, routes)))
    for prompt, (out, _, _) in zip(prompts, results):
        assert out == hf_greedy(folder, prompt, NEW_TOKENS)
    assert {route for _, route, _ in results} == {"prefill", "decode"}


# a server of its own, about 17 s on 2 cores: in the second suite, under the default one's budget
@pytest.mark.slow
def test_aggregated_baseline_matches_hf(start_server, tmp_path_factory) -> None:
    """One worker per unit, chunked prefill for everything: the vLLM-default baseline, same greedy
    ids."""
    folder = write_tiny_model(tmp_path_factory.mktemp("aggregated"), "qwen3")
    write_byte_tokenizer(folder)
    server = start_server(
        "--model",
        str(folder),
        "--served-model-name",
        "tiny",
        "--policy",
        "aggregated",
        "--max-num-batched-tokens",
        "32",
        "--max-num-seqs",
        "16",
    )
    assert [w["role"] for w in server.health()["units"][0]["workers"]] == ["decode"]
    rng = random.Random(2)
    prompt = ids(rng, 50)
    out1, route1, _ = complete(server, prompt)
    turn2 = prompt + out1 + ids(rng, 40)
    out2, route2, cached2 = complete(server, turn2)
    assert out1 == hf_greedy(folder, prompt, NEW_TOKENS) and out2 == hf_greedy(
        folder, turn2, NEW_TOKENS
    )
    assert route1 == route2 == "decode" and cached2 > 0
    # Prompt logprobs inline, over two chunks, without the cached prefix (which has no logits).
    resp = httpx.post(
        f"{server.url}/v1/completions",
        timeout=120,
        json={
            "model": "tiny",
            "prompt": turn2,
            "max_tokens": 2,
            "temperature": 0,
            "prompt_logprobs": 2,
        },
    )
    assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert_prompt_logprobs(folder, turn2, resp.json()["choices"][0]["prompt_logprobs"], 2)
