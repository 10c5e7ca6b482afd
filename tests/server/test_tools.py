"""Tool calling: request models, forced-call schemas, the per-family parsers whole and streamed, and
templates."""

from __future__ import annotations

import copy
import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import transformers
from jinja2.exceptions import TemplateError
from jsonschema import Draft202012Validator
from pydantic import TypeAdapter, ValidationError
from transformers import AutoTokenizer

from engine.demo import CHAT_TEMPLATE, write_byte_tokenizer
from engine.guided import GuidedDecoding, GuidedError
from engine.sampling_params import GuidedSpec
from server.tools import (
    NO_ARGUMENTS,
    PARSERS,
    ForcedCallStream,
    NamedToolChoice,
    Tool,
    ToolCall,
    ToolChoice,
    ToolParser,
    calls_from_forced,
    forced_tool_schema,
    merge_deltas,
    parser_for,
    template_format,
    template_messages,
)
from tests.chat_templates import PARSER_OF, TEMPLATES, write_template

# The demo template before tools, kept to prove the rendering without tools did not change.
OLD_DEMO_TEMPLATE = """\
{%- for message in messages -%}
{%- set role = 'system' if message['role'] == 'developer' else message['role'] -%}
{%- if role not in ['system', 'user', 'assistant'] -%}
{{- raise_exception('The demo model supports the roles system, user and assistant, not ' + role) -}}
{%- endif -%}
{%- if message['content'] is string -%}
{%- set content = message['content'] -%}
{%- else -%}
{%- set content = message['content'] | selectattr('type', 'equalto', 'text')
                                      | map(attribute='text') | join('\\n') -%}
{%- endif -%}
{{- '<|' + role + '|>\\n' + content + '<|end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|assistant|>\\n' -}}
{%- endif -%}
"""
CALL_ID = re.compile(r"call_[0-9a-f]{24}")
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
}
BOOK = {
    "type": "object",
    "properties": {"when": {"$ref": "#/$defs/date"}},
    "required": ["when"],
    "$defs": {"date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"}},
}
TOOLS = [
    Tool.model_validate({"type": "function", "function": spec})
    for spec in (
        {"name": "get_weather", "description": "Weather of a city", "parameters": WEATHER},
        {"name": "get_time"},
        {"name": "book", "parameters": BOOK},
    )
]

HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME_CALL = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
MISTRAL_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
PARIS = ("get_weather", {"city": "Paris"})
# (parser, output, content, [(name, arguments)])
CASES = [
    ("hermes", HERMES_CALL, None, [PARIS]),
    ("hermes", HERMES_CALL + "\n" + TIME_CALL, None, [PARIS, ("get_time", {})]),
    ("hermes", "Let me look.\n\n" + HERMES_CALL, "Let me look.", [PARIS]),
    (
        "hermes",
        "<think>\nweather\n</think>\n\n" + HERMES_CALL,
        "<think>\nweather\n</think>",
        [PARIS],
    ),
    (
        "hermes",
        "Paris is sunny, <tool> or <tool_c  \n",
        "Paris is sunny, <tool> or <tool_c  \n",
        [],
    ),
    (
        "hermes",
        'I will.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
        'I will.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
        [],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "get_time", "argu',
        '<tool_call>\n{"name": "get_time", "argu',
        [],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "get_time"}',
        None,
        [("get_time", {})],
    ),  # cut off before the closing tag
    (
        "hermes",
        HERMES_CALL + '\n<tool_call>\n{"name": oops}\n</tool_call>',
        '<tool_call>\n{"name": oops}\n</tool_call>',
        [PARIS],
    ),
    (
        "hermes",
        '<tool_call>{"name": "run", "arguments": '
        '{"src": "if (a) { b(\\"}\\"); } </tool_call>"}}</tool_call>',
        None,
        [("run", {"src": 'if (a) { b("}"); } </tool_call>'})],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "say", "arguments": {"text": "héllo 日本 🙂"}}\n</tool_call>',
        None,
        [("say", {"text": "héllo 日本 🙂"})],
    ),
    ("llama3_json", LLAMA_CALL, None, [PARIS]),
    ("llama3_json", "<|python_tag|>" + LLAMA_CALL, None, [PARIS]),
    (
        "llama3_json",
        " \n" + MISTRAL_CALL + '; {"name": "get_time", "parameters": {}}',
        None,
        [PARIS, ("get_time", {})],
    ),
    ("llama3_json", "The weather in Paris is nice.", "The weather in Paris is nice.", []),
    ("llama3_json", '{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    ("llama3_json", LLAMA_CALL[:-1], LLAMA_CALL[:-1], []),
    (
        "llama3_json",
        'Sure: {"name": "get_time", "parameters": {}}',
        'Sure: {"name": "get_time", "parameters": {}}',
        [],
    ),
    (
        "llama3_json",
        '{"name": "get_time", "parameters": {"x": NaN}}',
        '{"name": "get_time", "parameters": {"x": NaN}}',
        [],
    ),
    ("mistral", f"[TOOL_CALLS] [{MISTRAL_CALL}]", None, [PARIS]),
    (
        "mistral",
        f'[TOOL_CALLS] [{MISTRAL_CALL}, {{"name": "get_time", "arguments": {{}}}}]',
        None,
        [PARIS, ("get_time", {})],
    ),
    ("mistral", f"Checking. [TOOL_CALLS] [{MISTRAL_CALL}]", "Checking.", [PARIS]),
    ("mistral", f"[TOOL_CALLS] {MISTRAL_CALL}", None, [PARIS]),
    ("mistral", f"[TOOL_CALLS] [{MISTRAL_CALL}] \n and more", "and more", [PARIS]),
    ("mistral", "No [TOOLS] needed [TOOL_CALL", "No [TOOLS] needed [TOOL_CALL", []),
    ("mistral", f"[TOOL_CALLS] [{MISTRAL_CALL[:-1]}]", f"[TOOL_CALLS] [{MISTRAL_CALL[:-1]}]", []),
]


