"""Logprobs and penalties through the whole server, against transformers on the same weights, on
both routes.

One disaggregated server on a tiny Llama; a turn-2 append asks for its route with the x-ppd-route
header, so the first token of turn 1 comes from the prefill worker and the tokens after it (and a
decode-routed append's first) from the decode worker.
"""

from __future__ import annotations

import json
import random

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from tests.server_process import ServerProcess, greedy_completion
from tests.tiny_models import assert_prompt_logprobs, hf_logits, hf_model

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def server(start_server, tiny_llama) -> ServerProcess:
    return start_server(
        "--model",
        str(tiny_llama),
        "--served-model-name",
        "tiny",
        "--policy",
        "ppd",
        "--max-num-batched-tokens",
        "32",
        "--max-num-seqs",
        "16",
    )


def complete(server: ServerProcess, prompt: list[int], route: str | None = None, **fields) -> dict:
    return greedy_completion(
        server, "tiny", prompt, fields.pop("max_tokens", NEW_TOKENS), route, **fields
    ).json()


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 256) for _ in range(n)]


def turns(server: ServerProcess, seed: int, **fields) -> list[tuple[list[int], dict]]:
    """Turn 1, then a turn-2 append on each route: (prompt, response) for each."""
    rng = random.Random(seed)
    prompt = ids(rng, 40)
    first = complete(server, prompt, **fields)
    out = [(prompt, first)]
    for route, n in (("decode", 8), ("prefill", 40)):
        turn2 = prompt + first["choices"][0]["token_ids"] + ids(rng, n)
        resp = complete(server, turn2, route=route, **fields)
        assert resp["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        out.append((turn2, resp))
    return out


def test_logprobs_equal_transformers_log_softmax_on_both_routes(server, tiny_llama) -> None:
    for prompt, resp in turns(server, seed=0, logprobs=5):
        choice = resp["choices"][0]
        tokens, lp = choice["token_ids"], choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(tokens) == NEW_TOKENS
        for i, token in enumerate(tokens):
            ref = hf_logits(tiny_llama, prompt + tokens[:i])[-1].log_softmax(-1)
            assert token == int(ref.argmax())
            assert lp["token_logprobs"][i] == pytest.approx(float(ref[token]), abs=1e-4)
            # The legacy shape keys alternatives by text: bytes that are not UTF-8 alone all read
            # U+FFFD, and share one key (the chat shape lists every alternative).
            top = ref.topk(5).values.tolist()
            for value in lp["top_logprobs"][i].values():
                assert any(value == pytest.approx(v, abs=1e-4) for v in top)


def test_chat_logprobs_shape_and_values_streamed_and_not(server, tiny_llama) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 3,
        "return_token_ids": True,
    }
    whole = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()
    choice = whole["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == len(choice["token_ids"]) == NEW_TOKENS
    prompt = whole["prompt_token_ids"]
    for i, (token, entry) in enumerate(zip(choice["token_ids"], content)):
        ref = hf_logits(tiny_llama, prompt + choice["token_ids"][:i])[-1].log_softmax(-1)
        assert entry["logprob"] == pytest.approx(float(ref[token]), abs=1e-4)
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(
            ref.topk(3).values.tolist(), abs=1e-4
        )
        if token < 256:  # the byte tokenizer: token b is byte b, whatever its text shows
            assert entry["bytes"] == [token]
    # Streamed: the same entries, spread over the chunks.
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=120
    ) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    streamed = [
        e
        for c in chunks
        for ch in c["choices"]
        if ch.get("logprobs")
        for e in ch["logprobs"]["content"]
    ]
    assert [e["logprob"] for e in streamed] == pytest.approx(
        [e["logprob"] for e in content], abs=1e-4
    )
    assert [e["token"] for e in streamed] == [e["token"] for e in content]


