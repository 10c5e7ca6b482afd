"""A request inside a unit: one record, which both workers keep, and the one packing of prefill
chunks into a step.

The decode worker keeps a Sequence from admission to its end (scheduler/decode_scheduler.py); the
prefill worker keeps one for each job it computes (scheduler/prefill_worker.py), made from the
PrefillJob. Either packs the prompt chunks of a step with `pack`: the sequences in the order it
chooses, each the rest of its prompt (or of a recompute) or what the step's token budget leaves, the
last chunk of a prompt sampling the first token. A chunk's tokens count as computed once its step
ran (the caller adds them to num_computed), never before.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from engine.model_runner import PromptLogprobsAsk, StepInput
from engine.sampling_params import SamplingParams, TokenLogprobs
from scheduler.messages import Route

PLACEHOLDER = (
    -1
)  # a token sampled by a step still on the device (async scheduling): its id is not on the host yet


class SeqState(enum.Enum):
    """Where a request is in its life. The decode worker moves it through these; _end
    (decode_scheduler.py) is the one way into the FINISHED_* states."""

    WAITING = "waiting"  # queued, holding no blocks
    PREEMPTED = (
        "preempted"  # queued again after its blocks went to others: recomputed from its tokens
    )
    REMOTE = "remote"  # its prefill runs on the prefill worker
    PREFILLING = "prefilling"  # its prefill runs inline, chunk by chunk
    RUNNING = "running"  # decoding
    FINISHED_STOPPED = "stop"  # a stop token
    FINISHED_LENGTH = "length"  # max_tokens, or the context, reached
    FINISHED_ABORTED = "abort"  # the client left, or the server ended it
    FINISHED_ERROR = "error"  # a worker failed on it

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def queued(self) -> bool:
        """Waiting for admission, holding no blocks."""
        return self in (SeqState.WAITING, SeqState.PREEMPTED)


_FINISHED = frozenset(
    {
        SeqState.FINISHED_STOPPED,
        SeqState.FINISHED_LENGTH,
        SeqState.FINISHED_ABORTED,
        SeqState.FINISHED_ERROR,
    }
)


@dataclass(eq=False)  # a request is itself: compared by identity (its block table is an array)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt, then generated tokens
    num_prompt: int
    sampling: SamplingParams
    route_hint: Route | None = None
    block_hashes: list[int] = field(
        default_factory=list
    )  # chain hashes of the prompt's full blocks (the router's)
    block_table: np.ndarray | None = (
        None  # the prefill worker's: the blocks the decode worker allocated for it
    )
    retain_s: float = 0.0  # its cached blocks' retention once it ends (free's retain_s)
    state: SeqState = SeqState.WAITING
    num_computed: int = 0  # leading tokens whose KV is in the pool
    num_cached: int = 0  # prompt tokens the prefix cache served at first admission
    route: Route | None = None
    # What the API server was told, not where the request is in its life:
    started: bool = (
        False  # a chunk of it has been in a step (inline), or the prefill worker said so
    )
    reported: bool = False  # route and cached tokens already sent with an output
    prompt_logprobs: list[TokenLogprobs] = field(
        default_factory=list
    )  # of the chunks so far, until the first token
    in_flight: int = 0  # steps launched with it whose results are not taken yet
    sample_index: int = -1  # its row among the sampled tokens of the latest step launched with it

    @property
    def prompt_logprobs_asked(self) -> int | None:
        """The prompt logprobs' top count while the first pass runs (None: not asked, or a recompute
        after preemption, whose first pass sent them already)."""
        return self.sampling.prompt_logprobs if self.num_output == 0 else None

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    def next_chunk(self, budget: int, table: list[int]) -> StepInput:
        """The next prompt chunk, at most budget tokens, over the blocks in table; it samples when
        it ends the prompt (or the recompute)."""
        start, todo = self.num_computed, self.num_uncomputed
        chunk = min(todo, budget)
        ask = PromptLogprobsAsk.for_chunk(
            self.prompt_logprobs_asked, self.token_ids, self.num_prompt, start, start + chunk
        )
        return StepInput(
            self.token_ids[start : start + chunk],
            start,
            table,
            sample=chunk == todo,
            prompt_logprobs=ask,
        )


@dataclass
class Packed:
    """A step's prompt chunks: the inputs, their sequences, and the requests whose first chunk is
    among them."""

    inputs: list[StepInput] = field(default_factory=list)
    seqs: list[Sequence] = field(default_factory=list)
    started: list[str] = field(default_factory=list)


def pack(
    seqs: Iterable[Sequence],
    budget: int,
    table: Callable[[Sequence], list[int]],
    limit: int | None = None,
) -> Packed:
    """Prompt chunks of seqs, in their order, until budget tokens are used (or, with limit, once
    chunks of limit tokens or more are in); table gives a sequence's blocks. Marks each packed
    sequence started."""
    packed, tokens = Packed(), 0
    for seq in seqs:
        if budget <= 0 or (limit is not None and tokens >= limit):
            break
        step_input = seq.next_chunk(budget, table(seq))
        packed.inputs.append(step_input)
        packed.seqs.append(seq)
        if not seq.started:
            seq.started = True
            packed.started.append(seq.request_id)
        budget -= len(step_input.token_ids)
        tokens += len(step_input.token_ids)
    return packed
