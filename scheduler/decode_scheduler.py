"""Continuous batching in the decode worker, which owns the unit's KV blocks.

A request is admitted when its prompt's blocks can be allocated (after the
prefix-cache lookup). Its prefill then runs either on the prefill worker (a
PrefillJob; the blocks stay pinned until PrefillDone) or inline, in chunks,
mixed into decode steps under the per-step token budget, the inline prefill
with the fewest tokens left first. When a running
sequence needs a block and none is free, the newest running sequence is
preempted: its blocks are freed and it is recomputed later from its prompt and
the tokens it already generated.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.model_runner import StepInput
from engine.sampling_params import TokenLogprobs
from scheduler.messages import GenerateRequest, PrefillDone, PrefillJob, RequestOutput, WorkerStats
from scheduler.sequence import SeqState, Sequence, pack


@dataclass
class Step:
    """One forward pass: the inputs, the sequences they belong to, and the prefill jobs to hand off."""

    inputs: list[StepInput] = field(default_factory=list)
    seqs: list[Sequence] = field(default_factory=list)
    jobs: list[PrefillJob] = field(default_factory=list)
    started: list[str] = field(default_factory=list)  # requests whose first chunk is in this step

    @property
    def sampling_seqs(self) -> list[Sequence]:
        return [s for s, i in zip(self.seqs, self.inputs) if i.sample]


class DecodeScheduler:
    """Decides each decode-worker step; the worker runs the model and feeds back the sampled tokens."""

    def __init__(self, blocks: BlockManager, eos_token_ids: tuple[int, ...], max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, inline_all: bool, vocab_size: int,
                 prefill_batch_tokens: int | None = None) -> None:
        self.blocks = blocks
        self.vocab_size = vocab_size
        self.eos = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.token_budget = max_num_batched_tokens
        # Inline prefills after the first join a step only while its prefill tokens are below this (None: while the
        # budget lasts). Smaller finishes appends one after another instead of together: a lower TTFT, paid for in
        # TPOT where the load keeps the engine busy (--prefill-batch-tokens; README, "Against vLLM's CPU build").
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
        self.finished: list[str] = []  # requests ended since the worker last took them (to free sampler state)

    # ---- requests in -------------------------------------------------------------------------------

    def add(self, req: GenerateRequest) -> RequestOutput | None:
        """Queue a request; returns an error output at once if it is malformed or can never fit in the pool."""
        if (problem := self._problem(req)) is not None:
            return RequestOutput(req.request_id, 0, [], error=problem, error_status=400)
        needed = self._blocks_for(len(req.prompt_token_ids) + 1)
        if needed > self.blocks.num_blocks:
            return RequestOutput(req.request_id, 0, [], error_status=400, error=(
                f"the prompt needs {needed} KV blocks but the pool has {self.blocks.num_blocks}; "
                "raise --kv-cache-memory or shorten the prompt"))
        # Hashes of the prompt's full blocks, if the request brought the right number of them (a worker never trusts
        # a message: a wrong value can only miss the cache, whose blocks are matched by their tokens too).
        hashes = req.block_hashes if len(req.block_hashes) == len(req.prompt_token_ids) // self.blocks.block_size else []
        seq = Sequence(req.request_id, list(req.prompt_token_ids), len(req.prompt_token_ids), req.sampling, req.route,
                       hashes)
        self.by_id[seq.request_id] = seq
        self.waiting.append(seq)
        return None

    def abort(self, request_id: str) -> bool:
        """Stop a request. Returns True if the prefill worker must be told to drop its job: blocks of a
        remote prefill are freed only when PrefillDone says the worker no longer writes them."""
        seq = self.by_id.get(request_id)
        if seq is None:
            return False
        if seq.state is SeqState.REMOTE:
            seq.aborted = True
            return True
        self._finish(seq)
        return False

    def prefill_done(self, msg: PrefillDone) -> list[RequestOutput]:
        """The prefill worker finished (its KV is complete): start decoding, or release the sequence."""
        seq = self.remote.pop(msg.request_id, None)
        if seq is None:
            return []
        if seq.aborted or msg.token_id is None:
            self._finish(seq)
            if seq.aborted:
                return []
            return [RequestOutput(seq.request_id, seq.num_output, [], error=msg.error or "prefill failed")]
        seq.num_computed = len(seq.token_ids)
        self.blocks.cache_blocks(seq.request_id, seq.token_ids, seq.num_computed)
        seq.reported = True  # the prefill worker sent the first token with the route
        seq.token_ids.append(msg.token_id)
        reason = self._finish_reason(seq, msg.token_id)
        if reason:
            self._finish(seq)
            return [RequestOutput(seq.request_id, seq.num_output, [], finish_reason=reason)]
        seq.state = SeqState.RUNNING
        self.running.append(seq)
        return []

    # ---- one step ----------------------------------------------------------------------------------

    def schedule(self) -> Step:
        """Admit what fits, then build a step: one token per running sequence, prefill chunks with the rest of the budget."""
        step = Step()
        self._admit(step)
        budget = self.token_budget
        for seq in self._grow_running():
            step.inputs.append(StepInput([seq.token_ids[-1]], seq.num_computed, self.blocks.block_table(seq.request_id)))
            step.seqs.append(seq)
            budget -= 1
        # Shortest remaining prefill first: a turn's append (its history cached) is not held behind another
        # request's long uncached prompt; a long prompt takes whatever budget the short ones leave, and waits only
        # while short prefills fill whole steps.
        chunks = pack(sorted(self.prefilling, key=lambda s: s.num_uncomputed), budget,
                      lambda s: self.blocks.block_table(s.request_id), self.prefill_batch_tokens)
        step.inputs += chunks.inputs
        step.seqs += chunks.seqs
        step.started += chunks.started
        return step

    def postprocess(self, step: Step, tokens: list[int | None], failed: dict[int, str] | None = None,
                    logprobs: list[TokenLogprobs | None] | None = None,
                    prompt_logprobs: dict[int, list[TokenLogprobs]] | None = None) -> list[RequestOutput]:
        """Record the step's KV and sampled tokens (with their logprobs, where asked, and the prompt logprobs of the
        inputs that asked, by position); returns the outputs for the API server. failed: the step's inputs (by
        position) that raised in the engine, with why; their requests end with that error."""
        failed = failed or {}
        logprobs = logprobs or [None] * len(tokens)
        prompt_logprobs = prompt_logprobs or {}
        outputs = []
        for pos, (seq, inp) in enumerate(zip(step.seqs, step.inputs)):
            if pos in failed:
                outputs.append(RequestOutput(seq.request_id, seq.num_output, [],
                                             error=f"the decode worker failed on this request ({failed[pos]})"))
                self._finish(seq)
                continue
            if pos in prompt_logprobs:
                seq.prompt_logprobs += prompt_logprobs[pos]
            seq.num_computed += len(inp.token_ids)
            self.blocks.cache_blocks(seq.request_id, seq.token_ids, seq.num_computed)
        for seq, token, lp in zip(step.sampling_seqs, tokens, logprobs, strict=True):
            if token is None:
                continue  # failed above
            asked_prompt = seq.prompt_logprobs_asked
            seq.token_ids.append(token)
            out = RequestOutput(seq.request_id, seq.num_output - 1, [token], logprobs=None if lp is None else [lp])
            if asked_prompt is not None:
                out.prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, []
            if not seq.reported:
                out.route, out.num_cached_tokens, seq.reported = seq.route, seq.num_cached, True
            if seq.state is SeqState.PREFILLING:
                self.prefilling.remove(seq)
                seq.state = SeqState.RUNNING
                self.running.append(seq)
            out.finish_reason = self._finish_reason(seq, token)
            if out.finish_reason:
                self._finish(seq)
            outputs.append(out)
        return outputs

    # ---- state -------------------------------------------------------------------------------------

    @property
    def has_step_work(self) -> bool:
        return bool(self.running or self.prefilling)

    @property
    def prefill_queue_tokens(self) -> int:
        """Uncached prompt tokens handed to the prefill worker and not yet done."""
        return sum(len(s.token_ids) - s.num_computed for s in self.remote.values())

    def stats(self) -> WorkerStats:
        return WorkerStats(num_running=len(self.running) + len(self.prefilling) + len(self.remote),
                           num_waiting=len(self.waiting), kv_usage=self.blocks.usage,
                           prefix_queries=self.prefix_queries, prefix_hits=self.prefix_hits,
                           num_preemptions=self.num_preemptions,
                           prefill_queue_tokens=self.prefill_queue_tokens)

    # ---- internals ---------------------------------------------------------------------------------

    def _problem(self, req: GenerateRequest) -> str | None:
        """Why this request cannot run (the API server checks first; a worker never trusts a message to be sane)."""
        prompt = req.prompt_token_ids
        if req.request_id in self.by_id:
            return f"request id {req.request_id} is already running"
        if not prompt:
            return "the prompt is empty"
        if not 0 <= min(prompt) <= max(prompt) < self.vocab_size:
            bad = next(t for t in prompt if not 0 <= t < self.vocab_size)
            return f"prompt token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})"
        if len(prompt) >= self.max_model_len:
            return f"the prompt's {len(prompt)} tokens leave no room in the context of {self.max_model_len}"
        return req.sampling.problem(self.vocab_size)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.blocks.block_size)

    def _admit(self, step: Step) -> None:
        while self.waiting:
            seq = self.waiting[0]
            if len(self.running) + len(self.prefilling) + len(self.remote) >= self.max_num_seqs:
                return
            if self.blocks.num_free_blocks < self._blocks_for(len(seq.token_ids) + 1) + self.watermark and self.running:
                return
            # A cached prefix has no logits: a request for prompt logprobs computes its whole prompt.
            cached = self.blocks.allocate(seq.request_id, seq.token_ids, num_extra_slots=1,
                                          use_cache=seq.prompt_logprobs_asked is None, hashes=seq.block_hashes)
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
                step.jobs.append(PrefillJob(seq.request_id, list(seq.token_ids), cached,
                                            self.blocks.block_table(seq.request_id), seq.sampling, seq.num_output))

    def _grow_running(self) -> list[Sequence]:
        """Running sequences that have a slot for their next token, preempting the newest ones when blocks run out."""
        ready = []
        queue = deque(self.running)
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
        self.running.remove(seq)
        self.blocks.free(seq.request_id)
        seq.state, seq.num_computed = SeqState.WAITING, 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        sp = seq.sampling
        if (token in self.eos and not sp.ignore_eos) or token in sp.stop_token_ids:
            return "stop"
        if seq.num_output >= sp.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence) -> None:
        """Forget a finished or aborted sequence and release its blocks."""
        if seq.state is SeqState.WAITING:
            self.waiting.remove(seq)
        elif seq.state is SeqState.PREFILLING:
            self.prefilling.remove(seq)
        elif seq.state is SeqState.RUNNING:
            self.running.remove(seq)
        self.remote.pop(seq.request_id, None)
        if seq.request_id in self.blocks:
            self.blocks.free(seq.request_id)
        del self.by_id[seq.request_id]
        self.finished.append(seq.request_id)
