"""OpenAI tool calling: the request models, the schemas that force a call, and per-family parsers of
calls in text.

tool_choice "required" or a named function is enforced by structured outputs: the output must match
forced_tool_schema, and calls_from_forced turns it into calls. tool_choice "auto" lets the model
write calls in its own format, which a ToolParser finds in the generated text (decoded with special
tokens kept). A parser reads text whole (parse) or in pieces (stream); parse is the stream fed the
whole text, and the stream's state machine decides nothing before the text that decides it has
arrived, so every split of a text gives the same content and calls.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for
from pydantic import BaseModel, ValidationInfo, field_validator

NO_ARGUMENTS: dict[str, Any] = {
    "type": "object",
    "properties": {},
}  # the schema of a function without parameters
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


class FunctionDefinition(BaseModel):
    """A function the model may call. parameters: the JSON schema of its arguments object (None: no
    arguments)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        if not _NAME.fullmatch(name):
            raise ValueError(
                f"function name {name!r} must be 1-64 characters of a-z, A-Z, 0-9, '_' and '-'"
            )
        return name

    @field_validator("parameters", mode="before")
    @classmethod
    def _check_parameters(cls, schema: Any, info: ValidationInfo) -> Any:
        name = info.data.get("name", "?")
        if schema is None:
            return None
        if not isinstance(schema, dict):
            raise ValueError(
                f"tool {name!r}: parameters must be a JSON schema object such as "
                f'{{"type": "object", "properties": {{...}}}}, not a {type(schema).__name__}'
            )
        try:
            validator_for(schema).check_schema(schema)
        except SchemaError as exc:
            raise ValueError(
                f"tool {name!r}: parameters is not a valid JSON schema: {exc.message} "
                f"(at {exc.json_path})"
            ) from None
        if schema.get("type", "object") != "object":
            # The arguments are sent as a JSON object (OpenAI refuses other types the same way).
            raise ValueError(
                f'tool {name!r}: parameters must describe an object ("type": "object"), '
                f"not {json.dumps(schema['type'])}"
            )
        return schema

    def arguments_schema(self) -> dict[str, Any]:
        """The schema an arguments object must match; an untyped schema is made an object schema."""
        return (
            {"type": "object", **self.parameters}
            if self.parameters is not None
            else dict(NO_ARGUMENTS)
        )


class Tool(BaseModel):
    """One entry of a request's `tools`."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    """The function a NamedToolChoice names."""

    name: str


class NamedToolChoice(BaseModel):
    """tool_choice {"type": "function", "function": {"name": ...}}: the model must call that
    function."""

    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolCallFunction(BaseModel):
    """A call's function; arguments is JSON text, as OpenAI sends it."""

    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _check_arguments(cls, arguments: str) -> str:
        try:
            json.loads(arguments)
        except ValueError as exc:
            raise ValueError(
                f'arguments must be JSON text such as "{{\\"city\\": \\"Paris\\"}}" ({exc})'
            ) from None
        return arguments


class ToolCall(BaseModel):
    """A tool call, in an assistant message of a request or of a response."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


def new_call_id() -> str:
    """A fresh tool call id, shaped as OpenAI's: "call_" and 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


def _new_call(name: str, arguments: dict[str, Any]) -> ToolCall:
    text = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=new_call_id(), function=ToolCallFunction(name=name, arguments=text))


def _find(tools: list[Tool], name: str) -> FunctionDefinition:
    for tool in tools:
        if tool.function.name == name:
            return tool.function
    names = ", ".join(repr(t.function.name) for t in tools) or "none"
    raise ValueError(
        f"tool_choice names the function {name!r}, which is not in tools (they are: {names}); "
        "add it to tools or name one of those"
    )


