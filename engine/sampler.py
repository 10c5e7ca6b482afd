"""Pick the next token of each request from its logits row, with one device sync per step (the
result's copy).

Each row goes through, in order: the penalties (from the request's token counts, kept on the device
per request), logit_bias, the min_tokens ban and the grammar mask; its logprobs are read there; then
temperature, min_p, top-k and top-p narrow what is drawn. A stage that no row of the batch asks for
costs nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from engine.sampling_params import SamplingParams, TokenLogprobs

if TYPE_CHECKING:
    from engine.guided import GuidedDecoding

_M64 = (1 << 64) - 1
NO_LOGPROB = (
    -9999.0
)  # what a token the masks exclude reports (JSON has no -inf), as OpenAI reports one


class SampleRow(Protocol):
    """What the sampler needs of a request: its parameters and its tokens so far (prompt, then
    output)."""

    @property
    def request_id(self) -> str: ...
    @property
    def sampling(self) -> SamplingParams: ...
    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def num_prompt(self) -> int: ...


@dataclass
class Row:
    """A SampleRow by itself (tests, benchmarks, start-up)."""

    sampling: SamplingParams
    token_ids: Sequence[int] = (0,)
    num_prompt: int = 1
    request_id: str = ""


@dataclass
class Sampled:
    """One token per row, and its logprobs where the row's request asked for them (else None); the
    step's prompt logprobs by input position, for the inputs that asked
    (engine/prompt_logprobs.py)."""

    tokens: list[int]
    logprobs: list[TokenLogprobs | None]
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)


@dataclass
class Masks:
    """The grammar masks of a step's guided rows, being filled on the host while the step runs."""

    rows: list[int]
    bitmask: Future[Tensor]


def _mix(seed: int, index: int) -> int:
    """A 64-bit generator seed from (seed, output index), via splitmix64's finalizer.

    Plain seed + index would give request (s, i + 1) the noise of (s + 1, i): neighbouring seeds
    correlated.
    """
    z = (seed * 0x9E3779B97F4A7C15 + index) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _column(values: list[float] | list[int], device: torch.device) -> Tensor | float | int:
    """values as a [B, 1] tensor, or one scalar when every row agrees (the common case: cheaper
    ops)."""
    if all(v == values[0] for v in values):
        return values[0]
    return torch.tensor(values, device=device).unsqueeze(1)


def _output_index(row: SampleRow) -> int:
    return len(row.token_ids) - row.num_prompt


class TokenCounts:
    """Per penalized request, on the device: which tokens its prompt holds and how often each came
    in its output.

    One row per request in two tensors that grow by doubling; a step adds only the tokens appended
    since the request's last step (one small copy to the device). A request whose history no longer
    extends what was counted (it was recomputed from another prompt) is counted again from scratch.
    """

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        self.prompt = torch.zeros(0, vocab, dtype=torch.bool, device=device)
        self.output = torch.zeros(0, vocab, dtype=torch.int32, device=device)
        self.slots: dict[
            str, tuple[int, int, int]
        ] = {}  # request id -> (slot, tokens counted, prompt length)
        self.free: list[int] = []

    def update(self, rows: list[SampleRow]) -> Tensor:
        """Count the rows' new tokens; returns their slots (int64 [len(rows)] on the device)."""
        slots, prompt_at, output_at = [], ([], []), ([], [])
        for row in rows:
            slot, counted, num_prompt = self.slots.get(row.request_id, (-1, 0, row.num_prompt))
            if slot < 0:
                slot = self._new_slot()
            elif num_prompt != row.num_prompt or counted > len(row.token_ids):
                self.prompt[slot] = False
                self.output[slot] = 0
                counted = 0
            for pos in range(counted, len(row.token_ids)):
                at = prompt_at if pos < row.num_prompt else output_at
                at[0].append(slot)
                at[1].append(row.token_ids[pos])
            self.slots[row.request_id] = (slot, len(row.token_ids), row.num_prompt)
            slots.append(slot)
        if prompt_at[0]:
            where = torch.tensor(prompt_at, dtype=torch.int64).to(self.device, non_blocking=True)
            self.prompt[where[0], where[1]] = True
        if output_at[0]:
            where = torch.tensor(output_at, dtype=torch.int64).to(self.device, non_blocking=True)
            ones = torch.ones(where.shape[1], dtype=torch.int32, device=self.device)
            self.output.index_put_((where[0], where[1]), ones, accumulate=True)
        return torch.tensor(slots, dtype=torch.int64).to(self.device, non_blocking=True)

    def release(self, request_id: str) -> None:
        if (entry := self.slots.pop(request_id, None)) is not None:
            self.prompt[entry[0]] = False
            self.output[entry[0]] = 0
            self.free.append(entry[0])

    def _new_slot(self) -> int:
        if not self.free:
            old = self.output.shape[0]
            new = max(8, 2 * old)
            self.prompt = torch.cat([self.prompt, self.prompt.new_zeros(new - old, self.vocab)])
            self.output = torch.cat([self.output, self.output.new_zeros(new - old, self.vocab)])
            self.free = list(range(new - 1, old - 1, -1))
        return self.free.pop()


