"""bench.moe_inline: each point's inline cost predicted from the costs the others fit, with and
without the experts an append adds; the tiny model it measures is a mixture of experts."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.moe_inline import predict, summary, write_tiny
from engine.config import ModelConfig


def test_the_tiny_model_is_a_mixture_of_experts(tmp_path: Path) -> None:
    mcfg = ModelConfig.from_folder(write_tiny(tmp_path))
    assert (mcfg.is_moe, len(mcfg.moe_layers), mcfg.num_experts, mcfg.vocab_size) == (
        True,
        4,
        32,
        2048,
    )


def test_leave_one_out_predicts_a_step_of_tokens_and_experts_exactly(tmp_path: Path) -> None:
    """Steps that cost 0.02 ms a token and 0.1 ms an added expert: every held-out point is
    predicted exactly with the experts, and the per-token cost alone misses the small batches'."""
    mcfg = ModelConfig.from_folder(write_tiny(tmp_path))
    points = []
    for batch in (1, 4, 16):
        for new in (8, 32, 128):
            added = mcfg.expected_experts(batch + new) - mcfg.expected_experts(batch)
            points.append(
                {
                    "batch": batch,
                    "new": new,
                    "decode_ms": 5.0,
                    "mixed_ms": 5.0 + 0.02 * new + 0.1 * added,
                }
            )
    predict(points, mcfg)
    for p in points:
        assert p["moe_ms"] == pytest.approx(p["extra_ms"], rel=1e-6)
    totals = summary(points)
    assert totals["moe_ms"]["max_step_error"] < 1e-6
    assert totals["per_token_ms"]["median_error"] > 0.5
