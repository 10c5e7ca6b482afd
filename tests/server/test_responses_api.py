"""OpenAI's Responses API through the real clients (the openai SDK's responses.create, the
openai-agents SDK) against `ppd serve` with the demo model (random weights): plain and streamed
answers agree, stored conversations reuse every earlier token's KV on both prefill routes, a
Responses turn equals chat completions on the same conversation, forced function calls round-trip,
and what is not served is a 400 naming the field."""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Literal

import httpx
import openai
import pytest

from tests.server_process import ServerProcess

BLOCK = 16
GREEDY = {"temperature": 0, "max_output_tokens": 12}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
# Output forced to plain ASCII words: text whose tokens round-trip, so a chat client's text history
# is the same ids.
WORDS = {
    "format": {
        "type": "json_schema",
        "name": "words",
        "schema": {
            "type": "object",
            "properties": {"w": {"type": "string", "pattern": "^[a-z]{1,8}$"}},
            "required": ["w"],
            "additionalProperties": False,
        },
    }
}


@pytest.fixture(scope="module")
def server(start_server) -> ServerProcess:
    return start_server(
        "--policy", "ppd"
    )  # a prefill and a decode worker: both routes can be asked for


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_plain_and_streamed_answers_agree_and_events_come_in_order(client: openai.OpenAI) -> None:
    plain = client.responses.create(model="demo", input="Tell me a story.", **GREEDY)
    assert plain.status == "incomplete" and plain.incomplete_details.reason == "max_output_tokens"
    (message,) = plain.output
    assert (
        message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    )
    assert plain.usage.output_tokens == 12 and plain.usage.input_tokens > 0
    events = list(
        client.responses.create(model="demo", input="Tell me a story.", stream=True, **GREEDY)
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(kinds[4:-4]) <= {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-1].response
    assert deltas == done.output_text == plain.output_text
    assert events[0].response.status == "in_progress" and events[0].response.id == done.id


@pytest.mark.parametrize("route", ["prefill", "decode"])
def test_three_stored_turns_cache_every_earlier_token(client: openai.OpenAI, route: str) -> None:
    """Each turn's cached tokens are all the tokens before it (the previous prompt and answer, the
    answer's last token aside: it was never run through the model) in whole blocks, whichever worker
    ran the append."""
    previous, earlier = None, 0
    for turn in range(3):
        raw = client.responses.with_raw_response.create(
            model="demo",
            input=f"Turn {turn} of our talk.",
            instructions=f"{route}: answer briefly.",
            previous_response_id=previous,
            extra_headers={"x-ppd-route": route},
            **GREEDY,
        )
        resp = raw.parse()
        if turn == 0:
            assert resp.usage.input_tokens_details.cached_tokens == 0
        else:
            assert raw.headers["x-ppd-history"] == "token-ids"
            assert raw.headers["x-ppd-route"] == route
            assert resp.usage.input_tokens_details.cached_tokens == (earlier - 1) // BLOCK * BLOCK
        previous, earlier = resp.id, resp.usage.input_tokens + resp.usage.output_tokens


def test_a_responses_turn_equals_chat_completions_on_the_same_conversation(
    client: openai.OpenAI,
) -> None:
    chat = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "A colour?"},
    ]
    first = client.responses.create(
        model="demo",
        instructions=chat[0]["content"],
        input=chat[1]["content"],
        text=WORDS,
        temperature=0,
        max_output_tokens=40,
    )
    same = client.chat.completions.create(
        model="demo",
        messages=chat,
        temperature=0,
        max_tokens=40,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "words", "schema": WORDS["format"]["schema"]},
        },
    )
    assert first.status == "completed" and first.output_text == same.choices[0].message.content
    json.loads(first.output_text)
    # Turn 2 continues the stored token ids; chat completions re-tokenizes the text history: the
    # same ids (the answer is plain text), so the same greedy answer.
    raw = client.responses.with_raw_response.create(
        model="demo",
        instructions=chat[0]["content"],
        input="Another?",
        previous_response_id=first.id,
        temperature=0,
        max_output_tokens=24,
    )
    second = raw.parse()
    assert raw.headers["x-ppd-history"] == "token-ids"
    chat += [
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Another?"},
    ]
    again = client.chat.completions.create(
        model="demo", messages=chat, temperature=0, max_tokens=24
    )
    assert second.output_text == again.choices[0].message.content
    assert second.usage.input_tokens == again.usage.prompt_tokens


