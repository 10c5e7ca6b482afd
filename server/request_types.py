"""The records the request path hands every API family: a request's Prompt, its Choices as they
accumulate, and the Events they stream (server/request_path.py makes them; each family shapes them
into its own responses)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling_params import TokenLogprobs
from server.detokenizer import Detokenizer
from server.reasoning import ReasoningSplitter
from server.tool_output import ToolOutput


@dataclass
class Choice:
    """One of a request's n answers, as it accumulates."""

    index: int
    detok: Detokenizer
    tools: ToolOutput | None = (
        None  # how tool calls come out of the text (None: the text is the content)
    )
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] | None = (
        None  # one per prompt token after the first, when asked
    )
    finish_reason: str | None = None
    route: str | None = None
    num_cached: int = 0
    reasoning: ReasoningSplitter | None = None  # --reasoning-parser: the thinking split off


@dataclass
class Prompt:
    """A request's prompt as its responses show it: the ids, and the text echo puts before each
    completion (None: not echoed)."""

    token_ids: list[int]
    echo: str | None = None


@dataclass
class Event:
    """New text, ids and logprobs of one choice; finish_reason set on its last event."""

    choice: Choice
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
