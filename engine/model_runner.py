"""One model step over a batch of sequences (prefills, append-prefills, prefill chunks and decodes mixed)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.attention import AttentionMetadata
from engine.model import Model


@dataclass
class StepInput:
    """One sequence's share of a step: the tokens whose KV is computed now, on top of start_pos cached ones."""

    token_ids: list[int]  # at least 1
    start_pos: int  # tokens of this sequence already in the KV cache
    block_table: list[int]  # blocks covering at least start_pos + len(token_ids) tokens
    sample: bool = True  # return logits for the last token of this input


class ModelRunner:
    """Runs one step of the model over a batch of StepInputs against a paged KV pool."""

    def __init__(self, model: Model, kv_pool: Tensor, block_size: int) -> None:
        assert kv_pool.shape[3] == block_size, "kv_pool was built for another block size"
        self.model, self.block_size, self.device = model, block_size, kv_pool.device
        model.bind_kv_cache(kv_pool)

    @torch.inference_mode()
    def forward(self, inputs: list[StepInput]) -> Tensor:
        """float32 logits [number of inputs with sample=True, vocab], in input order."""
        assert inputs, "a step needs at least one input"
        bs, max_len = self.block_size, self.model.cfg.max_position_embeddings
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start, context_lens, sample_rows = [0], [], []
        for inp in inputs:
            end = inp.start_pos + len(inp.token_ids)
            assert inp.token_ids and len(inp.block_table) * bs >= end, "empty input or block table too short"
            assert end <= max_len, f"sequence longer than max_position_embeddings ({max_len})"
            token_ids += inp.token_ids
            positions += range(inp.start_pos, end)
            slots += [inp.block_table[p // bs] * bs + p % bs for p in range(inp.start_pos, end)]
            query_start.append(len(token_ids))
            context_lens.append(end)
            if inp.sample:
                sample_rows.append(len(token_ids) - 1)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            query_start=query_start,
            context_lens=context_lens,
            block_tables=[inp.block_table for inp in inputs],
            block_size=bs,
        )
        hidden = self.model(self._tensor(token_ids), self._tensor(positions), meta)
        return self.model.compute_logits(hidden[self._tensor(sample_rows)])

    def _tensor(self, values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)
