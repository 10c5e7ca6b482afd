"""Reasoning models' thinking split off their answers (`--reasoning-parser`, vLLM's names).

Qwen3 and DeepSeek-R1 think in `<think>...</think>` before they answer. Their templates may write
the opening tag into the prompt (DeepSeek-R1-0528, Qwen3's thinking-only models), so the output
may start inside the thinking: as vLLM's parsers do, everything before `</think>` is thinking and a
leading `<think>` is dropped; an output that never closes its thinking is all thinking. Qwen3 with
`enable_thinking: false` (its template then writes an empty thinking block into the prompt) answers
directly: all of its output is answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

REASONING_PARSERS = ("qwen3", "deepseek_r1")
THINK_START, THINK_END = "<think>", "</think>"


def thinks(parser: str | None, template_kwargs: dict) -> bool:
    """Whether a request's output starts in thinking: a reasoning parser is on and, for qwen3, the
    template was not told enable_thinking: false (deepseek_r1 always thinks, as in vLLM)."""
    if parser is None:
        return False
    if parser == "qwen3":
        return template_kwargs.get("enable_thinking", True) is not False
    return True


@dataclass
class Split:
    """A piece of output as thinking and answer text (either may be empty)."""

    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    """Splits one choice's output, fed as it streams, into thinking and answer; `whole` on the full
    text gives the same split. A tag cut across two pieces is held back until it is whole."""

    def __init__(self, thinking: bool) -> None:
        self.thinking = thinking  # whether the output opens with thinking
        self.in_thinking = thinking
        self.started = not thinking  # past a possible leading <think>
        self.held = ""
        self.reasoning: list[str] = []  # all the thinking so far
        self.answering = not thinking  # past the newlines that open the answer after </think>

    def feed(self, text: str, final: bool = False) -> Split:
        """The next piece of output; final: the output is complete (release what is held)."""
        out = Split()
        text = self.held + text
        self.held = ""
        if not self.started:
            stripped = text.lstrip()
            if THINK_START.startswith(stripped) and not final:
                self.held = text  # nothing yet, or maybe the start of <think>
                return out
            if stripped.startswith(THINK_START):
                text = stripped[len(THINK_START) :]
            self.started = True
        if self.in_thinking:
            before, found, after = text.partition(THINK_END)
            if found:
                out.reasoning = before
                self.in_thinking = False
                out.content = self._answer(after)
            else:
                keep = 0 if final else _partial_tail(text, THINK_END)
                out.reasoning, self.held = text[: len(text) - keep], text[len(text) - keep :]
            self.reasoning.append(out.reasoning)
            return out
        out.content = self._answer(text)
        return out

    def _answer(self, text: str) -> str:
        """Answer text, without the newlines between </think> and the answer (Qwen3 writes two,
        and its template drops them when it shows the answer again)."""
        if not self.answering:
            text = text.lstrip("\n")
            self.answering = bool(text)
        return text

    @property
    def reasoning_text(self) -> str:
        return "".join(self.reasoning)


def whole(text: str, thinking: bool) -> tuple[str | None, str]:
    """A finished output's thinking (None when there was none to parse) and answer."""
    if not thinking:
        return None, text
    split = ReasoningSplitter(True).feed(text, final=True)
    return split.reasoning, split.content


def reasoning_token_count(tokenizer: Any, token_ids: Sequence[int]) -> int:
    """How many of an output's tokens are its thinking, `</think>` included (all of them where the
    thinking never closed): the reasoning_tokens of the Responses API's usage. The tag is one token
    in Qwen3's and DeepSeek-R1's vocabularies; elsewhere the shortest prefix of the output that
    decodes to text holding the tag is found by bisection."""
    end = tokenizer.convert_tokens_to_ids(THINK_END)
    if isinstance(end, int) and end != tokenizer.unk_token_id and end in token_ids:
        return list(token_ids).index(end) + 1

    def closed(n: int) -> bool:
        return THINK_END in tokenizer.decode(token_ids[:n], skip_special_tokens=False)

    if not closed(len(token_ids)):
        return len(token_ids)
    low, high = 0, len(token_ids)  # closed(high) holds, closed(low) does not
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if closed(mid) else (mid, high)
    return high


def _partial_tail(text: str, tag: str) -> int:
    """The length of text's longest suffix that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
