"""How a chat choice's text becomes content and tool calls, for the request's tool_choice.

auto: the model's own format, read by the family's parser (server/tools.py) as the text streams.
required and a named function: structured outputs force the text to match forced_tool_schema, and
the text is then the calls (a named function's arguments stream as they come; required's calls go
out as their names are complete, then their arguments as they come).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import GuidedSpec
from server.errors import RequestError
from server.protocol import ChatCompletionRequest, NamedToolChoice
from server.tools import (
    DeltaItem,
    ForcedCallStream,
    Tool,
    ToolParser,
    ToolStream,
    calls_from_forced,
    forced_tool_schema,
    new_call_id,
    parser_for,
)


@dataclass
class ToolOutput:
    """One choice's reading of tool calls (fresh() gives each choice its own)."""

    mode: str  # "auto", "required" or "named"
    tools: list[Tool]
    parser: ToolParser | None = None  # auto
    name: str | None = None  # named
    spec: GuidedSpec | None = None  # required and named: what the output must match
    called: bool = False  # a tool call went out in the stream
    _stream: ToolStream | None = None
    _forced: ForcedCallStream | None = None  # required
    _text: str = ""
    _call_id: str = field(default_factory=new_call_id)

    def fresh(self) -> ToolOutput:
        return ToolOutput(self.mode, self.tools, self.parser, self.name, self.spec)

    def result(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A whole output's content (None when it was only calls) and its tool calls in OpenAI's
        shape."""
        if self.mode == "auto":
            content, calls = self.parser.parse(text)  # type: ignore[union-attr]
        else:
            try:
                content, calls = None, calls_from_forced(text, self.tools, self.name)
            except (
                ValueError
            ):  # cut off (max_tokens): the calls begun, with their arguments as far as they got
                partial = self._cut_off_calls(text)
                self.called = bool(partial)
                return (None if partial else text), partial
        self.called = bool(calls)
        return content, [call.model_dump() for call in calls]

    def _cut_off_calls(self, text: str) -> list[dict[str, Any]]:
        """A forced output cut off before it was whole, as what agents expect of a call cut by
        max_tokens (OpenAI's shape, the arguments' text as far as it was generated): a named
        function's call, or required's calls whose names were complete (the ids the stream gave
        them, where it ran)."""

        def call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
            return {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }

        if self.mode == "named":
            return [call(self._call_id, self.name, text)] if text else []  # type: ignore[arg-type]
        forced = self._forced
        if forced is None:
            forced = ForcedCallStream()
            forced.feed(text)
        return [
            call(c["id"], c["name"], c["arguments"]) for c in forced.calls if c["name"] is not None
        ]

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """The chat delta for the next piece of text ({} when nothing is decided yet)."""
        if self.mode == "auto":
            if self._stream is None:
                self._stream = self.parser.stream()  # type: ignore[union-attr]
            items = self._stream.feed(text) + (self._stream.finish() if final else [])
        elif self.mode == "named":
            items = self._named(text)
        else:
            items = self._required(text, final)
        delta: dict[str, Any] = {}
        content = "".join(item for item in items if isinstance(item, str))
        calls = [item for item in items if not isinstance(item, str)]
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
            self.called = True
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's finish_reason: tool_calls when the output ended on its own with calls in it."""
        return "tool_calls" if reason == "stop" and self.called else reason

    def _named(self, text: str) -> list[DeltaItem]:
        items: list[DeltaItem] = []
        if text and not self._text:
            items.append(
                {
                    "index": 0,
                    "id": self._call_id,
                    "type": "function",
                    "function": {"name": self.name, "arguments": ""},
                }
            )
        self._text += text
        if text:
            items.append({"index": 0, "function": {"arguments": text}})
        return items

    def _required(self, text: str, final: bool) -> list[DeltaItem]:
        if self._forced is None:
            self._forced = ForcedCallStream()
        self._text += text
        items = self._forced.feed(text)
        if final and not self._forced.calls_sent:
            return (
                [self._text] if self._text else []
            )  # cut off before a call had its name: the text is all there is
        return items


def tool_output_for(
    body: ChatCompletionRequest, tokenizer: Any, parser_name: str
) -> ToolOutput | None:
    """How this request's choices read tool calls (None: the text is the content, tool_choice none
    or no tools)."""
    choice = body.effective_tool_choice
    if choice == "none" or not body.tools:
        return None
    if choice == "auto":
        parser = parser_for(parser_name, getattr(tokenizer, "chat_template", None))
        if parser is None:
            raise RequestError(
                'tool_choice "auto": this server reads no tool calls out of the model\'s text '
                '(--tool-call-parser none); send tool_choice "required" or a named function, or '
                "start it with another --tool-call-parser",
                param="tool_choice",
            )
        return ToolOutput("auto", body.tools, parser=parser)
    name = choice.function.name if isinstance(choice, NamedToolChoice) else None
    try:
        schema = forced_tool_schema(body.tools, name, body.parallel_tool_calls)
    except ValueError as exc:
        raise RequestError(str(exc), param="tool_choice") from exc
    spec = GuidedSpec("json_schema", json.dumps(schema))
    return ToolOutput("named" if name else "required", body.tools, name=name, spec=spec)
