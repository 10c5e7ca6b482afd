"""A choice's output as the block-structured APIs show it: a sequence of text blocks and tool-call
blocks.

OpenAI's Responses (output items: message, function_call) and Anthropic's Messages (content blocks:
text, tool_use) both cut an answer into blocks, each started, grown by deltas and stopped, where
chat completions send flat deltas. OutputBlocks turns a choice's events (through its ToolOutput,
which reads the calls out of the text as it streams) into those block events, the same for both
APIs; blocks_of gives a finished choice's blocks whole.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from server.reasoning import whole
from server.request_types import Choice


@dataclass
class Block:
    """One block of an answer. A text block's text, or a tool call's arguments (JSON text) as far as
    they came."""

    kind: Literal["reasoning", "text", "tool_call"]
    index: int  # its place among the answer's blocks
    text: str = ""
    call_id: str | None = None  # tool_call
    name: str | None = None  # tool_call

    def arguments(self) -> dict[str, Any]:
        """A finished tool call's arguments as an object."""
        return json.loads(self.text or "{}")


@dataclass
class BlockEvent:
    what: Literal["start", "delta", "stop"]
    block: Block
    delta: str = ""


class OutputBlocks:
    """The block events of one choice, fed its events' text in order (final: the choice's last
    event)."""

    def __init__(self, choice: Choice) -> None:
        self.choice = choice
        self.blocks: list[Block] = []
        self.open: Block | None = None
        self.calls: dict[int, Block] = {}  # a tool-call delta's index -> its block

    def feed(self, text: str, final: bool) -> list[BlockEvent]:
        out: list[BlockEvent] = []
        if (reasoning := self.choice.reasoning) is not None:
            split = reasoning.feed(text, final)
            if split.reasoning:
                if self.open is None or self.open.kind != "reasoning":
                    out += self._start(Block("reasoning", len(self.blocks)))
                out += self._grow(self.open, split.reasoning)
            text = split.content
        tools = self.choice.tools
        delta = (
            tools.delta(text, final) if tools is not None else ({"content": text} if text else {})
        )
        if content := delta.get("content"):
            if self.open is None or self.open.kind != "text":
                out += self._start(Block("text", len(self.blocks)))
            out += self._grow(self.open, content)
        for item in delta.get("tool_calls", ()):
            if "id" in item:
                block = Block(
                    "tool_call", len(self.blocks), call_id=item["id"], name=item["function"]["name"]
                )
                self.calls[item["index"]] = block
                out += self._start(block)
            if arguments := item["function"].get("arguments"):
                out += self._grow(self.calls[item["index"]], arguments)
        if final:
            out += self._stop()
        return out

    def _start(self, block: Block) -> list[BlockEvent]:
        out = self._stop()
        self.blocks.append(block)
        self.open = block
        return [*out, BlockEvent("start", block)]

    def _grow(self, block: Block, delta: str) -> list[BlockEvent]:
        block.text += delta
        return [BlockEvent("delta", block, delta)]

    def _stop(self) -> list[BlockEvent]:
        if self.open is None:
            return []
        block, self.open = self.open, None
        return [BlockEvent("stop", block)]


def blocks_of(choice: Choice) -> list[Block]:
    """A finished choice's blocks: its thinking (if any), its content (if any) and then its tool
    calls."""
    text = choice.detok.text
    blocks: list[Block] = []
    if choice.reasoning is not None:
        thinking, text = whole(text, choice.reasoning.thinking)
        if thinking:
            blocks.append(Block("reasoning", 0, thinking))
    if choice.tools is None:
        return blocks + ([Block("text", len(blocks), text)] if text else [])
    content, calls = choice.tools.result(text)
    if content:
        blocks.append(Block("text", len(blocks), content))
    for call in calls:
        blocks.append(
            Block(
                "tool_call",
                len(blocks),
                call["function"]["arguments"],
                call["id"],
                call["function"]["name"],
            )
        )
    return blocks