def test_forced_function_call_streams_its_arguments_and_its_output_goes_back(
    client: openai.OpenAI,
) -> None:
    forced = {"type": "function", "name": "get_weather"}
    events = list(
        client.responses.create(
            model="demo",
            input="Weather in Paris?",
            tools=[WEATHER],
            tool_choice=forced,
            temperature=0,
            max_output_tokens=60,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert kinds.count("response.function_call_arguments.delta") > 1, (
        "the arguments stream as they are generated"
    )
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert (
        "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        == done.arguments
    )
    resp = events[-1].response
    assert events[-1].type == "response.completed"
    (call,) = resp.output
    assert (
        call.type == "function_call"
        and call.name == "get_weather"
        and call.call_id.startswith("call_")
    )
    assert call.arguments == done.arguments and set(json.loads(call.arguments)) == {"city"}
    raw = client.responses.with_raw_response.create(
        model="demo",
        previous_response_id=resp.id,
        tools=[WEATHER],
        temperature=0,
        max_output_tokens=8,
        input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"celsius": 21}'}
        ],
    )
    after = raw.parse()
    assert after.output[0].type == "message" and raw.headers["x-ppd-history"] == "token-ids"
    # The call's turn is re-rendered the template's way (a hermes <tool_call>), the prompt before it
    # is kept.
    assert (
        after.usage.input_tokens_details.cached_tokens
        >= resp.usage.input_tokens // BLOCK * BLOCK
        > 0
    )


@pytest.mark.parametrize(
    ("choice", "tokens"), [({"type": "function", "name": "get_weather"}, 6), ("required", 48)]
)
def test_a_forced_call_cut_by_max_output_tokens_stays_a_function_call(
    client: openai.OpenAI, choice, tokens
) -> None:
    """What agents expect: the call item, status incomplete, its arguments as far as they were
    generated; not a message holding partial JSON (required: cut once the call's name is out, the
    demo's tokens being bytes)."""
    resp = client.responses.create(
        model="demo",
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice=choice,
        temperature=0,
        max_output_tokens=tokens,
    )
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    (call,) = resp.output
    assert (
        call.type == "function_call" and call.status == "incomplete" and call.name == "get_weather"
    )
    assert call.arguments and not call.arguments.endswith("}")  # cut: not yet valid JSON


def test_stored_responses_are_read_deleted_and_missing_ones_are_404(client: openai.OpenAI) -> None:
    resp = client.responses.create(model="demo", input="Keep this.", metadata={"k": "v"}, **GREEDY)
    got = client.responses.retrieve(resp.id)
    assert got.id == resp.id and got.output_text == resp.output_text and got.metadata == {"k": "v"}
    client.responses.delete(resp.id)
    for call in (
        lambda: client.responses.retrieve(resp.id),
        lambda: client.responses.delete(resp.id),
        lambda: client.responses.create(model="demo", input="Go on.", previous_response_id=resp.id),
    ):
        with pytest.raises(openai.NotFoundError, match=resp.id):
            call()
    unstored = client.responses.create(model="demo", input="Forget this.", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError, match=unstored.id):
        client.responses.create(model="demo", input="Go on.", previous_response_id=unstored.id)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tool_choice": {"type": "web_search"}, "tools": [WEATHER]}, "tool_choice"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"input": []}, "input"),
        ({"tool_choice": "required"}, "tool_choice"),  # without tools
        (
            {
                "input": [
                    {"type": "function_call_output", "call_id": "c", "output": "x"},
                    {"role": "assistant", "content": "a"},
                ],
                "max_output_tokens": 0,
            },
            "max_output_tokens",
        ),
    ],
)
def test_what_is_not_served_is_a_400_naming_the_field(
    server: ServerProcess, extra: dict, param: str
) -> None:
    body = {"model": "demo", "input": "Hi", **extra}
    resp = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_openai_agents_sdk_runs_a_three_turn_agent_with_a_function_tool(
    server: ServerProcess,
) -> None:
    import agents
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool
    from pydantic import BaseModel, Field

    class Answer(
        BaseModel
    ):  # a structured final answer: the demo's random text would not end by itself
        word: str = Field(pattern="^[a-z]{1,8}$")

    calls: list[str] = []

    @function_tool
    def get_weather(
        city: Literal["Paris", "Rome", "Oslo"],
    ) -> str:  # a short choice: random text ends soon
        """The weather in a city."""
        calls.append(city)
        return f"Sunny in {city}."

    async def converse() -> list:
        client = openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300
        )
        agent = Agent(
            name="weather",
            instructions="Use the tool.",
            tools=[get_weather],
            output_type=Answer,
            model=OpenAIResponsesModel("demo", client),
            # The demo's text is random: the call is forced, then reset so that the agent answers.
            model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=64),
        )
        results, previous = [], None
        for question in ("Weather in Paris?", "And Rome?", "And Oslo?"):
            result = await Runner.run(agent, question, previous_response_id=previous, max_turns=4)
            results.append(result)
            previous = result.last_response_id
        return results

    agents.set_tracing_disabled(True)
    results = asyncio.run(converse())
    assert len(calls) == 3  # one forced call per turn, run by the SDK, its output sent back
    for result in results:
        kinds = [item.type for item in result.new_items]
        assert (
            kinds[:2] == ["tool_call_item", "tool_call_output_item"]
            and kinds[-1] == "message_output_item"
        )
        assert isinstance(result.final_output, Answer)
    # Each turn continued the previous one's stored response: its whole history was cached.
    last_usage = results[-1].raw_responses[0].usage
    assert last_usage.input_tokens_details.cached_tokens > 0


