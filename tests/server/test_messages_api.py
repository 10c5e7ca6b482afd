"""Anthropic's Messages API through the anthropic SDK (messages.create, messages.stream,
count_tokens) against `ppd serve --api-key` with the demo model: text and tool_use blocks, a tool
round trip whose second turn reads the first from the prefix cache, streamed events in
Anthropic's order, stop reasons, and Anthropic-shaped errors."""

from __future__ import annotations

import httpx
import pytest

anthropic = pytest.importorskip(
    "anthropic"
)  # the test extra has it; a GPU host's software need not

from tests.server_process import ServerProcess  # noqa: E402

KEY = "test-key"
GREEDY = {
    "temperature": 0
}  # this SDK version has no sampling arguments; the server takes Anthropic's fields
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}},
        "required": ["city"],
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(start_server) -> ServerProcess:
    return start_server("--api-key", KEY)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=300)


def test_create_and_stream_give_the_same_text(client: anthropic.Anthropic) -> None:
    made = client.messages.create(
        model="demo", max_tokens=12, system="Be brief.", messages=ASK, extra_body=GREEDY
    )
    assert made.type == "message" and made.role == "assistant" and made.id.startswith("msg_")
    assert made.stop_reason == "max_tokens" and made.usage.output_tokens == 12
    assert [b.type for b in made.content] == ["text"]
    with client.messages.stream(
        model="demo", max_tokens=12, system="Be brief.", messages=ASK, extra_body=GREEDY
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert final.content[0].text == made.content[0].text and final.stop_reason == "max_tokens"
    # The same prompt again: its whole blocks come from the prefix cache, and input_tokens counts
    # the rest.
    assert final.usage.cache_read_input_tokens > 0
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == made.usage.input_tokens
    counted = client.messages.count_tokens(model="demo", system="Be brief.", messages=ASK)
    assert counted.input_tokens == made.usage.input_tokens


def test_tool_use_round_trip_streams_the_input_and_reuses_the_prefix(
    client: anthropic.Anthropic,
) -> None:
    forced = {"type": "tool", "name": "get_weather"}
    with client.messages.stream(
        model="demo",
        max_tokens=60,
        tools=[WEATHER],
        tool_choice=forced,
        messages=ASK,
        extra_body=GREEDY,
    ) as stream:
        events = list(stream)
        first = stream.get_final_message()
    partial = [
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert len(partial) > 1, "the tool input streams as it is generated"
    (call,) = first.content
    assert (
        first.stop_reason == "tool_use" and call.type == "tool_use" and call.name == "get_weather"
    )
    assert call.input["city"] in ("Paris", "Rome", "Oslo") and call.id.startswith("toolu_")
    whole = client.messages.create(
        model="demo",
        max_tokens=60,
        tools=[WEATHER],
        tool_choice=forced,
        messages=ASK,
        extra_body=GREEDY,
    )
    assert whole.content[0].input == call.input
    history = ASK + [
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny"}],
        },
    ]
    after = client.messages.create(
        model="demo", max_tokens=8, tools=[WEATHER], messages=history, extra_body=GREEDY
    )
    # A random model writes no tool call of its own: the answer is text, cut at max_tokens or ended
    # by the model.
    assert [block.type for block in after.content] == ["text"]
    assert after.stop_reason == ("max_tokens" if after.usage.output_tokens == 8 else "end_turn")
    assert after.usage.cache_read_input_tokens >= first.usage.input_tokens // 16 * 16 > 0


def test_a_stop_sequence_ends_the_message(client: anthropic.Anthropic) -> None:
    made = client.messages.create(model="demo", max_tokens=40, messages=ASK, extra_body=GREEDY)
    text = made.content[0].text
    stop = next(ch for ch in text[3:] if ch.isascii() and ch.isprintable() and ch != " ")
    stopped = client.messages.create(
        model="demo", max_tokens=40, messages=ASK, stop_sequences=[stop], extra_body=GREEDY
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == text[: text.index(stop)]


def test_errors_have_anthropics_shape_and_x_api_key_is_the_key(server: ServerProcess) -> None:
    url = f"{server.url}/v1/messages"
    body = {"model": "demo", "max_tokens": 4, "messages": ASK}
    for headers in ({}, {"x-api-key": "wrong"}):
        resp = httpx.post(url, json=body, headers=headers, timeout=60)
        assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
    ok = httpx.post(url, json=body, headers={"x-api-key": KEY}, timeout=60)
    assert ok.status_code == 200 and ok.json()["type"] == "message"
    for bad, words in (
        ({"max_tokens": None}, "max_tokens"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, '"image"'),
        ({"thinking": {"type": "sometimes"}}, "thinking.type"),
        ({"tool_choice": {"type": "any"}}, "needs tools"),
    ):
        resp = httpx.post(url, json={**body, **bad}, headers={"x-api-key": KEY}, timeout=60)
        error = resp.json()
        assert resp.status_code == 400 and error["type"] == "error", error
        assert (
            error["error"]["type"] == "invalid_request_error" and words in error["error"]["message"]
        )
    with pytest.raises(anthropic.NotFoundError):
        anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0).messages.create(
            model="claude-none", max_tokens=4, messages=ASK
        )