def forced_tool_schema(tools: list[Tool], choice: str | None, parallel: bool) -> dict[str, Any]:
    """The JSON schema the output must match when a call is forced. choice: a function name (the
    output is that function's arguments object, as vLLM does) or None for "required" (the output
    is a list of {"name", "parameters"} objects, one at most unless parallel). Raises ValueError,
    for the client, on a bad choice."""
    if choice is not None:
        return copy.deepcopy(_find(tools, choice).arguments_schema())
    if not tools:
        raise ValueError('tool_choice "required" needs at least one function in tools')
    variants, defs = [], {}
    for tool in tools:
        schema = tool.function.arguments_schema()
        # References point at the root (#/$defs/...): the definitions move there, as vLLM moves
        # them.
        for key in ("$defs", "definitions"):
            for ref, sub in schema.pop(key, {}).items():
                if defs.setdefault(key, {}).setdefault(ref, sub) != sub:
                    raise ValueError(
                        f"tools define {key}/{ref} differently; give the definitions distinct names"
                    )
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.function.name}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    forced: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        forced["maxItems"] = 1
    return copy.deepcopy({**forced, **defs})


def calls_from_forced(text: str, tools: list[Tool], choice: str | None) -> list[ToolCall]:
    """The tool calls in output that matched forced_tool_schema(tools, choice, ...). Raises
    ValueError when the text is not a complete match, i.e. generation was cut off (max_tokens):
    answer with the text as content."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"the forced tool call is incomplete JSON ({exc})") from None
    if choice is not None:
        if not isinstance(value, dict):
            raise ValueError("the forced tool call's arguments are not a JSON object")
        return [_new_call(choice, value)]
    names = {tool.function.name for tool in tools}
    if (
        not isinstance(value, list)
        or not value
        or not all(
            isinstance(c, dict) and c.get("name") in names and isinstance(c.get("parameters"), dict)
            for c in value
        )
    ):
        raise ValueError(
            'the forced tool calls are not a list of {"name", "parameters"} objects naming tools'
        )
    return [_new_call(c["name"], c["parameters"]) for c in value]


class ForcedCallStream:
    """Reads tool_choice "required"'s output, [{"name": ..., "parameters": {...}}, ...], as it is
    generated: a call's header (its id and name) goes out once its name is complete, then its
    arguments as they come, the parameters' text exactly as generated, as OpenAI and vLLM stream
    them. The grammar has already made the text match forced_tool_schema, so a plain JSON scanner
    suffices: it follows strings and nesting, and at the depth of a call object reads which key a
    value belongs to. Parameters generated before the name wait for it."""

    def __init__(self) -> None:
        self.stack: list[str] = []  # open containers, "[" or "{"
        self.in_string = self.escaped = False
        self.key: str | None = None  # the call object's key whose value is being read
        self.expect_key = False  # at call-object depth: the next string is a key
        self.token: list[str] = []  # the string being read at call-object depth (a key or the name)
        self.in_args = False
        self.calls: list[
            dict[str, Any]
        ] = []  # {"id", "name", "arguments", "sent": chars of arguments sent}

    def feed(self, text: str) -> list[DeltaItem]:
        for ch in text:
            self._char(ch)
        items: list[DeltaItem] = []
        for index, call in enumerate(self.calls):
            if call["name"] is None:
                continue
            if call["sent"] < 0:
                items.append(
                    {
                        "index": index,
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": call["name"], "arguments": ""},
                    }
                )
                call["sent"] = 0
            if len(call["arguments"]) > call["sent"]:
                items.append(
                    {"index": index, "function": {"arguments": call["arguments"][call["sent"] :]}}
                )
                call["sent"] = len(call["arguments"])
        return items

    def _char(self, ch: str) -> None:
        depth = len(self.stack)
        if self.in_args:
            self.calls[-1]["arguments"] += ch
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
            if depth == 2 and not self.in_args:
                self.token.append(ch)
                if not self.in_string:
                    self._string_done(json.loads("".join(self.token)))
            return
        if ch == '"':
            self.in_string = True
            if depth == 2 and not self.in_args:
                self.token = [ch]
        elif ch in "[{":
            if depth == 2 and self.key == "parameters" and not self.in_args:
                self.in_args = True
                self.calls[-1]["arguments"] = ch
            self.stack.append(ch)
            if depth == 1 and ch == "{":
                self.calls.append({"id": new_call_id(), "name": None, "arguments": "", "sent": -1})
                self.expect_key, self.key = True, None
        elif ch in "]}":
            self.stack.pop()
            if self.in_args and len(self.stack) == 2:
                self.in_args = False
        elif depth == 2 and not self.in_args:
            if ch == ":":
                self.expect_key = False
            elif ch == ",":
                self.expect_key, self.key = True, None

    @property
    def calls_sent(self) -> int:
        """How many calls went out (their headers)."""
        return sum(call["sent"] >= 0 for call in self.calls)

    def _string_done(self, value: str) -> None:
        if self.expect_key:
            self.key = value
        elif self.key == "name":
            self.calls[-1]["name"] = value


# A streamed item: content text, or a tool-call delta in OpenAI's shape ({"index", "id", "type",
# "function": {"name", "arguments": ""}} for a call's first delta, {"index", "function":
# {"arguments"}} for the next ones).
DeltaItem = str | dict[str, Any]
# A family's format after its marker: state -> ({literal: next state}, whether the text may end
# here). The literal "{" is a call object (read whole) rather than a single character.
Grammar = dict[str, tuple[dict[str, str], bool]]
_PASS = "content"  # the state after a failure: the rest of the text is content


def _no_constants(name: str) -> Any:
    raise ValueError(
        f"{name} is not JSON"
    )  # Python reads NaN and Infinity; clients' JSON parsers do not


_JSON = json.JSONDecoder(parse_constant=_no_constants)


@dataclass(frozen=True)
class ToolParser:
    """One model family's tool-call format. Text before `marker` is content (its trailing whitespace
    dropped); from the marker on, the text follows `grammar` from state `start`, each "{" a call
    object {"name", arguments under one of argument_keys}. Where the text stops following it, the
    rest is content; when no call was read before, all of the text is (a malformed call is never an
    error). Without a marker the grammar must match from the start."""

    name: str
    grammar: Grammar
    start: str
    marker: str | None = None
    argument_keys: tuple[str, ...] = ("arguments", "parameters")
    arguments_required: bool = (
        False  # llama3_json: a bare {"name": ...} is an ordinary JSON answer, not a call
    )

    def stream(self) -> ToolStream:
        """A parser for one output that arrives in pieces."""
        return ToolStream(self)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output; content is None when the output was only tool
        calls."""
        stream = self.stream()
        return merge_deltas(stream.feed(text) + stream.finish())


