"""Stored conversations without a server: the next turn's prompt from the stored token ids
(server/conversation.py), checked against the full render of the whole conversation on four chat
templates; and the store's bound, eviction order and SQLite file (server/response_store.py)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from server.conversation import continued_prompt, render, system_messages
from server.response_store import ResponseStore, SqliteResponseStore, StoredResponse
from tests.chat_templates import TEMPLATES, write_template

FAMILIES = ["demo", *TEMPLATES]
HISTORY = [{"role": "user", "content": "Weather in Paris?"}]
NEW = [{"role": "user", "content": "And in Rome?"}]
CALL = {
    "id": "Call12345",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module", params=FAMILIES)
def tokenizer(request, tmp_path_factory):
    from transformers import AutoTokenizer

    from engine.demo import write_byte_tokenizer

    folder = tmp_path_factory.mktemp(request.param)
    write_byte_tokenizer(folder)
    if request.param != "demo":
        write_template(folder, request.param)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.family = request.param
    return tok


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def first_turn(
    tok, assistant: dict, output_ids: list[int], instructions: str | None = "Be brief.", tools=None
) -> StoredResponse:
    prompt = encode(tok, render(tok, system_messages(instructions) + HISTORY, tools, True))
    return StoredResponse(
        "resp_1", {}, instructions, list(HISTORY), tools, prompt, output_ids, assistant, exact=True
    )


def full_ids(
    tok, prev: StoredResponse, instructions: str | None, new: list[dict], tools=None
) -> list[int]:
    return encode(
        tok,
        render(
            tok, system_messages(instructions) + prev.history + [prev.assistant] + new, tools, True
        ),
    )


def test_text_answer_keeps_the_ids_and_equals_the_full_render(tokenizer) -> None:
    # A byte-level tokenizer gives one tokenization of valid text, so where the answer is valid text
    # the kept ids must be exactly the full render's: any closing or boundary the incremental path
    # gets wrong shows here.
    content = "It is sunny, 21°C."
    eos = tokenizer.convert_tokens_to_ids("<|end|>")
    prev = first_turn(
        tokenizer, {"role": "assistant", "content": content}, encode(tokenizer, content) + [eos]
    )
    ids, kept = continued_prompt(tokenizer, prev, "Be brief.", NEW, None)
    assert ids == full_ids(tokenizer, prev, "Be brief.", NEW)
    # Mistral's template moves the system prompt into the last user message: earlier turns change,
    # so it falls back.
    assert kept == (tokenizer.family != "mistral-v0.3")
    # the answer's ids as generated; its stop token too where the template closes the turn with it
    # (demo)
    if kept:
        closes_with_stop = tokenizer.family == "demo"
        kept_ids = prev.output_ids if closes_with_stop else prev.output_ids[:-1]
        assert ids[: len(prev.prompt_ids) + len(kept_ids)] == prev.prompt_ids + kept_ids


def test_answer_ids_that_are_not_text_are_kept_as_generated(tokenizer) -> None:
    rng = random.Random(0)
    generated = [
        rng.randrange(128, 256) for _ in range(24)
    ]  # lone UTF-8 continuation bytes: not text
    content = tokenizer.decode(generated)
    assert encode(tokenizer, content) != generated  # re-tokenizing would lose them
    prev = first_turn(tokenizer, {"role": "assistant", "content": content}, generated)
    ids, kept = continued_prompt(tokenizer, prev, "Be brief.", NEW, None)
    full = full_ids(tokenizer, prev, "Be brief.", NEW)
    if (
        tokenizer.family == "mistral-v0.3"
    ):  # earlier turns change: the full render, as chat completions runs
        assert not kept and ids == full
        return
    assert kept and ids[: len(prev.prompt_ids) + len(generated)] == prev.prompt_ids + generated
    # After the answer, the same tokens as the full render: the template's closing and the new
    # message.
    tail = len(full) - len(prev.prompt_ids) - len(encode(tokenizer, content))
    assert ids[-tail:] == full[-tail:]


def test_tool_call_answers_take_the_templates_rendering(tokenizer) -> None:
    prev = first_turn(
        tokenizer,
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        encode(tokenizer, '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'),
        tools=TOOLS,
    )
    answer = [
        {
            "role": "tool",
            "tool_call_id": "Call12345",
            "name": "get_weather",
            "content": '{"celsius": 21}',
        }
    ]
    ids, kept = continued_prompt(tokenizer, prev, "Be brief.", answer, TOOLS)
    assert ids == full_ids(tokenizer, prev, "Be brief.", answer, TOOLS) and kept == (
        tokenizer.family != "mistral-v0.3"
    )
    assert not kept or ids[: len(prev.prompt_ids)] == prev.prompt_ids


def test_other_instructions_or_tools_render_in_full(tokenizer) -> None:
    generated = [200, 201, 202]
    prev = first_turn(
        tokenizer, {"role": "assistant", "content": tokenizer.decode(generated)}, generated
    )
    for instructions, tools in (("Be verbose.", None), (None, None), ("Be brief.", TOOLS)):
        ids, kept = continued_prompt(tokenizer, prev, instructions, NEW, tools)
        assert not kept and ids == full_ids(tokenizer, prev, instructions, NEW, tools)


def stored(i: int, size: int = 100) -> StoredResponse:
    return StoredResponse(
        f"resp_{i}",
        {"id": f"resp_{i}", "object": "response"},
        None,
        [{"role": "user", "content": "x"}],
        None,
        list(range(size)),
        [7, 8, 9],
        {"role": "assistant", "content": "y"},
        exact=True,
    )


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_store_round_trips_and_drops_the_oldest_past_its_bound(kind: str, tmp_path: Path) -> None:
    one = len(stored(0).to_bytes())

    def open_store() -> ResponseStore:
        return (
            ResponseStore(3 * one)
            if kind == "memory"
            else SqliteResponseStore(str(tmp_path / "r.db"), 3 * one)
        )

    store = open_store()
    for i in range(5):
        store.put(stored(i))
    assert [store.get(f"resp_{i}") is not None for i in range(5)] == [
        False,
        False,
        True,
        True,
        True,
    ]
    assert store.get("resp_4") == stored(4) and store.num_bytes == 3 * one
    assert store.delete("resp_3") and not store.delete("resp_3") and store.get("resp_3") is None
    store.put(
        stored(9, size=10_000)
    )  # larger than the whole store: kept nowhere, nothing else dropped
    assert store.get("resp_9") is None and store.get("resp_4") is not None
    if kind == "sqlite":  # a second process's view, or the store after a restart
        store.close()
        again = open_store()
        assert (
            again.get("resp_4") == stored(4)
            and again.get("resp_2") is not None
            and again.get("resp_3") is None
        )
        again.close()