def summary(content: str | None, calls: list[ToolCall]) -> tuple[str | None, list[tuple[str, Any]]]:
    assert all(CALL_ID.fullmatch(call.id) for call in calls)
    return content, [(call.function.name, json.loads(call.function.arguments)) for call in calls]


def streamed(parser: ToolParser, pieces: list[str]) -> list[Any]:
    stream = parser.stream()
    items = [item for piece in pieces for item in stream.feed(piece)]
    return items + stream.finish()


def splits(text: str) -> list[list[str]]:
    """One character at a time, every cut in two, and random cuts."""
    rng = random.Random(len(text))
    cases = [list(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), rng.randint(1, 8))))
        cases.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return cases


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_parse_finds_the_calls_and_the_content(
    name: str, text: str, content: str | None, calls: list
) -> None:
    assert summary(*PARSERS[name].parse(text)) == (content, calls)


@pytest.mark.parametrize(("name", "text"), [(case[0], case[1]) for case in CASES])
def test_streaming_gives_what_parse_gives_on_every_split(name: str, text: str) -> None:
    parser = PARSERS[name]
    whole = summary(*parser.parse(text))
    for pieces in splits(text):
        content, calls = merge_deltas(streamed(parser, pieces))
        assert summary(content, calls) == whole, pieces
        # The exact argument text too, not only its meaning.
        assert [c.function.arguments for c in calls] == [
            c.function.arguments for c in parser.parse(text)[1]
        ]


def test_stream_items_have_openais_delta_shape() -> None:
    items = streamed(PARSERS["hermes"], list("Sure.\n" + HERMES_CALL + "\n" + TIME_CALL))
    assert items[0] == "S" and "".join(i for i in items if isinstance(i, str)) == "Sure."
    calls = [i for i in items if not isinstance(i, str)]
    assert [c["index"] for c in calls] == [0, 0, 1, 1]
    for header, arguments in (calls[:2], calls[2:]):
        assert set(header) == {"index", "id", "type", "function"} and CALL_ID.fullmatch(
            header["id"]
        )
        assert header["type"] == "function" and header["function"]["arguments"] == ""
        assert set(arguments) == {"index", "function"} and set(arguments["function"]) == {
            "arguments"
        }
    assert (
        calls[0]["function"]["name"] == "get_weather"
        and calls[1]["function"]["arguments"] == '{"city": "Paris"}'
    )