def test_the_load_generator_runs_stored_conversations(server: ServerProcess) -> None:
    """`ppd bench --api responses`: each later turn sends only its new message after the previous
    response's id; the records carry the first-token time, the usage and the cache hits of every
    earlier token."""
    from bench.client import Conversation, LoadConfig, Turn, run_load

    conversations = [
        Conversation(
            f"c{i}",
            [Turn(f"Question {j} of talk {i}.", 6) for j in range(3)],
            system="Answer.",
            ignore_eos=True,
        )
        for i in range(2)
    ]
    cfg = LoadConfig(base_url=server.url, model="demo", api="responses", concurrency=2, duration=3)
    records = asyncio.run(run_load(cfg, conversations, progress=False))
    records = sorted(
        (r for r in records if r.conversation in ("c0", "c1")),
        key=lambda r: (r.conversation, r.turn),
    )
    assert [(r.conversation, r.turn) for r in records] == [
        (c, t) for c in ("c0", "c1") for t in range(3)
    ]
    for r in records:
        assert r.success and r.ttft is not None and 0 < r.ttft <= r.latency and r.output_tokens == 6
    for before, after in zip(records, records[1:]):
        if after.turn:
            assert (
                after.cached_tokens
                == (before.prompt_tokens + before.output_tokens - 1) // BLOCK * BLOCK
            )


@pytest.mark.slow  # two more server starts: the second suite
def test_a_store_file_survives_a_restart(start_server, tmp_path) -> None:
    """--response-store PATH: a conversation stored before a restart goes on after it, from its kept
    token ids."""
    path = str(tmp_path / "responses.sqlite")
    first_server = start_server("--response-store", path)
    before = openai.OpenAI(base_url=f"{first_server.url}/v1", api_key="unused", max_retries=0)
    first = before.responses.create(model="demo", input="Remember this.", **GREEDY)
    assert first_server.stop() in (
        0,
        -signal.SIGTERM,
    )  # uvicorn re-raises the signal after a graceful stop
    after = openai.OpenAI(
        base_url=f"{start_server('--response-store', path).url}/v1", api_key="unused", max_retries=0
    )
    assert after.responses.retrieve(first.id).output_text == first.output_text
    raw = after.responses.with_raw_response.create(
        model="demo", input="Go on.", previous_response_id=first.id, **GREEDY
    )
    assert raw.headers["x-ppd-history"] == "token-ids"
    assert raw.parse().usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_a_streamed_error_quoting_a_lone_surrogate_is_still_sent() -> None:
    """An error event may quote the client's input, which JSON lets hold a lone surrogate that UTF-8
    cannot: it is escaped, and the event goes out (it had been lost, and the stream cut after the
    last delta)."""
    from server.responses_api import ResponseRun

    run = ResponseRun.__new__(ResponseRun)  # only the event numbering matters to an error event
    run.seq = 3
    (event,) = run.error(400, "no tool named 'f\ud800'")
    data = json.loads(event.decode("utf-8").split("data: ", 1)[1])
    assert (data["type"], data["code"], data["sequence_number"]) == ("error", "400", 3)
    assert data["message"] == "no tool named 'f\\ud800'"
