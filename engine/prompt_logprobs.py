"""Logprobs of a prompt's own tokens (vLLM's prompt_logprobs, the completions API's echo): what the
model gave each prompt token, from the hidden states of the position before it.

These are the model's raw log-probabilities (no penalty, bias or grammar applies to a prompt). The
logits are made a slice of rows at a time, so a long prompt chunk never holds more [rows, vocab]
logits than a sampling step does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.attention.base import Ops
from engine.model import Model
from engine.model_runner import PromptLogprobsAsk
from engine.sampler import read_logprobs, token_logprobs
from engine.sampling_params import TokenLogprobs


def prompt_logprobs(
    model: Model,
    ops: Ops,
    hidden: Tensor,
    asks: list[tuple[int, PromptLogprobsAsk]],
    rows_per_slice: int,
) -> dict[int, list[TokenLogprobs]]:
    """hidden: the kept hidden states of a step (ModelRunner.run), the asks' rows in order; asks:
    (input position, its ask). Returns each input position's logprobs, one per target. One copy to
    the host at the end."""
    targets = torch.tensor([t for _, ask in asks for t in ask.targets], dtype=torch.int64).to(
        hidden.device
    )
    assert targets.shape[0] == hidden.shape[0], "one hidden row per target"
    k = max(ask.top for _, ask in asks)
    slices = []
    for start in range(0, hidden.shape[0], rows_per_slice):
        lp = model.compute_logits(hidden[start : start + rows_per_slice], ops).log_softmax(dim=-1)
        slices.append(read_logprobs(lp, targets[start : start + rows_per_slice], k))
    rows = token_logprobs(
        *(torch.cat(parts) for parts in zip(*slices)),
        [ask.top for _, ask in asks for _ in ask.targets],
    )
    out, row = {}, 0
    for pos, ask in asks:
        out[pos] = rows[row : row + len(ask.targets)]
        row += len(ask.targets)
    return out
