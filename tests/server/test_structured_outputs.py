"""Structured outputs and tool calls through the whole server with the openai client, on the demo
model (random weights): every mode's output parses and validates, 20 seeds each; tool calls
round-trip, and the turn after a tool result reuses the cached prefix."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server_process import ServerProcess

SEEDS = range(20)
MAX_TOKENS = 400
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad", "calm"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "mood", "tags"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(BaseModel):
    mood: Literal["happy", "sad", "calm"]
    age: int = Field(ge=0, le=120)
    nick: str = Field(max_length=6)


@pytest.fixture(scope="module")
def server(start_server) -> ServerProcess:
    return start_server("--max-num-seqs", "32")


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)


def chat_many(client: openai.OpenAI, **kw) -> list:
    """One request per seed, all at once (the server batches them); the choices."""

    def one(seed: int):
        return client.chat.completions.create(
            model="demo", messages=MESSAGES, seed=seed, **{"max_tokens": MAX_TOKENS, **kw}
        ).choices[0]

    with ThreadPoolExecutor(len(SEEDS)) as pool:
        return list(pool.map(one, SEEDS))


def finished_texts(choices: list) -> list[str]:
    assert all(c.finish_reason == "stop" for c in choices), [c.finish_reason for c in choices]
    return [c.message.content for c in choices]


def test_json_schema_response_format(client) -> None:
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
    }
    for text in finished_texts(chat_many(client, response_format=fmt)):
        jsonschema.validate(json.loads(text), SCHEMA)


def test_parse_helper_of_the_openai_client(client) -> None:
    # The client's documented structured-output example: a pydantic model as the response format.
    done = client.chat.completions.parse(
        model="demo", messages=MESSAGES, response_format=Person, seed=1, max_tokens=MAX_TOKENS
    )
    assert isinstance(done.choices[0].message.parsed, Person)


def test_json_object_response_format(client) -> None:
    # Any object at all: a random model writes keys of random length, and most run past max_tokens;
    # the ones that end are objects, and the rest are on their way to one.
    choices = chat_many(client, response_format={"type": "json_object"})
    finished = [c.message.content for c in choices if c.finish_reason == "stop"]
    assert finished and all(isinstance(json.loads(text), dict) for text in finished)
    assert all(c.message.content.startswith("{") for c in choices)


@pytest.mark.parametrize(
    "extra, check",
    [
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
        (
            {"guided_regex": r"[a-z]{2,6}@(ppd|vllm)\.(org|dev)"},
            lambda t: re.fullmatch(r"[a-z]{2,6}@(ppd|vllm)\.(org|dev)", t) or pytest.fail(t),
        ),
        (
            {"guided_choice": ["yes", "no", 'it "depends"']},
            lambda t: t in ("yes", "no", 'it "depends"') or pytest.fail(t),
        ),
        (
            {"guided_grammar": 'root ::= digit+ (" + " digit+){0,3}\ndigit ::= [0-9]'},
            lambda t: re.fullmatch(r"[0-9]+( \+ [0-9]+){0,3}", t) or pytest.fail(t),
        ),
        (
            {"structured_outputs": {"choice": ["red", "green"]}},
            lambda t: t in ("red", "green") or pytest.fail(t),
        ),
    ],
)
def test_vllm_guided_fields(client, extra, check) -> None:
    for text in finished_texts(chat_many(client, extra_body=extra)):
        check(text)


def test_completions_take_structured_outputs_too(client) -> None:
    done = client.completions.create(
        model="demo",
        prompt="Pick: ",
        max_tokens=20,
        seed=3,
        extra_body={"guided_choice": ["left", "right"]},
    )
    assert done.choices[0].text in ("left", "right")


@pytest.mark.parametrize(
    "extra, words",
    [
        (
            {"guided_json": {"type": "object", "properties": {"a": {"type": "strin"}}}},
            "guided_json: ",
        ),
        ({"guided_regex": "(?=a)b"}, "guided_regex: "),
        ({"guided_choice": []}, "guided_choice: "),
        ({"guided_grammar": "root ::= "}, "guided_grammar: "),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "both constrain"),
        ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos cannot be combined"),
    ],
)
def test_specs_the_library_cannot_build_are_400_naming_the_field(client, extra, words) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="demo", messages=MESSAGES, max_tokens=5, extra_body=extra
        )
    assert words in info.value.body["message"]


def test_required_tool_choice_gives_valid_calls(client) -> None:
    choices = chat_many(
        client, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False
    )
    for c in choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        (call,) = c.message.tool_calls
        schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"][
            "parameters"
        ]
        jsonschema.validate(json.loads(call.function.arguments), schema)
        assert call.id.startswith("call_") and call.type == "function"


def test_required_tool_calls_stream_their_arguments_as_generated(client) -> None:
    """Each call's header (id, name) comes once, then its arguments in several chunks before the
    last one; they add up to the calls the same request gives unstreamed."""
    kwargs = dict(
        model="demo",
        messages=MESSAGES,
        tools=[WEATHER, TIME],
        tool_choice="required",
        seed=7,
        max_tokens=MAX_TOKENS,
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    chunks = [
        chunk for chunk in client.chat.completions.create(**kwargs, stream=True) if chunk.choices
    ]
    calls: dict[int, dict] = {}
    argument_chunks = 0
    for chunk in chunks:
        for piece in chunk.choices[0].delta.tool_calls or []:
            if piece.id is not None:
                assert piece.index not in calls, "one header per call"
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
            calls[piece.index]["arguments"] += piece.function.arguments or ""
            argument_chunks += bool(piece.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert argument_chunks > len(calls), "the arguments came in pieces, not whole in the last chunk"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole
    ]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_named_tool_choice_then_the_result_in_the_next_turn_reuses_the_prefix(client) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(
        model="demo",
        messages=MESSAGES,
        tools=[WEATHER, TIME],
        tool_choice=named,
        seed=4,
        max_tokens=MAX_TOKENS,
    )
    (call,) = first.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    history = MESSAGES + [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 21})},
    ]
    second = client.chat.completions.create(
        model="demo",
        messages=history,
        tools=[WEATHER, TIME],
        seed=4,
        max_tokens=8,
        extra_body={"ignore_eos": True},
    )
    # The tool's result is taken as history and answered: a random model writes no call of its own,
    # so text to the end.
    assert second.choices[0].finish_reason == "length" and second.usage.completion_tokens == 8
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= (first.usage.prompt_tokens // 16) * 16, (cached, first.usage.prompt_tokens)


def test_auto_tool_calls_are_read_from_the_models_format_streamed_and_not(client) -> None:
    # A random model never writes a call by itself: a regex makes it write the demo template's
    # (Hermes) format.
    call = (
        r'<tool_call>\n\{"name": "get_weather", '
        r'"arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}\n</tool_call>'
    )
    extra = {"guided_regex": "Sure[.!]\n" + call}
    done = client.chat.completions.create(
        model="demo", messages=MESSAGES, tools=[WEATHER], seed=5, max_tokens=200, extra_body=extra
    )
    message = done.choices[0].message
    assert done.choices[0].finish_reason == "tool_calls" and message.content in ("Sure.", "Sure!")
    (whole,) = message.tool_calls
    args = json.loads(whole.function.arguments)
    stream = client.chat.completions.create(
        model="demo",
        messages=MESSAGES,
        tools=[WEATHER],
        seed=5,
        max_tokens=200,
        extra_body=extra,
        stream=True,
    )
    content, calls, finish = "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            entry = calls.setdefault(piece.index, {"name": None, "arguments": ""})
            if piece.function.name:
                entry["name"] = piece.function.name
            entry["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == message.content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", args)
    ]


def test_named_tool_call_streams_its_arguments(client) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    stream = client.chat.completions.create(
        model="demo",
        messages=MESSAGES,
        tools=[WEATHER, TIME],
        tool_choice=named,
        seed=6,
        max_tokens=MAX_TOKENS,
        stream=True,
    )
    pieces = [
        p for chunk in stream for p in (chunk.choices[0].delta.tool_calls or []) if chunk.choices
    ]
    assert pieces[0].id and pieces[0].function.name == "get_time"
    jsonschema.validate(
        json.loads("".join(p.function.arguments or "" for p in pieces)),
        TIME["function"]["parameters"],
    )


# Each family's call format, as a regex a random model is made to write (the markers are text to the
# byte tokenizer).
FAMILY_CALLS = {
    "qwen2.5": (
        r'<tool_call>\n\{"name": "get_weather", '
        r'"arguments": \{"city": "Rome", "days": [1-7]\}\}\n</tool_call>'
    ),
    "llama3.1": r'\{"name": "get_weather", "parameters": \{"city": "Rome", "days": [1-7]\}\}',
    "mistral-v0.3": r"\[TOOL_CALLS\] "
    r'\[\{"name": "get_weather", "arguments": \{"city": "Rome", "days": [1-7]\}\}\]',
}


@pytest.mark.slow  # over 10 s on 2 cores: the second suite keeps the default one under its budget
@pytest.mark.parametrize("family", sorted(FAMILY_CALLS))
def test_each_familys_template_renders_tools_and_its_calls_round_trip(
    family, start_server, tmp_path_factory
) -> None:
    from engine.demo import write_byte_tokenizer
    from tests.chat_templates import write_template
    from tests.tiny_models import write_tiny_model

    folder = write_tiny_model(
        tmp_path_factory.mktemp(family), "llama", max_position_embeddings=2048
    )  # tools: long prompts
    write_byte_tokenizer(folder)
    write_template(folder, family)
    server = start_server("--model", str(folder), "--served-model-name", "tiny")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    first = client.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=[WEATHER],
        max_tokens=120,
        seed=0,
        extra_body={"guided_regex": FAMILY_CALLS[family]},
    )
    assert first.choices[0].finish_reason == "tool_calls", first
    (call,) = first.choices[0].message.tool_calls
    assert (
        call.function.name == "get_weather"
        and json.loads(call.function.arguments)["city"] == "Rome"
    )
    history = messages + [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'},
    ]
    second = client.chat.completions.create(
        model="tiny", messages=history, tools=[WEATHER], max_tokens=4, seed=0
    )
    cached = second.usage.prompt_tokens_details.cached_tokens
    # The template writes the call back as the model wrote it: turn 1's prompt and answer are
    # cached, whole blocks.
    assert (
        cached >= (first.usage.prompt_tokens + first.usage.completion_tokens - 16) // 16 * 16 > 0
    ), cached