class Sampler:
    """Greedy, temperature, min-p, top-k and top-p sampling with per-request seeds, penalties,
    logit_bias, min_tokens, grammar masks (guided: the engine's GuidedDecoding) and logprobs."""

    def __init__(
        self,
        eos_token_ids: Sequence[int],
        guided: GuidedDecoding | None = None,
        seed: int | None = None,
    ) -> None:
        """seed: where requests without a seed of their own draw from (None: a random start, so
        that no two processes draw alike)."""
        self.eos_token_ids = tuple(eos_token_ids)
        self.guided = guided
        self.seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}  # for requests without a seed
        self._seeded: dict[torch.device, torch.Generator] = {}  # reseeded per row
        self._counts: dict[torch.device, TokenCounts] = {}

    def start_masks(self, rows: Sequence[SampleRow]) -> Masks | None:
        """Begin filling the grammar masks of the guided rows (None: there are none), on a host
        thread, so that they are ready when the step's logits are: call before launching the
        forward pass."""
        guided = [i for i, row in enumerate(rows) if row.sampling.guided is not None]
        if not guided:
            return None
        if self.guided is None:
            raise RuntimeError("a guided request reached a sampler without structured outputs")
        work = [
            (rows[i].request_id, rows[i].sampling.guided, rows[i].token_ids[rows[i].num_prompt :])
            for i in guided
        ]
        return Masks(guided, self.guided.fill_async(work))

    def release(self, request_id: str) -> None:
        """Forget a finished request's token counts and grammar state."""
        for counts in self._counts.values():
            counts.release(request_id)
        if self.guided is not None:
            self.guided.release(request_id)

    def __call__(
        self, logits: Tensor, rows: Sequence[SampleRow], masks: Masks | None = None
    ) -> Sampled:
        """The drawn tokens on the host (draw, then Drawn.host)."""
        return self.draw(logits, rows, masks).host()

    def draw(self, logits: Tensor, rows: Sequence[SampleRow], masks: Masks | None = None) -> Drawn:
        """Draw a token per row on the device and queue their copy to the host; nothing waits for
        the device. logits: float32 [B, vocab], one row per request, in rows' order. masks: from
        start_masks(rows).

        A request with a seed gets the same token whatever else is in the batch and whichever
        process samples it. The logits tensor is not modified.
        """
        assert logits.dim() == 2 and logits.shape[0] == len(rows)
        params = [row.sampling for row in rows]
        indices = [_output_index(row) for row in rows]
        given = logits
        logits = self._penalize(logits, rows, params)
        logits = self._bias(logits, params)
        logits = self._ban_early_stop(logits, params, indices)
        if masks is not None:
            logits = logits.clone() if logits is given else logits  # the mask is applied in place
            self.guided.apply(logits, masks.bitmask.result(), masks.rows)  # type: ignore[union-attr]
        tokens = self._draw(logits, params, indices)
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        read = self._logprobs(logits, tokens, want, params) if want else ()
        return Drawn(tokens, want, [params[i].logprobs or 0 for i in want], len(rows), read)

    # ---- the logits a token is drawn from --------------------------------------------------------

    def _penalize(
        self, logits: Tensor, rows: Sequence[SampleRow], params: list[SamplingParams]
    ) -> Tensor:
        which = [i for i, p in enumerate(params) if p.penalized]
        if not which:
            return logits
        device = logits.device
        if device not in self._counts:
            self._counts[device] = TokenCounts(logits.shape[-1], device)
        counts = self._counts[device]
        slots = counts.update([rows[i] for i in which])
        picked = [params[i] for i in which]
        idx = torch.tensor(which, dtype=torch.int64).to(device, non_blocking=True)
        part = logits.index_select(0, idx)
        output = counts.output.index_select(0, slots)
        repetition = [p.repetition_penalty for p in picked]
        if any(r != 1.0 for r in repetition):
            # Hugging Face's RepetitionPenaltyLogitsProcessor: over prompt and output, divide a
            # positive logit, multiply a negative one.
            seen = counts.prompt.index_select(0, slots) | (output > 0)
            r = _column(repetition, device)
            part = torch.where(seen, torch.where(part > 0, part / r, part * r), part)
        frequency = [p.frequency_penalty for p in picked]
        presence = [p.presence_penalty for p in picked]
        if any(frequency) or any(presence):
            # OpenAI's: over the output only, frequency per occurrence, presence once.
            part = (
                part
                - _column(frequency, device) * output
                - _column(presence, device) * (output > 0)
            )
        return logits.index_copy(0, idx, part)

    def _bias(self, logits: Tensor, params: list[SamplingParams]) -> Tensor:
        rows: list[int] = []
        cols: list[int] = []
        values: list[float] = []
        for i, p in enumerate(params):
            for token, bias in p.logit_bias:
                rows.append(i)
                cols.append(token)
                values.append(bias)
        if not rows:
            return logits
        device = logits.device
        where = torch.tensor([rows, cols], dtype=torch.int64).to(device, non_blocking=True)
        add = torch.tensor(values, dtype=logits.dtype).to(device, non_blocking=True)
        return logits.index_put((where[0], where[1]), add, accumulate=True)

    def _ban_early_stop(
        self, logits: Tensor, params: list[SamplingParams], output_indices: list[int]
    ) -> Tensor:
        rows: list[int] = []
        cols: list[int] = []
        vocab = logits.shape[-1]
        for i, (p, index) in enumerate(zip(params, output_indices)):
            if index < p.min_tokens:
                # An id past the vocabulary can never be sampled, so there is nothing to ban (the
                # API refuses one).
                banned = [t for t in (*self.eos_token_ids, *p.stop_token_ids) if 0 <= t < vocab]
                rows += [i] * len(banned)
                cols += banned
        if not rows:
            return logits
        device = logits.device
        where = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
        return logits.index_put(where, torch.tensor(float("-inf"), device=device))

    # ---- the draw --------------------------------------------------------------------------------

    def _draw(
        self, logits: Tensor, params: list[SamplingParams], output_indices: list[int]
    ) -> Tensor:
        """The chosen ids, on the device."""
        greedy = [p.greedy for p in params]
        if all(greedy):
            return logits.argmax(dim=-1)
        device = logits.device
        temperature = _column([1.0 if p.greedy else p.temperature for p in params], device)
        scaled = self._min_p(logits / temperature, params)
        probs = self._top_k_top_p(scaled, params).softmax(dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws index i with probability p_i, no
        # multinomial.
        tokens = (probs / self._noise(probs, params, output_indices)).argmax(dim=-1)
        if any(greedy):
            tokens = torch.where(torch.tensor(greedy, device=device), logits.argmax(dim=-1), tokens)
        return tokens

    def _min_p(self, logits: Tensor, params: list[SamplingParams]) -> Tensor:
        """Drop tokens less likely than min_p times the most likely one: logit < max +
        log(min_p)."""
        if not any(p.min_p > 0.0 and not p.greedy for p in params):
            return logits
        floor = _column(
            [math.log(p.min_p) if p.min_p > 0.0 else -math.inf for p in params], logits.device
        )
        return logits.masked_fill(logits < logits.amax(dim=-1, keepdim=True) + floor, float("-inf"))

    def _top_k_top_p(self, logits: Tensor, params: list[SamplingParams]) -> Tensor:
        vocab, device = logits.shape[-1], logits.device
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [
            p.top_p if p.top_p < 1.0 else 2.0 for p in params
        ]  # 2.0: no cut, immune to cumsum rounding
        use_k, use_p = any(k < vocab for k in top_k), any(p < 1.0 for p in top_p)
        if not (use_k or use_p):
            return logits
        if all(k < vocab for k in top_k):
            # Every row keeps at most max(k) tokens: a partial sort is enough (top_k + top_p is the
            # common case).
            values, order = logits.topk(max(top_k), dim=-1)
        else:
            values, order = logits.sort(dim=-1, descending=True)
        if use_k:
            rank = torch.arange(values.shape[-1], device=device)
            values = values.masked_fill(rank >= _column(top_k, device), float("-inf"))
        if use_p:
            probs = values.softmax(dim=-1)
            # Keep a token while the mass above it is still short of top_p; the first always stays.
            values = values.masked_fill(
                probs.cumsum(dim=-1) - probs >= _column(top_p, device), float("-inf")
            )
        return torch.full_like(logits, float("-inf")).scatter_(-1, order, values)

    def _noise(
        self, probs: Tensor, params: list[SamplingParams], output_indices: list[int]
    ) -> Tensor:
        device = probs.device
        noise = torch.empty_like(probs)
        seeded = [i for i, p in enumerate(params) if p.seed is not None]
        if len(seeded) < len(params):
            if device not in self._shared:
                gen = self._shared[device] = torch.Generator(device)
                if self.seed is None:
                    gen.seed()  # the default seed is a constant: every process would draw alike
                else:
                    gen.manual_seed(self.seed)
            noise.exponential_(generator=self._shared[device])
        if seeded:
            if device not in self._seeded:
                self._seeded[device] = torch.Generator(device)
            gen = self._seeded[device]
            for i in seeded:
                gen.manual_seed(_mix(params[i].seed, output_indices[i]))  # type: ignore[arg-type]
                noise[i].exponential_(generator=gen)
        # exponential_ may return 0, and 0 / 0 would be NaN, which argmax picks.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)

    # ---- logprobs --------------------------------------------------------------------------------

    def _logprobs(
        self, logits: Tensor, tokens: Tensor, want: list[int], params: list[SamplingParams]
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """For rows `want`: the chosen token's logprob and rank, and the top alternatives (as many
        as the most any row asked for), from the distribution before temperature and the cuts;
        excluded tokens report NO_LOGPROB."""
        device = logits.device
        idx = torch.tensor(want, dtype=torch.int64).to(device, non_blocking=True)
        lp = logits.index_select(0, idx).log_softmax(dim=-1)
        k = max(params[i].logprobs or 0 for i in want)
        chosen, rank, top_lp, top_ids = read_logprobs(lp, tokens.index_select(0, idx), k)
        return chosen.clamp_min(NO_LOGPROB), rank, top_lp.clamp_min(NO_LOGPROB), top_ids


def read_logprobs(lp: Tensor, tokens: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """From log-probabilities [N, vocab] and a token per row (int64 [N]): each token's logprob and
    rank (1: the most likely), and each row's k most likely (logprobs and ids, [N, k]); on the
    device."""
    chosen = lp.gather(1, tokens.unsqueeze(1))
    rank = (lp > chosen).sum(dim=-1) + 1
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], tokens[:, None][:, :0])
    return chosen.squeeze(1), rank, top_lp, top_ids


def token_logprobs(
    chosen: Tensor, rank: Tensor, top_lp: Tensor, top_ids: Tensor, tops: list[int]
) -> list[TokenLogprobs]:
    """read_logprobs' rows on the host, row i keeping its first tops[i] alternatives (one copy per
    tensor)."""
    c, r, lp, ids = chosen.tolist(), rank.tolist(), top_lp.tolist(), top_ids.tolist()
    return [TokenLogprobs(c[i], r[i], ids[i][:n], lp[i][:n]) for i, n in enumerate(tops)]


class Drawn:
    """A step's drawn tokens on the device (`tokens`, which the next step may read there) and their
    copy to the host under way, with the logprobs asked for; host() waits for the copy, and for
    nothing queued after it."""

    def __init__(
        self,
        tokens: Tensor,
        want: list[int],
        tops: list[int],
        num_rows: int,
        read: tuple[Tensor, ...] = (),
    ) -> None:
        self.tokens, self.want, self.tops, self.num_rows = tokens, want, tops, num_rows
        self.event: torch.cuda.Event | None = None
        if tokens.is_cuda:
            self._copies = [_pinned_copy(t) for t in (tokens, *read)]
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self._copies = [tokens, *read]

    def host(self) -> Sampled:
        """The tokens and logprobs as lists. On a GPU it waits on the copies' event, which lets go
        of the GIL: in a one-process unit the other worker's thread keeps feeding its stream
        meanwhile."""
        if self.event is not None:
            self.event.synchronize()
        tokens, *read = self._copies
        logprobs: list[TokenLogprobs | None] = [None] * self.num_rows
        if read:
            for i, lp in zip(self.want, token_logprobs(*read, self.tops)):
                logprobs[i] = lp
        return Sampled(tokens.tolist(), logprobs)


def _pinned_copy(t: Tensor) -> Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
