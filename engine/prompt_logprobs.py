"""Logprobs of a prompt's own tokens (vLLM's prompt_logprobs, the completions API's echo): what the model gave each
prompt token, from the hidden states of the position before it.

These are the model's raw log-probabilities (no penalty, bias or grammar applies to a prompt). The logits are made
a slice of rows at a time, so a long prompt chunk never holds more [rows, vocab] logits than a sampling step does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.model import Model
from engine.model_runner import PromptLogprobsAsk
from engine.sampling_params import TokenLogprobs


def prompt_logprobs(model: Model, hidden: Tensor, asks: list[tuple[int, PromptLogprobsAsk]],
                    rows_per_slice: int) -> dict[int, list[TokenLogprobs]]:
    """hidden: the kept hidden states of a step (ModelRunner.run), the asks' rows in order; asks: (input position,
    its ask). Returns each input position's logprobs, one per target. One copy to the host at the end."""
    targets = torch.tensor([t for _, ask in asks for t in ask.targets], dtype=torch.int64).to(hidden.device)
    assert targets.shape[0] == hidden.shape[0], "one hidden row per target"
    k = max(ask.top for _, ask in asks)
    chosen, rank, top_lp, top_ids = [], [], [], []
    for start in range(0, hidden.shape[0], rows_per_slice):
        lp = model.compute_logits(hidden[start:start + rows_per_slice]).log_softmax(dim=-1)
        got = lp.gather(1, targets[start:start + rows_per_slice].unsqueeze(1))
        chosen.append(got.squeeze(1))
        rank.append((lp > got).sum(dim=-1) + 1)
        if k:
            values, ids = lp.topk(k, dim=-1)
            top_lp.append(values)
            top_ids.append(ids)
    chosen_l, rank_l = torch.cat(chosen).tolist(), torch.cat(rank).tolist()
    top_lp_l = torch.cat(top_lp).tolist() if k else [[]] * len(chosen_l)
    top_ids_l = torch.cat(top_ids).tolist() if k else [[]] * len(chosen_l)
    out, row = {}, 0
    for pos, ask in asks:
        n = len(ask.targets)
        out[pos] = [TokenLogprobs(chosen_l[r], rank_l[r], top_ids_l[r][:ask.top], top_lp_l[r][:ask.top])
                    for r in range(row, row + n)]
        row += n
    return out
