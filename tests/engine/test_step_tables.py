"""A step's block tables, padded once (StepBatch.padded_tables), as each backend lays them out: the
Triton layout's rows (decode slots, then the general grid's, at its width) and the CPU kernels' rows
hold each sequence's blocks in order, whatever the lengths."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine.attention.base import StepBatch, pad_tables
from engine.attention.cpu_backend import Rows
from engine.attention.triton_backend import Layout, _align


def batch(tables: list[list[int]], decodes: int) -> StepBatch:
    """decodes sequences of one new token, then sequences of three; contexts that fill each table's
    last block."""
    news = [1] * decodes + [3] * (len(tables) - decodes)
    starts = [0]
    for n in news:
        starts.append(starts[-1] + n)
    lens = [16 * (len(t) - 1) + 1 for t in tables]
    return StepBatch(
        token_ids=[0] * starts[-1],
        positions=[0] * starts[-1],
        slot_mapping=[0] * starts[-1],
        query_start=starts,
        seq_lens=lens,
        block_tables=tables,
        sample_rows=[],
        block_size=16,
        num_decodes=decodes,
    )


def random_tables(rng: random.Random, n: int) -> list[list[int]]:
    return [[rng.randrange(1, 1000) for _ in range(rng.randrange(1, 9))] for _ in range(n)]


def test_pad_tables_keeps_each_table_and_pads_with_block_zero() -> None:
    rng = random.Random(0)
    tables = random_tables(rng, 7)
    padded = pad_tables(tables)
    assert padded.dtype == np.int32 and padded.shape == (7, max(map(len, tables)))
    for row, table in zip(padded, tables):
        assert row[: len(table)].tolist() == table and not row[len(table) :].any()
    step = batch(tables, 3)
    assert step.padded_tables() is step.padded_tables(), "built once a step"


@pytest.mark.parametrize(
    "decodes,others,extra_width", [(5, 0, 0), (3, 4, 0), (0, 3, 0), (6, 2, 5), (1, 1, 9)]
)
def test_the_triton_layout_holds_each_table_in_its_slot(
    decodes: int, others: int, extra_width: int
) -> None:
    rng = random.Random(decodes * 10 + others)
    tables = random_tables(rng, decodes + others)
    step = batch(tables, decodes)
    aligned = _align(decodes) if others else decodes
    width = (
        step.padded_tables().shape[1] + extra_width
    )  # a graph's layout is as wide as max_model_len allows
    layout = Layout.tight(aligned + others, aligned, len(step.token_ids), width)
    host = np.full(layout.size, -7, np.int32)
    layout.write(host, step, decodes, len(step.token_ids), decode_bucket=False)
    rows = host[layout.tables_at : layout.size].reshape(layout.seqs, width)
    slots = list(range(decodes)) + list(range(aligned, aligned + others))
    for slot, table in zip(slots, tables):
        assert rows[slot, : len(table)].tolist() == table


def test_the_cpu_kernels_rows_hold_their_sequences_tables() -> None:
    rng = random.Random(1)
    tables = random_tables(rng, 6)
    step = batch(tables, 4)
    for seqs in ([0, 1, 2, 3], [4, 5], [1, 5]):
        rows = Rows.of(step, seqs)
        assert rows.tables.shape == (len(seqs), max(len(tables[i]) for i in seqs))
        for row, i in zip(rows.tables.tolist(), seqs):
            assert row[: len(tables[i])] == tables[i]