def test_content_is_held_back_only_while_it_may_start_a_marker() -> None:
    stream = PARSERS["hermes"].stream()
    assert stream.feed("Hello wor") == ["Hello wor"]
    assert stream.feed("ld <tool") == [
        "ld"
    ]  # " <tool" may begin a call, and trailing space before one is dropped
    assert stream.feed("box") == [" <toolbox"]
    assert stream.feed(' \n<tool_call>\n{"name": "get_time", ') == []
    items = stream.feed('"arguments": {}}')
    assert [i["function"] for i in items] == [
        {"name": "get_time", "arguments": ""},
        {"arguments": "{}"},
    ]
    assert stream.feed("\n</tool_call>") == [] and stream.finish() == []

    llama = PARSERS["llama3_json"].stream()
    assert llama.feed("  ") == [] and llama.feed("Sure") == ["  Sure"]
    mistral = PARSERS["mistral"].stream()
    assert mistral.feed("a [TOOL") == ["a"] and mistral.feed("S]") == [" [TOOLS]"]


def test_no_output_is_empty_content() -> None:
    for parser in PARSERS.values():
        assert parser.parse("") == ("", [])


def test_request_models_accept_openai_tools() -> None:
    assert TOOLS[0].function.parameters == WEATHER
    assert TOOLS[1].function.arguments_schema() == NO_ARGUMENTS
    untyped = Tool.model_validate(
        {"function": {"name": "f", "parameters": {"properties": {"x": {}}}}}
    )
    assert untyped.type == "function" and untyped.function.arguments_schema()["type"] == "object"
    choice = TypeAdapter(ToolChoice)
    assert choice.validate_python("required") == "required"
    named = choice.validate_python({"type": "function", "function": {"name": "get_time"}})
    assert isinstance(named, NamedToolChoice) and named.function.name == "get_time"
    with pytest.raises(ValidationError):
        choice.validate_python("sometimes")
    call = ToolCall.model_validate(
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    )
    assert call.model_dump() == {
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": '{"x": 1}'},
    }


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ({"name": "get weather"}, "1-64 characters"),
        ({"name": ""}, "1-64 characters"),
        ({"name": "x" * 65}, "1-64 characters"),
        (
            {"name": "bad", "parameters": ["city"]},
            "tool 'bad': parameters must be a JSON schema object",
        ),
        (
            {"name": "bad", "parameters": {"type": "strin"}},
            "tool 'bad': parameters is not a valid JSON schema",
        ),
        (
            {"name": "bad", "parameters": {"type": "object", "required": "city"}},
            "not a valid JSON schema",
        ),
        (
            {"name": "bad", "parameters": {"type": "string"}},
            'must describe an object ("type": "object"), not "string"',
        ),
    ],
)
def test_bad_function_definitions_are_refused_with_the_reason(function: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(message)):
        Tool.model_validate({"type": "function", "function": function})


def test_tool_call_arguments_must_be_json_text() -> None:
    with pytest.raises(ValidationError, match="arguments must be JSON text"):
        ToolCall.model_validate(
            {"id": "c", "function": {"name": "f", "arguments": "{city: Paris}"}}
        )


def valid(schema: dict, value: Any) -> bool:
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema).is_valid(value)


def test_named_choice_forces_that_functions_arguments() -> None:
    schema = forced_tool_schema(TOOLS, "get_weather", parallel=True)
    assert valid(schema, {"city": "Paris"}) and valid(schema, {"city": "Paris", "unit": "c"})
    assert not any(
        valid(schema, v) for v in ({"unit": "c"}, {"city": 3}, "Paris", [{"city": "Paris"}])
    )
    no_arguments = forced_tool_schema(TOOLS, "get_time", parallel=False)
    assert valid(no_arguments, {}) and not valid(no_arguments, [])
    booking = forced_tool_schema(TOOLS, "book", parallel=False)
    assert valid(booking, {"when": "2025-01-02"}) and not valid(booking, {"when": "tomorrow"})


def test_required_choice_forces_a_list_of_calls() -> None:
    one = forced_tool_schema(TOOLS, None, parallel=False)
    weather = {"name": "get_weather", "parameters": {"city": "Paris"}}
    assert valid(one, [weather]) and valid(
        one, [{"name": "book", "parameters": {"when": "2025-01-02"}}]
    )
    for wrong in (
        [],
        [weather, weather],
        [{"name": "nope", "parameters": {}}],
        [{"name": "get_weather"}],
        [{"name": "get_weather", "parameters": {}}],
        [{"name": "book", "parameters": {"when": "soon"}}],
        [{**weather, "extra": 1}],
        weather,
    ):
        assert not valid(one, wrong), wrong
    many = forced_tool_schema(TOOLS, None, parallel=True)
    assert valid(many, [weather, {"name": "get_time", "parameters": {}}, weather])
    assert TOOLS[2].function.parameters == BOOK, "the tools' schemas are not changed"


