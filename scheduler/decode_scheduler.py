"""Continuous batching in the decode worker, which owns the unit's KV blocks.

A request is admitted when its prompt's blocks can be allocated (after the
prefix-cache lookup). Its prefill then runs either on the prefill worker (a
PrefillJob; the blocks stay pinned until PrefillDone) or inline, in chunks,
mixed into decode steps under the per-step token budget, the inline prefill
with the fewest tokens left first. When a running
sequence needs a block and none is free, the newest running sequence is
preempted: its blocks are freed and it is recomputed later from its prompt and
the tokens it already generated.

A step is committed when it is launched (commit): its tokens count as computed, and each sampling
sequence gets a PLACEHOLDER for the token the step will sample. With async scheduling the worker
schedules the next step while that one runs on the device (schedule(ahead=True)): a running
sequence's next input is then its placeholder, whose token the engine takes from the step before on
the device. postprocess writes the sampled tokens over the placeholders once the step is done. A
sequence that ends while a later step holding it is on the device (a stop token, an abort) keeps its
blocks until that step is done too: no block is freed, and so handed to the prefill worker, while a
step may still write it; and a block is cached (others may match it) only once the step that wrote
it is done.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.model_runner import StepInput
from engine.sampling_params import TokenLogprobs
from scheduler.messages import GenerateRequest, PrefillDone, PrefillJob, RequestOutput, WorkerStats
from scheduler.sequence import PLACEHOLDER, SeqState, Sequence, pack


@dataclass
class Step:
    """One forward pass: the inputs, the sequences they belong to, and the prefill jobs to hand
    off."""

    inputs: list[StepInput] = field(default_factory=list)
    seqs: list[Sequence] = field(default_factory=list)
    jobs: list[PrefillJob] = field(default_factory=list)
    started: list[str] = field(default_factory=list)  # requests whose first chunk is in this step
    committed: bool = False
    computed: list[int] = field(
        default_factory=list
    )  # per input: its sequence's computed tokens once this step ran
    placeholders: list[int] = field(
        default_factory=list
    )  # per sampling sequence: where its token goes in token_ids

    @property
    def sampling_seqs(self) -> list[Sequence]:
        return [s for s, i in zip(self.seqs, self.inputs) if i.sample]


class DecodeScheduler:
    """Decides each decode-worker step; the worker runs the model and feeds back the sampled
    tokens."""

    def __init__(
        self,
        blocks: BlockManager,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        inline_all: bool,
        vocab_size: int,
        prefill_batch_tokens: int | None = None,
    ) -> None:
        self.blocks = blocks
        self.vocab_size = vocab_size
        self.eos = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.token_budget = max_num_batched_tokens
        # Inline prefills after the first join a step only while its prefill tokens are below this
        # (None: while the budget lasts). Smaller finishes appends one after another instead of
        # together: a lower TTFT, paid for in TPOT where the load keeps the engine busy
        # (--prefill-batch-tokens; README, "Against vLLM's CPU build").
        self.prefill_batch_tokens = prefill_batch_tokens
        self.inline_all = inline_all  # no prefill worker: every prefill runs here
        self.waiting: deque[Sequence] = deque()
        self.remote: dict[str, Sequence] = {}
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []
        self.by_id: dict[str, Sequence] = {}
        # Admission leaves a little room so running sequences can grow without immediate preemption.
        self.watermark = max(1, blocks.num_blocks // 100)
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.num_preemptions = 0
        self.finished: list[
            str
        ] = []  # requests ended since the worker last took them (to free sampler state)
        self.ended: list[
            Sequence
        ] = []  # ended while a launched step or the prefill worker still writes their blocks

    # ---- requests in -----------------------------------------------------------------------------

    def add(self, req: GenerateRequest) -> RequestOutput | None:
        """Queue a request; returns an error output at once if it is malformed or can never fit in
        the pool."""
        if (problem := self._problem(req)) is not None:
            return RequestOutput(req.request_id, 0, [], error=problem, error_status=400)
        needed = self._blocks_for(len(req.prompt_token_ids) + 1)
        if needed > self.blocks.num_blocks:
            return RequestOutput(
                req.request_id,
                0,
                [],
                error_status=400,
                error=(
                    f"the prompt needs {needed} KV blocks but the pool has "
                    f"{self.blocks.num_blocks}; "
                    "raise --kv-cache-memory or shorten the prompt"
                ),
            )
        # Hashes of the prompt's full blocks, if the request brought the right number of them (a
        # worker never trusts a message: a wrong value can only miss the cache, whose blocks are
        # matched by their tokens too).
        hashes = (
            req.block_hashes
            if len(req.block_hashes) == len(req.prompt_token_ids) // self.blocks.block_size
            else []
        )
        seq = Sequence(
            req.request_id,
            list(req.prompt_token_ids),
            len(req.prompt_token_ids),
            req.sampling,
            req.route,
            hashes,
            retain_s=max(0.0, req.retain_s),
        )
        self.by_id[seq.request_id] = seq
        self.waiting.append(seq)
        return None

    def abort(self, request_id: str) -> bool:
        """Stop a request. Returns True if the prefill worker must be told to drop its job: blocks
        of a remote prefill are freed only when PrefillDone says the worker no longer writes
        them."""
        seq = self.by_id.get(request_id)
        if seq is None:
            return False
        remote = seq.state is SeqState.REMOTE
        self._end(seq, SeqState.FINISHED_ABORTED)
        return remote

    def prefill_done(self, msg: PrefillDone) -> list[RequestOutput]:
        """The prefill worker finished (its KV is complete): start decoding, or release the
        sequence."""
        seq = self.remote.pop(msg.request_id, None)
        if seq is None:
            return []
        if (
            seq.state.finished
        ):  # aborted while the prefill worker had it: its blocks are no one's now
            self._release_ended()
            return []
        if msg.token_id is None:
            self._end(seq, SeqState.FINISHED_ERROR)
            return [
                RequestOutput(
                    seq.request_id,
                    seq.num_output,
                    [],
                    error=msg.error or "prefill failed",
                    error_status=msg.error_status,
                )
            ]
        seq.num_computed = len(seq.token_ids)
        self.blocks.cache_blocks(seq.request_id, seq.token_ids, seq.num_computed)
        seq.reported = True  # the prefill worker sent the first token with the route
        seq.token_ids.append(msg.token_id)
        if (end := self._end_by(seq, msg.token_id, len(seq.token_ids))) is not None:
            self._end(seq, end)
            return [RequestOutput(seq.request_id, seq.num_output, [], finish_reason=end.value)]
        seq.state = SeqState.RUNNING
        self.running.append(seq)
        return []

    # ---- one step --------------------------------------------------------------------------------

    def schedule(self, ahead: bool = False) -> Step | None:
        """Grow the running sequences by a token each, admit what fits, and fill the token budget
        with prefill chunks. ahead: the step before is still on the device (async scheduling);
        returns None, changing nothing, where this step must wait for its tokens: a sequence that
        would take one has penalties or a grammar (their state needs the token on the host), or
        the running sequences need blocks the pool has not free (preempting waits for the
        device)."""
        if ahead and not self._can_run_ahead():
            return None
        step = Step()
        budget = self.token_budget
        for seq in self._grow_running():
            previous = seq.sample_index if seq.token_ids[-1] == PLACEHOLDER else -1
            token = seq.token_ids[-1] if previous < 0 else 0
            step.inputs.append(
                StepInput(
                    [token],
                    seq.num_computed,
                    self.blocks.table_array(seq.request_id),
                    previous=previous,
                )
            )
            step.seqs.append(seq)
            budget -= 1
        self._admit(step)
        # Shortest remaining prefill first: a turn's append (its history cached) is not held behind
        # another request's long uncached prompt; a long prompt takes whatever budget the short ones
        # leave, and waits only while short prefills fill whole steps.
        chunks = pack(
            sorted(self.prefilling, key=lambda s: s.num_uncomputed),
            budget,
            lambda s: self.blocks.table_array(s.request_id),
            self.prefill_batch_tokens,
        )
        step.inputs += chunks.inputs
        step.seqs += chunks.seqs
        step.started += chunks.started
        return step

    def commit(self, step: Step) -> None:
        """The step was launched: its tokens count as computed, each sampling sequence gets a
        placeholder for its token, and a prompt's last chunk makes its sequence a running one.
        Idempotent."""
        if step.committed:
            return
        step.committed = True
        sampled = 0
        for seq, inp in zip(step.seqs, step.inputs):
            seq.num_computed += len(inp.token_ids)
            seq.in_flight += 1
            step.computed.append(seq.num_computed)
            if inp.sample:
                seq.sample_index, sampled = sampled, sampled + 1
                step.placeholders.append(len(seq.token_ids))
                seq.token_ids.append(PLACEHOLDER)
                if seq.state is SeqState.PREFILLING:
                    self.prefilling.remove(seq)
                    seq.state = SeqState.RUNNING
                    self.running.append(seq)

    def postprocess(
        self,
        step: Step,
        tokens: list[int | None],
        failed: dict[int, str] | None = None,
        logprobs: list[TokenLogprobs | None] | None = None,
        prompt_logprobs: dict[int, list[TokenLogprobs]] | None = None,
    ) -> list[RequestOutput]:
        """The step ran: record its KV and sampled tokens (with their logprobs, where asked, and the
        prompt logprobs of the inputs that asked, by position); returns the outputs for the API
        server. failed: the step's inputs (by position) that raised in the engine, with why;
        their requests end with that error. A sequence that ended while the step ran gets nothing
        of it."""
        self.commit(step)
        failed = failed or {}
        logprobs = logprobs or [None] * len(tokens)
        prompt_logprobs = prompt_logprobs or {}
        outputs = []
        for pos, (seq, computed) in enumerate(zip(step.seqs, step.computed)):
            seq.in_flight -= 1
            if seq.state.finished:
                continue
            if pos in failed:
                while (
                    seq.token_ids[-1] == PLACEHOLDER
                ):  # no token of this step or a later one is the request's
                    seq.token_ids.pop()
                outputs.append(
                    RequestOutput(
                        seq.request_id,
                        seq.num_output,
                        [],
                        error=f"the decode worker failed on this request ({failed[pos]})",
                        error_status=getattr(failed[pos], "status", 500),
                    )
                )
                self._end(seq, SeqState.FINISHED_ERROR)
                continue
            if pos in prompt_logprobs:
                seq.prompt_logprobs += prompt_logprobs[pos]
            self.blocks.cache_blocks(seq.request_id, seq.token_ids, computed)
        for seq, at, token, lp in zip(
            step.sampling_seqs, step.placeholders, tokens, logprobs, strict=True
        ):
            if token is None or seq.state.finished:
                continue  # failed above, or ended while the step ran
            asked_prompt = (
                seq.sampling.prompt_logprobs if at == seq.num_prompt else None
            )  # its first pass's end
            seq.token_ids[at] = token
            out = RequestOutput(
                seq.request_id, at - seq.num_prompt, [token], logprobs=None if lp is None else [lp]
            )
            if asked_prompt is not None:
                out.prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, []
            if not seq.reported:
                out.route, out.num_cached_tokens, seq.reported = seq.route, seq.num_cached, True
            if (end := self._end_by(seq, token, at + 1)) is not None:
                out.finish_reason = end.value
                del seq.token_ids[
                    at + 1 :
                ]  # a later step's placeholder: that step's token is not the request's
                self._end(seq, end)
            outputs.append(out)
        self._release_ended()
        return outputs

    # ---- state -----------------------------------------------------------------------------------

    @property
    def has_step_work(self) -> bool:
        return bool(self.running or self.prefilling)

    @property
    def prefill_queue_tokens(self) -> int:
        """Uncached prompt tokens handed to the prefill worker and not yet done."""
        return sum(len(s.token_ids) - s.num_computed for s in self.remote.values())

    def stats(self) -> WorkerStats:
        return WorkerStats(
            num_running=len(self.running) + len(self.prefilling) + len(self.remote),
            num_waiting=len(self.waiting),
            kv_usage=self.blocks.usage,
            prefix_queries=self.prefix_queries,
            prefix_hits=self.prefix_hits,
            num_preemptions=self.num_preemptions,
            prefill_queue_tokens=self.prefill_queue_tokens,
            kv_retained_blocks=self.blocks.num_retained,
        )

    # ---- internals -------------------------------------------------------------------------------

    def _problem(self, req: GenerateRequest) -> str | None:
        """Why this request cannot run (the API server checks first; a worker never trusts a message
        to be sane)."""
        prompt = req.prompt_token_ids
        if req.request_id in self.by_id:
            return f"request id {req.request_id} is already running"
        if not prompt:
            return "the prompt is empty"
        if not 0 <= min(prompt) <= max(prompt) < self.vocab_size:
            bad = next(t for t in prompt if not 0 <= t < self.vocab_size)
            return f"prompt token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})"
        if len(prompt) >= self.max_model_len:
            return (
                f"the prompt's {len(prompt)} tokens leave no room in the context of"
                f" {self.max_model_len}"
            )
        return req.sampling.problem(self.vocab_size)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.blocks.block_size)

    def _admit(self, step: Step) -> None:
        while self.waiting:
            seq = self.waiting[0]
            if len(self.running) + len(self.prefilling) + len(self.remote) >= self.max_num_seqs:
                return
            if (
                self.blocks.num_free_blocks
                < self._blocks_for(len(seq.token_ids) + 1) + self.watermark
                and self.running
            ):
                return
            if (
                seq.request_id in self.blocks
            ):  # the same id's earlier request keeps its blocks until its step is done
                return
            # A cached prefix has no logits: a request for prompt logprobs computes its whole
            # prompt.
            cached = self.blocks.allocate(
                seq.request_id,
                seq.token_ids,
                num_extra_slots=1,
                use_cache=seq.prompt_logprobs_asked is None,
                hashes=seq.block_hashes,
            )
            if cached is None:
                return
            self.waiting.popleft()
            if seq.route is None:  # first admission, not a recompute after preemption
                seq.num_cached = cached
                self.prefix_queries += seq.num_prompt
                self.prefix_hits += cached
            seq.num_computed = cached
            inline = self.inline_all or (cached > 0 and seq.route_hint == "decode")
            seq.route = seq.route or ("decode" if inline else "prefill")
            if inline:
                seq.state = SeqState.PREFILLING
                self.prefilling.append(seq)
            else:
                seq.state = SeqState.REMOTE
                self.remote[seq.request_id] = seq
                step.jobs.append(
                    PrefillJob(
                        seq.request_id,
                        list(seq.token_ids),
                        cached,
                        self.blocks.block_table(seq.request_id),
                        seq.sampling,
                        seq.num_output,
                    )
                )

    def _can_run_ahead(self) -> bool:
        """Whether the next step can be built while the one before is on the device (schedule's
        `ahead`)."""
        needed = 0
        for seq in self.running:
            if seq.token_ids[-1] != PLACEHOLDER:
                needed += self._blocks_for(len(seq.token_ids)) - len(
                    self.blocks.table_array(seq.request_id)
                )
            elif self._ends_by_length(seq):
                continue
            elif seq.sampling.penalized or seq.sampling.guided is not None:
                return False
            else:
                needed += self._blocks_for(len(seq.token_ids)) - len(
                    self.blocks.table_array(seq.request_id)
                )
        return needed <= self.blocks.num_free_blocks

    def _ends_by_length(self, seq: Sequence) -> bool:
        """Whether the token a step on the device samples for seq (its last placeholder) ends it,
        whatever it is."""
        return seq.token_ids[-1] == PLACEHOLDER and self._length_done(seq, len(seq.token_ids))

    def _length_done(self, seq: Sequence, length: int) -> bool:
        return length - seq.num_prompt >= seq.sampling.max_tokens or length >= self.max_model_len

    def _grow_running(self) -> list[Sequence]:
        """Running sequences that have a slot for their next token, preempting the newest ones when
        blocks run out (never one a launched step holds: schedule(ahead) has checked that none is
        needed); a sequence whose token on the device ends it by length has no next token."""
        ready = []
        queue = deque(s for s in self.running if not self._ends_by_length(s))
        while queue:
            seq = queue.popleft()
            while not self.blocks.ensure_capacity(seq.request_id, len(seq.token_ids)):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                ready.append(seq)
        return ready

    def _preempt(self, seq: Sequence) -> None:
        assert seq.in_flight == 0, "preempting a sequence a launched step holds"
        self.running.remove(seq)
        self.blocks.free(seq.request_id)
        seq.state, seq.num_computed = SeqState.PREEMPTED, 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _end_by(self, seq: Sequence, token: int, length: int) -> SeqState | None:
        """How seq ends with token as its length-th token (None: it goes on)."""
        sp = seq.sampling
        if (token in self.eos and not sp.ignore_eos) or token in sp.stop_token_ids:
            return SeqState.FINISHED_STOPPED
        if self._length_done(seq, length):
            return SeqState.FINISHED_LENGTH
        return None

    def _end(self, seq: Sequence, state: SeqState) -> None:
        """The one way a request ends: it leaves its queue and the live requests, its sampling state
        is to be freed (`finished`), and its blocks go back now, or once no writer holds them: a
        launched step (in_flight) or the prefill worker (a REMOTE request stays in `remote` until
        its PrefillDone)."""
        assert state.finished and not seq.state.finished, (
            f"{seq.request_id}: {seq.state} -> {state}"
        )
        if seq.state.queued:
            self.waiting.remove(seq)
        elif seq.state is SeqState.PREFILLING:
            self.prefilling.remove(seq)
        elif seq.state is SeqState.RUNNING:
            self.running.remove(seq)
        seq.state = state
        del self.by_id[seq.request_id]
        self.finished.append(seq.request_id)
        self.ended.append(seq)
        self._release_ended()

    def _release_ended(self) -> None:
        """Free the blocks of ended requests no writer holds any more."""
        held = []
        for seq in self.ended:
            if seq.in_flight or seq.request_id in self.remote:
                held.append(seq)
            elif seq.request_id in self.blocks:
                # Retained only after an answer: a request that failed keeps nothing.
                keep = seq.retain_s if seq.state is not SeqState.FINISHED_ERROR else 0.0
                self.blocks.free(seq.request_id, keep)
        self.ended = held

    def check(self) -> None:
        """Raise AssertionError where the books disagree: each live request in the one queue its
        state names, blocks held exactly by live requests past the queue and by ended ones a
        writer still holds, the batch within max_num_seqs, and the block manager's own books
        (BlockManager.check)."""
        queues = {
            SeqState.REMOTE: [s for s in self.remote.values() if not s.state.finished],
            SeqState.PREFILLING: self.prefilling,
            SeqState.RUNNING: self.running,
        }
        placed = [(s, SeqState.WAITING) for s in self.waiting] + [
            (s, k) for k, q in queues.items() for s in q
        ]
        _check(
            sorted(s.request_id for s, _ in placed) == sorted(self.by_id),
            "each live request in exactly one queue",
        )
        for seq, queue in placed:
            _check(
                seq.state is queue or (queue is SeqState.WAITING and seq.state.queued),
                f"{seq.request_id} is {seq.state.value} in the {queue.value} queue",
            )
            _check(
                (seq.request_id in self.blocks) != seq.state.queued,
                f"{seq.request_id}: blocks and state agree",
            )
        for seq in self.ended:
            _check(
                seq.state.finished and (seq.in_flight or seq.request_id in self.remote),
                f"{seq.request_id}: an ended request keeps blocks only while a writer holds them",
            )
        holders = set(self.by_id) | {s.request_id for s in self.ended}
        _check(self.blocks.holders() <= holders, "blocks held by a request that is gone")
        _check(
            len(self.running) + len(self.prefilling) + len(self.remote) <= self.max_num_seqs,
            "max_num_seqs",
        )
        self.blocks.check()


def _check(ok: bool, what: str) -> None:
    if not ok:  # not `assert`: checked under python -O too
        raise AssertionError(what)
