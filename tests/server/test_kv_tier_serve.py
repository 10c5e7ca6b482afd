"""The second KV tier and the cache hints through the whole server: conversations whose KV outgrows
the pool come back from the tier on both routes with transformers' greedy ids; the hints of
OpenAI's and Anthropic's APIs are taken, reported in usage, or refused by name; a decode worker
killed in the middle of a copy costs its own unit's requests only, and comes back with an empty
tier."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import httpx
import pytest

from engine.demo import write_byte_tokenizer
from tests.server_process import ServerProcess, greedy_completion, wait_until
from tests.tiny_models import hf_greedy, write_tiny_model

NEW_TOKENS = 6
BLOCK = 16
POOL_BLOCKS = 24  # 384 tokens: two conversations of 150 fit, not more
CONVERSATIONS = 5  # the LRU evicts the first whole (the tail of a prefix goes first)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    folder = write_tiny_model(tmp_path_factory.mktemp("llama"), "llama")
    write_byte_tokenizer(folder)
    return folder


def tier_args(model: Path, tier_dir: Path, *more: str) -> list[str]:
    """`ppd serve`'s arguments for the tiny model with a small pool and a tier (more: the test's
    own, before them)."""
    return [
        "--model",
        str(model),
        "--served-model-name",
        "tiny",
        *more,
        "--num-kv-blocks",
        str(POOL_BLOCKS),
        "--max-model-len",
        "256",
        "--kv-offloading-size",
        "0.01",
        "--kv-offloading-dir",
        str(tier_dir),
    ]


@pytest.fixture(scope="module")
def tier_server(start_server, tiny, tmp_path_factory) -> ServerProcess:
    return start_server(*tier_args(tiny, tmp_path_factory.mktemp("tier")))


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 256) for _ in range(n)]


def complete(server: ServerProcess, prompt: list[int], route: str | None = None, **fields) -> dict:
    return greedy_completion(server, "tiny", prompt, NEW_TOKENS, route, **fields).json()


@pytest.mark.parametrize("route", ["decode", "prefill"])
def test_an_evicted_conversation_comes_back_from_the_tier(tier_server, tiny, route) -> None:
    rng = random.Random(route)
    firsts = [ids(rng, 150) for _ in range(CONVERSATIONS)]
    answers = []
    for prompt in firsts:  # each turn 1 evicts an earlier one from the pool
        body = complete(tier_server, prompt)
        answers.append(body["choices"][0]["token_ids"])
    loaded_before = tier_server.metrics().get("ppd:kv_tier_loaded_blocks_total", 0.0)
    turn2 = firsts[0] + answers[0] + ids(rng, 10)
    body = complete(tier_server, turn2, route)
    assert body["choices"][0]["token_ids"] == hf_greedy(tiny, turn2, NEW_TOKENS)
    # Every whole block of turn 1 whose KV was computed is cached again, from the tier.
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 150 // BLOCK * BLOCK
    wait_until(  # the workers' counters reach the API server with their stats, every 0.25 s
        lambda: (
            tier_server.metrics()["ppd:kv_tier_loaded_blocks_total"] - loaded_before >= 150 // BLOCK
        ),
        10,
        "the tier's loads to be counted",
    )
    metrics = tier_server.metrics()
    assert metrics["ppd:kv_tier_stored_blocks_total"] > 0
    assert metrics["ppd:kv_tier_loaded_tokens_total"] == (
        metrics["ppd:kv_tier_loaded_blocks_total"] * BLOCK
    )


def test_health_reports_the_tiers_fill(tier_server) -> None:
    tier = tier_server.health()["units"][0]["kv_cache"]["tier"]
    assert tier["capacity_blocks"] > 0 and 0 <= tier["blocks"] <= tier["capacity_blocks"]
    assert tier["capacity_bytes"] >= tier["capacity_blocks"]


def test_openai_retention_is_served_and_its_cut_reported(tier_server) -> None:
    rng = random.Random(5)
    body = complete(tier_server, ids(rng, 40), prompt_cache_retention="24h", prompt_cache_key="s1")
    assert body["usage"]["ppd_cache_retention"] == {
        "requested": "24h",
        "requested_seconds": 86400.0,
        "applied_seconds": 3600.0,
        "note": "retention is capped at 3600 s, within a bounded share of the KV pool",
    }
    body = complete(tier_server, ids(rng, 40), prompt_cache_retention="in_memory")
    assert body["usage"]["ppd_cache_retention"]["applied_seconds"] == 600.0
    plain = complete(tier_server, ids(rng, 40))
    assert "ppd_cache_retention" not in plain["usage"]


def test_the_responses_api_takes_the_same_hints(tier_server) -> None:
    resp = httpx.post(
        f"{tier_server.url}/v1/responses",
        timeout=60,
        json={
            "model": "tiny",
            "input": "hello there",
            "max_output_tokens": 3,
            "prompt_cache_key": "agent-7",
            "prompt_cache_retention": "in_memory",
        },
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["ppd_cache_retention"]["applied_seconds"] == 600.0


def test_a_retention_openai_does_not_have_is_refused_by_name(tier_server) -> None:
    resp = httpx.post(
        f"{tier_server.url}/v1/completions",
        timeout=30,
        json={"model": "tiny", "prompt": [5, 6, 7], "prompt_cache_retention": "1h"},
    )
    assert resp.status_code == 400 and "prompt_cache_retention" in resp.text


def messages(server: ServerProcess, content: list[dict], system=None) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/messages",
        timeout=60,
        json={
            "model": "tiny",
            "max_tokens": 3,
            "temperature": 0,
            "messages": [{"role": "user", "content": content}],
            **({"system": system} if system is not None else {}),
        },
    )


def test_anthropic_cache_control_reports_what_it_created_and_read(tier_server) -> None:
    text = "an agent's tool output, long enough to fill several blocks of the cache. " * 2
    system = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]
    block = {"type": "text", "text": text, "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    first = messages(tier_server, [block], system)
    assert first.status_code == 200, first.text
    usage = first.json()["usage"]
    total = usage["input_tokens"] + usage["cache_read_input_tokens"]
    total += usage["cache_creation_input_tokens"]
    assert usage["cache_creation_input_tokens"] > 0
    assert usage["cache_creation"] == {
        "ephemeral_5m_input_tokens": 0,
        "ephemeral_1h_input_tokens": usage["cache_creation_input_tokens"],
    }
    again = messages(tier_server, [block], system).json()["usage"]
    assert again["cache_read_input_tokens"] > 0
    assert (
        again["input_tokens"]
        + again["cache_read_input_tokens"]
        + again["cache_creation_input_tokens"]
        == total
    )
    assert again["ppd_cache_retention"]["applied_seconds"] == 3600.0


def test_anthropic_cache_control_it_cannot_read_is_refused_by_place(tier_server) -> None:
    bad = {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral", "ttl": "2h"}}
    resp = messages(tier_server, [bad])
    assert resp.status_code == 400
    message = resp.json()["error"]["message"]
    assert (
        message.startswith("messages[0].content[0].cache_control.ttl: '2h'") and '"1h"' in message
    )


# about 45 s on 2 cores: in the second suite, which keeps the default one under 10 minutes
@pytest.mark.slow
def test_a_decode_worker_killed_mid_copy_costs_only_its_own_units_requests(
    cache_dir: Path, tmp_path: Path, tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unit 0's decode worker dies at its first copy to the tier (engine/faults.py). A request
    running on unit 1 meanwhile is answered in full; unit 0 restarts, its tier empty (nothing
    half-written is found), and serves the evicted conversation again, recomputed, with the right
    ids."""
    monkeypatch.setenv("PPD_INJECT_FAULT", f"kv-tier-copy:{tmp_path / 'fired'}")
    server = ServerProcess(
        *tier_args(tiny, tmp_path / "tier", "--units", "2", "--policy", "dlocal"),
        cache_dir=cache_dir,
        log_path=tmp_path / "serve.log",
    )
    try:
        rng = random.Random(9)
        other = ids(rng, 20)
        other_answer: dict = {}

        def on_unit_1() -> None:
            other_answer["resp"] = httpx.post(
                f"{server.url}/v1/completions",
                timeout=120,
                headers={"x-data-parallel-rank": "1"},
                json={
                    "model": "tiny",
                    "prompt": other,
                    "max_tokens": 150,
                    "temperature": 0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                },
            )

        thread = threading.Thread(target=on_unit_1)
        thread.start()
        on_0 = {"x-data-parallel-rank": "0"}
        firsts = [ids(rng, 150) for _ in range(3)]
        statuses = []
        for prompt in firsts:  # the third evicts the first: the first copy to the tier
            resp = httpx.post(
                f"{server.url}/v1/completions",
                timeout=120,
                headers=on_0,
                json={"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0},
            )
            statuses.append(resp.status_code)
        thread.join()
        assert (tmp_path / "fired").exists() and (503 in statuses or 500 in statuses)
        resp = other_answer["resp"]
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["token_ids"] == hf_greedy(tiny, other, 150)
        wait_until(lambda: server.health()["status"] == "ok", 120, "unit 0 to restart")
        tier = server.health()["units"][0]["kv_cache"]["tier"]
        assert tier["blocks"] == 0  # a restarted worker's tier starts empty
        prompt = firsts[0] + ids(rng, 5)
        resp = httpx.post(
            f"{server.url}/v1/completions",
            timeout=120,
            headers=on_0,
            json={
                "model": "tiny",
                "prompt": prompt,
                "max_tokens": NEW_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        assert resp.json()["choices"][0]["token_ids"] == hf_greedy(tiny, prompt, NEW_TOKENS)
        assert "kv-tier-copy (PPD_INJECT_FAULT)" in (tmp_path / "serve.log").read_text()
    finally:
        server.stop()


@pytest.mark.slow  # a -tp 2 unit's four processes on 2 cores: a minute
def test_under_tensor_parallelism_every_rank_stores_and_loads_its_own_shard(
    cache_dir: Path, tmp_path: Path, tiny: Path
) -> None:
    """Rank 0 decides the copies; rank 1 runs them on its half of the KV heads (kv_copy): a
    conversation brought back from the tier must give transformers' ids, which it would not if a
    rank's shard came back from another block."""
    server = ServerProcess(
        *tier_args(tiny, tmp_path / "tier", "--tensor-parallel-size", "2"),
        cache_dir=cache_dir,
        log_path=tmp_path / "serve.log",
    )
    try:
        rng = random.Random(11)
        firsts = [ids(rng, 150) for _ in range(CONVERSATIONS)]
        answers = [complete(server, p)["choices"][0]["token_ids"] for p in firsts]
        turn2 = firsts[0] + answers[0] + ids(rng, 10)
        body = complete(server, turn2)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 150 // BLOCK * BLOCK
        assert body["choices"][0]["token_ids"] == hf_greedy(tiny, turn2, NEW_TOKENS)
        wait_until(
            lambda: server.metrics().get("ppd:kv_tier_loaded_blocks_total", 0) > 0,
            10,
            "the tier's loads to be counted",
        )
    finally:
        server.stop()