END_ID = 261  # the byte tokenizer's <|end|>


@pytest.fixture(scope="module")
def guided(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GuidedDecoding]:
    """The engine's structured outputs over the demo's byte tokenizer (token id b is byte b)."""
    folder = tmp_path_factory.mktemp("byte-tokenizer")
    write_byte_tokenizer(folder)
    decoding = GuidedDecoding(str(folder), 320, [END_ID])
    yield decoding
    decoding.close()


def grammar_takes(guided: GuidedDecoding, schema: dict, value: Any) -> bool:
    """Whether the grammar the engine builds for a forced call (the server sends the schema as a
    json_schema constraint) lets a model write json.dumps(value) whole and then stop."""
    request_id = f"forced-{json.dumps(schema)}-{json.dumps(value)}"
    try:
        spec = GuidedSpec("json_schema", json.dumps(schema))
        mask = guided.fill([(request_id, spec, list(json.dumps(value).encode()))])
    except GuidedError:  # a token left the grammar
        return False
    finally:
        guided.release(request_id)
    return bool(int(mask[0, END_ID // 32]) >> (END_ID % 32) & 1)


WEATHER_CALL = {"name": "get_weather", "parameters": {"city": "Paris"}}
BOOK_CALL = {"name": "book", "parameters": {"when": "2025-01-02"}}
# (choice, parallel, values the schema allows and the grammar must let through, values it refuses)
FORCED = [
    (
        "get_weather",
        False,
        [{"city": "Paris"}, {"city": "Paris", "unit": "c"}],
        [{"unit": "c"}, {"city": 3}, "Paris"],
    ),
    ("get_time", True, [{}], [[], "now"]),
    ("book", False, [{"when": "2025-01-02"}], [{"when": "tomorrow"}, {}]),
    (
        None,
        False,
        [[WEATHER_CALL], [BOOK_CALL]],
        [
            [],
            [WEATHER_CALL, WEATHER_CALL],
            [{"name": "nope", "parameters": {}}],
            [{"name": "book", "parameters": {"when": "soon"}}],
            WEATHER_CALL,
        ],
    ),
    (
        None,
        True,
        [[WEATHER_CALL], [WEATHER_CALL, {"name": "get_time", "parameters": {}}, BOOK_CALL]],
        [[], [{"name": "get_weather"}], [{**WEATHER_CALL, "extra": 1}]],
    ),
]


@pytest.mark.parametrize(
    ("choice", "parallel", "good", "bad"),
    FORCED,
    ids=["get_weather", "get_time-parallel", "book", "required", "required-parallel"],
)
def test_forced_schemas_compile_to_grammars(
    guided: GuidedDecoding, choice: str | None, parallel: bool, good: list, bad: list
) -> None:
    """A forced call's schema, $defs and patterns included, becomes a grammar that lets the model
    write a call the schema allows, whole and then the end, and no call it refuses."""
    schema = forced_tool_schema(TOOLS, choice, parallel)
    for value in good:
        assert valid(schema, value) and grammar_takes(guided, schema, value), value
    for value in bad:
        assert not valid(schema, value) and not grammar_takes(guided, schema, value), value


def test_forced_schema_errors_name_the_fix() -> None:
    with pytest.raises(
        ValueError, match="'get_news', which is not in tools .*'get_weather'.*add it to tools"
    ):
        forced_tool_schema(TOOLS, "get_news", parallel=True)
    with pytest.raises(ValueError, match="at least one function"):
        forced_tool_schema([], None, parallel=True)
    clash = Tool.model_validate(
        {
            "function": {
                "name": "other",
                "parameters": {
                    "type": "object",
                    "properties": {"d": {"$ref": "#/$defs/date"}},
                    "$defs": {"date": {"type": "integer"}},
                },
            }
        }
    )
    with pytest.raises(ValueError, match=r"\$defs/date differently"):
        forced_tool_schema([*TOOLS, clash], None, parallel=True)


def test_calls_from_forced_output() -> None:
    (call,) = calls_from_forced('{"city": "Zürich"}', TOOLS, "get_weather")
    assert call.function.name == "get_weather" and call.function.arguments == '{"city": "Zürich"}'
    calls = calls_from_forced(
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
        '{"name": "get_time", "parameters": {}}]',
        TOOLS,
        None,
    )
    assert summary(None, calls) == (None, [PARIS, ("get_time", {})])
    assert len({c.id for c in calls}) == 2
    for text, choice in (
        ('{"city": "Par', "get_weather"),
        ('[{"name": "get_weather", "parameters": {', None),
        ('[{"name": "nope", "parameters": {}}]', None),
    ):
        with pytest.raises(ValueError):
            calls_from_forced(text, TOOLS, choice)


def test_forced_call_stream_gives_the_calls_on_every_split() -> None:
    text = (
        '[{"name": "get_weather", "parameters": {"city": "Pa\\"ris}", "days": [1, {"a": "]"}]}}, '
        '{"parameters": {}, "name": "get_time"}]'
    )
    expected = [
        (c.function.name, json.loads(c.function.arguments))
        for c in calls_from_forced(text, TOOLS, None)
    ]
    for cut in range(len(text) + 1):
        for second in (cut, min(len(text), cut + 3)):
            stream = ForcedCallStream()
            items = (
                stream.feed(text[:cut]) + stream.feed(text[cut:second]) + stream.feed(text[second:])
            )
            content, calls = merge_deltas(items)
            assert (
                content is None
                and [(c.function.name, json.loads(c.function.arguments)) for c in calls] == expected
            )
    stream = ForcedCallStream()
    assert stream.feed('[{"name": "get_wea') == []
    header, first = stream.feed('ther", "parameters": {"ci')
    assert header["function"] == {"name": "get_weather", "arguments": ""} and header[
        "id"
    ].startswith("call_")
    assert first == {"index": 0, "function": {"arguments": '{"ci'}}
    assert stream.feed('ty": "Rome"}}]') == [
        {"index": 0, "function": {"arguments": 'ty": "Rome"}'}}
    ]


@pytest.mark.parametrize("family", TEMPLATES)
def test_parser_for_reads_the_format_off_the_template(family: str) -> None:
    assert parser_for("auto", TEMPLATES[family]) is PARSERS[PARSER_OF[family]]


def test_parser_for_names_and_templates_without_tools() -> None:
    """auto on a template that shows no tool format reads Hermes's (an agent's later turns send
    auto)."""
    assert parser_for("auto", CHAT_TEMPLATE) is PARSERS["hermes"]
    assert template_format(OLD_DEMO_TEMPLATE) is None and template_format(None) is None
    assert parser_for("auto", OLD_DEMO_TEMPLATE) is parser_for("auto", None) is PARSERS["hermes"]
    assert (
        parser_for("mistral", None) is PARSERS["mistral"]
        and parser_for("none", CHAT_TEMPLATE) is None
    )
    with pytest.raises(ValueError, match="use one of auto, none, hermes, llama3_json, mistral"):
        parser_for("pythonic", None)


def test_template_messages_prepare_openai_messages() -> None:
    messages = [
        {"role": "developer", "content": "Be brief.", "name": None},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Paris?"}],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "name": "get_weather",
            "content": '{"temp": 21}',
        },
        {"role": "assistant", "content": "Sunny, 21.", "tool_calls": None},
    ]
    before = copy.deepcopy(messages)
    assert template_messages(messages) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather\nin Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "name": "get_weather",
            "content": '{"temp": 21}',
        },
        {"role": "assistant", "content": "Sunny, 21."},
    ]
    assert messages == before
    bad = [
        {
            "role": "assistant",
            "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{oops"}}],
        }
    ]
    with pytest.raises(
        ValueError, match=re.escape("messages[0].tool_calls[0].function.arguments is not JSON")
    ):
        template_messages(bad)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> transformers.PreTrainedTokenizerBase:
    folder = tmp_path_factory.mktemp("byte-tokenizer")
    write_byte_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def render(
    tokenizer: transformers.PreTrainedTokenizerBase,
    template: str,
    messages: list[dict],
    **kwargs: Any,
) -> str:
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)