def test_prompt_logprobs_equal_transformers_and_bypass_the_cache(server, tiny_llama) -> None:
    """A 40-token prompt runs in two chunks on the prefill worker; its logprobs are computed in
    both. A later turn asks for them too: it cannot read its prefix from the cache (a cached
    block has no logits), so it computes its whole prompt, and its blocks are cached for the next
    turn all the same."""
    rng = random.Random(4)
    prompt = ids(rng, 40)
    first = complete(server, prompt, prompt_logprobs=3)
    assert_prompt_logprobs(tiny_llama, prompt, first["choices"][0]["prompt_logprobs"], 3)
    assert first["choices"][0]["token_ids"] == complete(server, prompt)["choices"][0]["token_ids"]
    turn2 = prompt + first["choices"][0]["token_ids"] + ids(rng, 10)
    for route in ("decode", "prefill"):
        resp = complete(server, turn2, route=route, prompt_logprobs=0)
        assert resp["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        shown = resp["choices"][0]["prompt_logprobs"]
        assert all(len(entry) == 1 for entry in shown[1:])  # the prompt's own token alone
        assert_prompt_logprobs(tiny_llama, turn2, shown, 0)
    assert complete(server, turn2)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_echo_with_logprobs_covers_prompt_and_completion(server, tiny_llama) -> None:
    """The completions API's echo (as evaluation harnesses score text): the prompt's text comes
    first, its tokens open the logprobs with a null for the first one; max_tokens 0 gives the
    prompt alone."""
    rng = random.Random(5)
    prompt = ids(rng, 12)
    ref = hf_logits(tiny_llama, prompt).log_softmax(-1)
    resp = complete(server, prompt, echo=True, logprobs=2)
    choice = resp["choices"][0]
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["tokens"]) == len(prompt) + NEW_TOKENS
    for i, token in enumerate(prompt[1:]):
        assert lp["token_logprobs"][i + 1] == pytest.approx(float(ref[i, token]), abs=1e-4)
    prompt_text = AutoTokenizer.from_pretrained(tiny_llama).decode(prompt)
    plain = complete(server, prompt, logprobs=2)["choices"][0]
    assert choice["text"] == prompt_text + plain["text"]
    assert lp["token_logprobs"][len(prompt) :] == pytest.approx(
        plain["logprobs"]["token_logprobs"], abs=1e-4
    )
    assert "prompt_logprobs" not in choice  # not asked: echo's own logprobs carry them

    scored = complete(server, prompt, echo=True, logprobs=1, max_tokens=0)
    assert (
        scored["choices"][0]["text"] == prompt_text
        and scored["choices"][0]["finish_reason"] == "length"
    )
    assert scored["usage"]["completion_tokens"] == 0 and scored["choices"][0]["token_ids"] == []
    assert scored["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][: len(prompt)]

    # Streamed: the first chunk opens with the prompt; the chunks join to the whole answer.
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "echo": True,
        "logprobs": 2,
        "prompt_logprobs": 1,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as stream:
        chunks = [
            json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")
        ]
    parts = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(p["text"] for p in parts) == choice["text"]
    assert parts[0]["text"].startswith(prompt_text)
    assert [v for p in parts for v in p["logprobs"]["token_logprobs"]] == pytest.approx(
        lp["token_logprobs"], abs=1e-4
    )
    assert_prompt_logprobs(tiny_llama, prompt, parts[0]["prompt_logprobs"], 1)
    assert all("prompt_logprobs" not in p for p in parts[1:])


def test_chat_prompt_logprobs(server, tiny_llama) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "temperature": 0,
        "prompt_logprobs": 2,
        "return_token_ids": True,
    }
    whole = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()
    assert_prompt_logprobs(tiny_llama, whole["prompt_token_ids"], whole["prompt_logprobs"], 2)
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=120
    ) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    shown = [c["prompt_logprobs"] for c in chunks if "prompt_logprobs" in c]
    assert len(shown) == 1
    assert shown[0] == whole["prompt_logprobs"]


def test_repetition_penalty_greedy_equals_transformers_generate(server, tiny_llama) -> None:
    model = hf_model(tiny_llama)
    for prompt, resp in turns(server, seed=1, repetition_penalty=1.8):
        ours = resp["choices"][0]["token_ids"]
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([prompt]),
                do_sample=False,
                repetition_penalty=1.8,
                max_new_tokens=NEW_TOKENS,
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            )
        ref_ids = ref[
            0, len(prompt) :
        ].tolist()  # generate stops after an EOS; the server was told to ignore it
        assert ours[: len(ref_ids)] == ref_ids


def test_frequency_and_presence_penalties_follow_openai_on_both_routes(server, tiny_llama) -> None:
    for prompt, resp in turns(server, seed=2, frequency_penalty=1.5, presence_penalty=0.5):
        ours = resp["choices"][0]["token_ids"]
        for i, token in enumerate(ours):
            counts = torch.bincount(torch.tensor(ours[:i], dtype=torch.long), minlength=320).float()
            expected = (
                hf_logits(tiny_llama, prompt + ours[:i])[-1]
                - 1.5 * counts
                - 0.5 * (counts > 0).float()
            )
            assert token == int(expected.argmax())


def test_logit_bias_and_min_p(server) -> None:
    rng = random.Random(3)
    out = complete(server, ids(rng, 20), logit_bias={"65": 100})["choices"][0]["token_ids"]
    assert out == [65] * NEW_TOKENS
    # min_p 1: only the most likely token survives, so sampling at any temperature is greedy.
    prompt = ids(rng, 20)
    greedy = complete(server, prompt)["choices"][0]["token_ids"]
    assert (
        complete(server, prompt, temperature=1.5, min_p=1.0, seed=5)["choices"][0]["token_ids"]
        == greedy
    )


def test_a_temperature_too_small_to_divide_by_is_greedy(server) -> None:
    # Fuzzing sent 5e-324 with a choice grammar: 0 in float32, the logits divided by it were
    # infinite, the draw left the grammar and the request ended in a 500. As in vLLM, a temperature
    # below 1e-5 is greedy.
    prompt = ids(random.Random(4), 20)
    greedy = complete(server, prompt)["choices"][0]["token_ids"]
    for temperature in (5e-324, 1e-30, 9e-6):
        assert (
            complete(server, prompt, temperature=temperature)["choices"][0]["token_ids"] == greedy
        )
    resp = httpx.post(
        f"{server.url}/v1/completions",
        timeout=30,
        json={
            "model": "tiny",
            "prompt": "0",
            "max_tokens": 2,
            "temperature": 5e-324,
            "structured_outputs": {"choice": ["ab", "cd"]},
        },
    )
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] in ("ab", "cd"), resp.text


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias.5"),
        ({"logit_bias": {"100000": 1}}, "logit_bias"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        (
            {"repetition_penalty": 5e-324},
            "repetition_penalty",
        ),  # fuzzing found it: logits divided by it were infinite
        ({"min_p": 1.5}, "min_p"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"max_tokens": 0}, "echo"),
        ({"suffix": "x"}, "suffix"),
        ({"use_beam_search": True}, "use_beam_search"),
    ],
)
def test_refusals_name_their_field(server, fields, param) -> None:
    resp = httpx.post(
        f"{server.url}/v1/completions",
        timeout=30,
        json={"model": "tiny", "prompt": "hi", "max_tokens": 2, **fields},
    )
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_chat_top_logprobs_needs_logprobs(server) -> None:
    for fields in ({"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}):
        resp = httpx.post(
            f"{server.url}/v1/chat/completions",
            timeout=30,
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields},
        )
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "top_logprobs", (
            resp.text
        )