def merge_deltas(items: list[DeltaItem]) -> tuple[str | None, list[ToolCall]]:
    """Join streamed items into (content, calls), as a client accumulates them."""
    content, calls = "", []
    for item in items:
        if isinstance(item, str):
            content += item
        elif "id" in item:
            calls.append({"id": item["id"], "name": item["function"]["name"], "arguments": ""})
        else:
            calls[item["index"]]["arguments"] += item["function"]["arguments"]
    tool_calls = [
        ToolCall(id=c["id"], function=ToolCallFunction(name=c["name"], arguments=c["arguments"]))
        for c in calls
    ]
    return (content if content or not tool_calls else None), tool_calls


class ToolStream:
    """The incremental reader behind ToolParser: feed(delta) and finish() return the items now
    decided. Content is held back only while it may be the start of the marker or trailing
    whitespace before it; a call goes out (its header, then its arguments) once its JSON object
    is complete."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.state = "before" if parser.marker else parser.start
        self.pos = 0  # text[:pos] is decided: sent as content or read as calls
        self.at = 0  # how far the grammar has read
        # where content resumes if the grammar fails after a call: after the last complete element
        self.resume = 0
        self.calls = 0
        self._tried = 0  # a call object can only complete at a "}" after here
        self._out: list[DeltaItem] = []

    def feed(self, delta: str) -> list[DeltaItem]:
        """Add the next piece of the output; returns the items it decides."""
        self.text += delta
        return self._run(final=False)

    def finish(self) -> list[DeltaItem]:
        """The items the end of the output decides (held-back content, an unterminated call's
        fate)."""
        return self._run(final=True)

    def _run(self, final: bool) -> list[DeltaItem]:
        self._out = []
        while self.state != _PASS and self._step(final):
            pass
        if self.state == _PASS:
            self._content(len(self.text))
        return self._out

    def _step(self, final: bool) -> bool:
        """Advance one element; False while waiting for text (or, when final, at the end)."""
        if self.state == "before":
            return self._before_marker(final)
        literals, may_end = self.parser.grammar[self.state]
        q, literal = self._peek(literals, final)
        if literal == "":
            return self._fail() if final and not may_end else False
        if literal is None:
            return self._fail()
        if literal == "{":
            self._tried = max(self._tried, q)
            read = self._read_call(q, final)
            if read is not True:
                return self._fail() if read is False else False
        else:
            self.at = q + len(literal)
        self.state = literals[literal]
        if self.parser.grammar[self.state][1]:
            self.resume = self.at
        return True

    def _before_marker(self, final: bool) -> bool:
        marker = self.parser.marker
        assert marker is not None
        found = self.text.find(marker, self.pos)
        if found < 0:
            if final:
                self._content(len(self.text))
            else:
                end = len(self.text) - _partial_suffix(self.text, marker, self.pos)
                self._content(self.pos + len(self.text[self.pos : end].rstrip()))
            return False
        self._content(self.pos + len(self.text[self.pos : found].rstrip()))
        self.at, self.state = found + len(marker), self.parser.start
        return True

    def _peek(self, literals: dict[str, str], final: bool) -> tuple[int, str | None]:
        """(q, literal): q is the first non-space at or after `at`; literal is the one text[q:]
        starts with, "" at the end of the text or (until final) inside a literal, None when
        text[q:] can start none of them."""
        q = self.at
        while q < len(self.text) and self.text[q].isspace():
            q += 1
        for literal in literals:
            if self.text.startswith(literal, q):
                return q, literal
        rest = self.text[q : q + max(map(len, literals), default=0)]
        if q == len(self.text) or (
            not final and any(literal.startswith(rest) for literal in literals)
        ):
            return q, ""
        return q, None

    def _read_call(self, start: int, final: bool) -> bool | None:
        """Read the call object at `start`: True (sent), False (not a call), None (may still
        complete)."""
        if self.text.find("}", self._tried) < 0:
            return False if final else None
        try:
            value, end = _JSON.raw_decode(self.text, start)
        except ValueError:
            # A prefix of an object never decodes, so only the end of the text can tell malformed
            # from unfinished.
            self._tried = len(self.text)
            return False if final else None
        call = self._call(value)
        if call is None:
            return False
        index, self.calls, self.at = self.calls, self.calls + 1, end
        self._out.append(
            {
                "index": index,
                "id": new_call_id(),
                "type": "function",
                "function": {"name": call[0], "arguments": ""},
            }
        )
        self._out.append(
            {"index": index, "function": {"arguments": json.dumps(call[1], ensure_ascii=False)}}
        )
        return True

    def _call(self, value: Any) -> tuple[str, dict[str, Any]] | None:
        if (
            not isinstance(value, dict)
            or not isinstance(value.get("name"), str)
            or not value["name"]
        ):
            return None
        arguments = next(
            (value[k] for k in self.parser.argument_keys if value.get(k) is not None), None
        )
        if arguments is None:
            return None if self.parser.arguments_required else (value["name"], {})
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        return (value["name"], arguments) if isinstance(arguments, dict) else None

    def _fail(self) -> bool:
        if self.calls:
            tail = self.text[self.resume :]
            self.pos = self.resume + len(tail) - len(tail.lstrip())
        self.state = _PASS
        return False

    def _content(self, end: int) -> None:
        if end > self.pos:
            self._out.append(self.text[self.pos : end])
            self.pos = end


def _partial_suffix(text: str, marker: str, start: int) -> int:
    """The length of the longest suffix of text[start:] that is a proper prefix of marker."""
    for k in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


# Qwen2.5/Qwen3/Hermes: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>, repeated.
HERMES = ToolParser(
    "hermes",
    marker="<tool_call>",
    start="call",
    grammar={
        "call": ({"{": "close"}, False),
        "close": (
            {"</tool_call>": "next"},
            True,
        ),  # a call cut off before its closing tag still counts
        "next": ({"<tool_call>": "call"}, True),
    },
)
# Llama 3.1/3.2/3.3: the whole output is {"name": ..., "parameters": {...}}, or several joined by
# ";".
LLAMA3_JSON = ToolParser(
    "llama3_json",
    start="start",
    argument_keys=("parameters", "arguments"),
    arguments_required=True,
    grammar={
        "start": ({"<|python_tag|>": "call", "{": "next"}, False),
        "call": ({"{": "next"}, False),
        "next": ({";": "call"}, True),
    },
)
# Mistral v0.3: [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...] (a lone object is taken too).
MISTRAL = ToolParser(
    "mistral",
    marker="[TOOL_CALLS]",
    start="open",
    grammar={
        "open": ({"[": "item", "{": "done"}, False),
        "item": ({"{": "after"}, False),
        "after": ({",": "item", "]": "done"}, True),
        "done": ({}, True),
    },
)
PARSERS: dict[str, ToolParser] = {p.name: p for p in (HERMES, LLAMA3_JSON, MISTRAL)}
# What in a chat template shows its tool-call format, checked in this order.
_SIGNS = (
    (HERMES, ("<tool_call>",)),
    (MISTRAL, ("[TOOL_CALLS]",)),
    (LLAMA3_JSON, ("<|python_tag|>", '"parameters"', "ipython")),
)


def parser_for(name: str, chat_template: str | None) -> ToolParser | None:
    """The parser named (auto, hermes, llama3_json, mistral or none; None for none). auto reads the
    format off the chat template, and where it shows none takes Hermes's, the one most open chat
    models were tuned on (Qwen2.5 and 3, Hermes, SmolLM2's tool data): an agent's later turns send
    tool_choice auto with every tool result, and a 400 on each would stop it on its second turn.
    Raises ValueError on an unknown name."""
    if name == "none":
        return None
    if name != "auto":
        if name not in PARSERS:
            raise ValueError(
                f"unknown tool parser {name!r}; use one of auto, none, {', '.join(PARSERS)}"
            )
        return PARSERS[name]
    return template_format(chat_template) or HERMES


def template_format(chat_template: str | None) -> ToolParser | None:
    """The tool-call format a chat template shows (None: none)."""
    for parser, signs in _SIGNS:
        if chat_template and any(sign in chat_template for sign in signs):
            return parser
    return None


def renders_tools(chat_template: str | None) -> bool:
    """Whether a chat template writes the request's tools into the prompt (it reads its `tools`
    variable)."""
    return bool(chat_template) and "tools" in chat_template


def with_tool_prompt(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """messages with the tools described in their system message, in Hermes's format, for a chat
    template that writes no tools itself: the model learns what it may call and how to call it (what
    the Hermes parser reads)."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    prompt = (
        "# Tools\n\nYou may call one or more of the functions below to help answer the user. Their "
        "signatures "
        f"are within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\nTo call one, answer "
        "with a JSON "
        "object of its name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
    if messages and messages[0].get("role") == "system":
        return [
            {**messages[0], "content": f"{messages[0].get('content') or ''}\n\n{prompt}".lstrip()},
            *messages[1:],
        ]
    return [{"role": "system", "content": prompt}, *messages]


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages made ready for a Hugging Face chat template, as vLLM makes them: a tool
    call's arguments parsed from JSON text to a dict (templates write them with tojson), None
    content as "" and text parts joined with "\\n", "developer" as "system", and keys holding
    None dropped (templates test `is defined`). The input is not changed. Raises ValueError, for
    the client, when a call's arguments are not JSON."""
    prepared = []
    for i, message in enumerate(messages):
        out = {k: v for k, v in message.items() if v is not None and k != "tool_calls"}
        if out.get("role") == "developer":
            out["role"] = "system"
        content = message.get("content")
        if isinstance(content, list):
            content = "\n".join(part["text"] for part in content if part.get("type") == "text")
        out["content"] = content or ""
        if message.get("tool_calls"):
            out["tool_calls"] = [
                _template_call(call, f"messages[{i}].tool_calls[{j}]")
                for j, call in enumerate(message["tool_calls"])
            ]
        prepared.append(out)
    return prepared


def _template_call(call: dict[str, Any], where: str) -> dict[str, Any]:
    function = dict(call["function"])
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = json.loads(function["arguments"])
        except ValueError as exc:
            raise ValueError(
                f"{where}.function.arguments is not JSON text ({exc}); send the arguments the "
                "model "
                'returned, such as \'{"city": "Paris"}\''
            ) from None
    return {**{k: v for k, v in call.items() if v is not None}, "function": function}