QWEN_STYLE = [
    "<tool_call>\n" + json.dumps({"name": n, "arguments": a}) + "\n</tool_call>"
    for n, a in (PARIS, ("get_time", {}))
]
OUTPUTS = {  # (family, the model's turn-1 output as it writes it)
    "llama3.1": [LLAMA_CALL],
    "qwen2.5": [QWEN_STYLE[0], "Let me check.\n" + QWEN_STYLE[0] + "\n" + QWEN_STYLE[1]],
    "mistral-v0.3": [f'[TOOL_CALLS] [{MISTRAL_CALL}, {{"name": "get_time", "arguments": {{}}}}]'],
    "demo": [QWEN_STYLE[0], "Let me check.\n" + QWEN_STYLE[0] + "\n" + QWEN_STYLE[1]],
}


@pytest.mark.parametrize(
    ("family", "output"), [(f, o) for f, outputs in OUTPUTS.items() for o in outputs]
)
def test_turn_two_prompt_extends_turn_one_prompt_and_output(
    tokenizer: transformers.PreTrainedTokenizerBase, family: str, output: str
) -> None:
    template = CHAT_TEMPLATE if family == "demo" else TEMPLATES[family]
    tools = [tool.model_dump(exclude_none=True) for tool in TOOLS]
    # Mistral puts the system message in the last user turn, which moves in turn 2: no system
    # message there.
    turn_1 = [] if family == "mistral-v0.3" else [{"role": "system", "content": "Be brief."}]
    turn_1 += [{"role": "user", "content": "Weather in Paris?"}]
    prompt_1 = render(
        tokenizer, template, template_messages(turn_1), tools=tools, add_generation_prompt=True
    )
    content, calls = parser_for("auto", template).parse(output)
    assert calls, "the output is read as calls"
    turn_2 = turn_1 + [
        {"role": "assistant", "content": content, "tool_calls": [c.model_dump() for c in calls]}
    ]
    turn_2 += [
        {"role": "tool", "tool_call_id": c.id, "name": c.function.name, "content": "result 7"}
        for c in calls
    ]
    prompt_2 = render(
        tokenizer, template, template_messages(turn_2), tools=tools, add_generation_prompt=True
    )
    assert prompt_2.startswith(prompt_1 + output)
    assert prompt_2.count("result 7") == len(calls)


