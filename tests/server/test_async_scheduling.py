"""Async scheduling (--async-scheduling): each worker builds its next step while the one before
runs, the next step's tokens taken on the device. The same requests give the same ids with it on
and off, transformers' greedy ids on both routes, and every block back once they end (stop tokens
and aborts while the next step is on the device included).

On the CPU a step runs on the host, so the two modes differ only in order; what is checked is that
the order is right.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from engine.demo import write_byte_tokenizer
from tests.server_process import ServerProcess, greedy_completion, wait_until
from tests.tiny_models import hf_greedy, write_tiny_model

# Two servers of their own, about a minute on 2 cores: in the second suite, under the default one's
# budget.
pytestmark = pytest.mark.slow

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def servers(start_server, tmp_path_factory) -> tuple[str, dict[bool, ServerProcess]]:
    folder = write_tiny_model(tmp_path_factory.mktemp("llama"), "llama")
    write_byte_tokenizer(folder)
    common = (
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
    on = start_server(*common, "--async-scheduling")
    off = start_server(*common, "--no-async-scheduling")
    return str(folder), {True: on, False: off}


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 256) for _ in range(n)]


def complete(
    server: ServerProcess,
    prompt: list[int],
    max_tokens: int = NEW_TOKENS,
    route: str | None = None,
    **fields,
) -> dict:
    return greedy_completion(server, "tiny", prompt, max_tokens, route, **fields).json()


def token_ids(body: dict) -> list[list[int]]:
    return [c["token_ids"] for c in sorted(body["choices"], key=lambda c: c["index"])]


def assert_all_blocks_back(server: ServerProcess) -> None:
    wait_until(
        lambda: server.metrics().get("vllm:kv_cache_usage_perc", 1.0) == 0.0,
        10,
        "every KV block back",
    )


def test_async_scheduling_is_on_where_asked(servers) -> None:
    _, by_mode = servers
    for on, server in by_mode.items():
        assert ("async scheduling on" in server.log_path.read_text()) == on


def test_both_routes_and_mixed_batches_match_hf(servers) -> None:
    folder, by_mode = servers
    server = by_mode[True]
    rng = random.Random(0)
    for append, route in ((ids(rng, 10), "decode"), (ids(rng, 54), "prefill")):
        prompt = ids(rng, 45)
        first = token_ids(complete(server, prompt))[0]
        assert first == hf_greedy(folder, prompt, NEW_TOKENS)
        turn2 = prompt + first + append
        assert token_ids(complete(server, turn2, route=route))[0] == hf_greedy(
            folder, turn2, NEW_TOKENS
        )
    # Requests of different lengths end by length at different steps while the next step is being
    # built.
    prompts = [ids(rng, n) for n in (5, 17, 33, 70, 9)]
    lengths = [3, 12, 7, 1, 10]
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(
            pool.map(lambda pl: token_ids(complete(server, pl[0], pl[1]))[0], zip(prompts, lengths))
        )
    for prompt, n, out in zip(prompts, lengths, outs):
        assert out == hf_greedy(folder, prompt, n)
    assert_all_blocks_back(server)


def test_the_same_answers_with_it_on_and_off(servers) -> None:
    """Stop tokens (the request ends while its next step is on the device), seeded sampling,
    penalties (whose steps wait for the tokens before them), logprobs and n > 1: the same ids,
    finish reasons and logprobs either way (one request at a time, so that both servers run the
    same batches: float sums in another batch shape may differ in their last bit)."""
    folder, by_mode = servers
    rng = random.Random(1)
    base = ids(rng, 30)
    greedy = hf_greedy(folder, base, NEW_TOKENS)
    requests = [
        dict(prompt=base, stop_token_ids=[greedy[4]]),  # ends at its fifth token by the stop id
        dict(prompt=ids(rng, 20), temperature=1.0, seed=7, n=2),
        dict(prompt=ids(rng, 25), temperature=0.8, top_p=0.9, seed=3, logprobs=2),
        dict(prompt=ids(rng, 15), frequency_penalty=0.5, repetition_penalty=1.3),
        dict(prompt=ids(rng, 40), min_tokens=4, stop_token_ids=[greedy[0]]),
        dict(prompt=ids(rng, 12)),
    ]

    def answers(server: ServerProcess) -> list[tuple]:
        def one(fields: dict) -> tuple:
            body = complete(server, **fields)
            return (
                token_ids(body),
                [c["finish_reason"] for c in body["choices"]],
                [c["logprobs"] for c in body["choices"]],
            )

        return [one(fields) for fields in requests]

    on, off = answers(by_mode[True]), answers(by_mode[False])
    assert on == off
    stopped, finish, _ = on[0]
    assert stopped[0] == greedy[:5] and finish == ["stop"]
    assert_all_blocks_back(by_mode[True])


def test_streams_abandoned_mid_answer_free_their_blocks(servers) -> None:
    folder, by_mode = servers
    server = by_mode[True]
    rng = random.Random(2)
    prompts = [ids(rng, 20 + 7 * k) for k in range(4)]

    def abandon(prompt: list[int]) -> None:
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 200,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as resp:
            for k, _ in enumerate(resp.iter_lines()):
                if k == 3:
                    return  # the client leaves while later steps are being built

    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(abandon, prompts))
    assert_all_blocks_back(server)
    prompt = ids(rng, 33)
    assert token_ids(complete(server, prompt))[0] == hf_greedy(folder, prompt, NEW_TOKENS)
