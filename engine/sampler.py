"""Pick the next token of each request from its logits row, without a device sync until the result."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from engine.sampling_params import SamplingParams

_M64 = (1 << 64) - 1


def _mix(seed: int, index: int) -> int:
    """A 64-bit generator seed from (seed, output index), via splitmix64's finalizer.

    Plain seed + index would give request (s, i + 1) the noise of (s + 1, i): neighbouring seeds correlated.
    """
    z = (seed * 0x9E3779B97F4A7C15 + index) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _column(values: list[float] | list[int], device: torch.device) -> Tensor | float | int:
    """values as a [B, 1] tensor, or one scalar when every row agrees (the common case: cheaper ops)."""
    if all(v == values[0] for v in values):
        return values[0]
    return torch.tensor(values, device=device).unsqueeze(1)


class Sampler:
    """Greedy, temperature, top-k and top-p sampling with per-request seeds and min_tokens."""

    def __init__(self, eos_token_ids: Sequence[int]) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self._shared: dict[torch.device, torch.Generator] = {}  # for requests without a seed
        self._seeded: dict[torch.device, torch.Generator] = {}  # reseeded per row

    def __call__(self, logits: Tensor, params: list[SamplingParams], output_indices: list[int]) -> list[int]:
        """logits: float32 [B, vocab], one row per request; params[i] its sampling params; output_indices[i] the
        index of the token being sampled in that request's output (0 for the first). Returns one token id per row.

        A request with a seed gets the same token whatever else is in the batch and whichever process samples it.
        """
        assert logits.dim() == 2 and logits.shape[0] == len(params) == len(output_indices)
        logits = self._ban_early_stop(logits, params, output_indices)
        greedy = [p.greedy for p in params]
        if all(greedy):
            return _to_host(logits.argmax(dim=-1))
        device = logits.device
        temperature = _column([1.0 if p.greedy else p.temperature for p in params], device)
        probs = self._top_k_top_p(logits / temperature, params).softmax(dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws index i with probability p_i, no multinomial.
        tokens = (probs / self._noise(probs, params, output_indices)).argmax(dim=-1)
        if any(greedy):
            tokens = torch.where(torch.tensor(greedy, device=device), logits.argmax(dim=-1), tokens)
        return _to_host(tokens)

    def _ban_early_stop(self, logits: Tensor, params: list[SamplingParams], output_indices: list[int]) -> Tensor:
        rows: list[int] = []
        cols: list[int] = []
        vocab = logits.shape[-1]
        for i, (p, index) in enumerate(zip(params, output_indices)):
            if index < p.min_tokens:
                # An id past the vocabulary can never be sampled, so there is nothing to ban (the API refuses one).
                banned = [t for t in (*self.eos_token_ids, *p.stop_token_ids) if 0 <= t < vocab]
                rows += [i] * len(banned)
                cols += banned
        if not rows:
            return logits
        device = logits.device
        where = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
        return logits.index_put(where, torch.tensor(float("-inf"), device=device))

    def _top_k_top_p(self, logits: Tensor, params: list[SamplingParams]) -> Tensor:
        vocab, device = logits.shape[-1], logits.device
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p if p.top_p < 1.0 else 2.0 for p in params]  # 2.0: no cut, immune to cumsum rounding
        use_k, use_p = any(k < vocab for k in top_k), any(p < 1.0 for p in top_p)
        if not (use_k or use_p):
            return logits
        if all(k < vocab for k in top_k):
            # Every row keeps at most max(k) tokens: a partial sort is enough (top_k + top_p is the common case).
            values, order = logits.topk(max(top_k), dim=-1)
        else:
            values, order = logits.sort(dim=-1, descending=True)
        if use_k:
            rank = torch.arange(values.shape[-1], device=device)
            values = values.masked_fill(rank >= _column(top_k, device), float("-inf"))
        if use_p:
            probs = values.softmax(dim=-1)
            # Keep a token while the mass above it is still short of top_p; the first always stays.
            values = values.masked_fill(probs.cumsum(dim=-1) - probs >= _column(top_p, device), float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter_(-1, order, values)

    def _noise(self, probs: Tensor, params: list[SamplingParams], output_indices: list[int]) -> Tensor:
        device = probs.device
        noise = torch.empty_like(probs)
        seeded = [i for i, p in enumerate(params) if p.seed is not None]
        if len(seeded) < len(params):
            if device not in self._shared:
                self._shared[device] = torch.Generator(device)
                self._shared[device].seed()  # the default seed is a constant: every process would draw alike
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


def _to_host(tokens: Tensor) -> list[int]:
    """The sampled ids as a list. On a GPU the wait for the step comes first, as a stream synchronize, which lets go
    of the GIL: in a one-process unit the other worker's thread keeps feeding its stream meanwhile."""
    if tokens.is_cuda:
        torch.cuda.current_stream(tokens.device).synchronize()
    return tokens.tolist()