def test_write_template_replaces_the_tokenizers_template(tmp_path: Path) -> None:
    write_byte_tokenizer(tmp_path)
    write_template(tmp_path, "mistral-v0.3")
    assert (
        AutoTokenizer.from_pretrained(tmp_path, local_files_only=True).chat_template
        == TEMPLATES["mistral-v0.3"]
    )


DEMO_CONVERSATIONS = [
    [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}],
        },
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ],
    [{"role": "developer", "content": "x"}],
    [
        {"role": "user", "content": ""},
        {"role": "assistant", "content": [{"type": "text", "text": "a"}]},
    ],
    [
        {"role": "user", "content": "q", "name": "bob"},
        {"role": "assistant", "content": "a", "tool_calls": None},
    ],
]


@pytest.mark.parametrize("messages", DEMO_CONVERSATIONS)
@pytest.mark.parametrize("tools", [None, []])
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_demo_template_without_tools_renders_as_before(
    tokenizer: transformers.PreTrainedTokenizerBase,
    messages: list,
    tools: list | None,
    generation_prompt: bool,
) -> None:
    expected = render(
        tokenizer, OLD_DEMO_TEMPLATE, messages, add_generation_prompt=generation_prompt
    )
    assert (
        render(
            tokenizer, CHAT_TEMPLATE, messages, tools=tools, add_generation_prompt=generation_prompt
        )
        == expected
    )


def test_demo_template_renders_tools_as_qwen_does(
    tokenizer: transformers.PreTrainedTokenizerBase,
) -> None:
    tool = {"type": "function", "function": {"name": "get_time", "parameters": NO_ARGUMENTS}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Time?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": {}}},
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": "{}"},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "noon"},
        {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
    ]
    assert render(tokenizer, CHAT_TEMPLATE, messages, tools=[tool], add_generation_prompt=True) == (
        "<|system|>\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the "
        "user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(tool)
        + "\n</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|end|>\n'
        "<|user|>\nTime?<|end|>\n"
        '<|assistant|>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
        '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|end|>\n'
        "<|user|>\n<tool_response>\nnoon\n</tool_response>\n<tool_response>\n12:00\n</tool_response><|end|>\n"
        "<|assistant|>\n"
    )
    with pytest.raises(TemplateError, match="roles system, user, assistant and tool, not function"):
        render(tokenizer, CHAT_TEMPLATE, [{"role": "function", "content": "x"}])
