"""The agentic workload: sessions from a seed, their shared prefix, pauses and lengths, their fit to
a context, and the shipped trace it regenerates."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from bench.agentic import PREFIX_TOKENS, agentic, agentic_trace, draw_sessions, fitted_scale
from bench.client import Conversation
from bench.traces import block_tokens, trace
from bench.workloads import load_workload

SHIPPED = Path(__file__).parents[2] / "bench" / "data" / "agentic_seed0.jsonl"
# The command docs/benchmarks.md names for the shipped file (its --out aside).
SHIPPED_ARGS = ["--seed", "0", "--num-conversations", "4", "--max-model-len", "4096"]


def prompts(conv: Conversation) -> list[int]:
    """Each turn's prompt tokens: the history (inputs and exact answers) and its new input."""
    out, used = [], 0
    for t in conv.turns:
        out.append(used + len(t.user))
        used += len(t.user) + t.max_tokens
    return out


def test_the_same_seed_gives_the_same_sessions_and_another_seed_others() -> None:
    first = agentic(3, seed=1, scale=0.01, block_size=64)
    assert first == agentic(3, seed=1, scale=0.01, block_size=64)
    assert first != agentic(3, seed=2, scale=0.01, block_size=64)
    assert [c.id for c in first] == ["agentic-1-0", "agentic-1-1", "agentic-1-2"]
    assert [c.start for c in first] == sorted(c.start for c in first) and first[0].start == 0.0
    assert all(c.ignore_eos and all(isinstance(t.user, list) for t in c.turns) for c in first)
    assert load_workload("agentic", num_conversations=3, seed=1, scale=0.01, block_size=64) == first


def test_every_session_opens_with_the_same_prefix_of_whole_blocks() -> None:
    block = 64
    convs = agentic(5, seed=0, scale=0.05, block_size=block)
    prefix = block * round(PREFIX_TOKENS * 0.05 / block)  # 410 tokens: 6 blocks of 64
    shared = [i for h in range(prefix // block) for i in block_tokens(h, 0, block)]
    for conv in convs:
        assert conv.turns[0].user[:prefix] == shared
    # After it, the task: each session's own.
    tasks = {tuple(c.turns[0].user[prefix : prefix + 8]) for c in convs}
    assert len(tasks) == len(convs)
    first_lines = [json.loads(line) for line in agentic_trace(5, 0, 0.05, None, block)]
    assert first_lines[0]["hash_ids"][: prefix // block] == list(range(prefix // block))


def test_pauses_are_a_tools_seconds_and_now_and_then_a_persons_minute() -> None:
    sessions = draw_sessions(100, seed=0)
    assert all(s.turns[0][2] == 0.0 for s in sessions)
    pauses = [pause for s in sessions for _, _, pause in s.turns[1:]]
    human = [p for p in pauses if p >= 25]
    assert 0.05 < len(human) / len(pauses) < 0.15  # a minority
    tool = [p for p in pauses if p < 25]
    assert 1.5 < statistics.median(tool) < 2.7 and min(tool) > 0
    assert statistics.median(human) > 30


def test_full_scale_sessions_have_the_published_shape() -> None:
    """Median 43 turns, about 80K tokens of context by turn 30, answers of about 444 tokens, over
    95% of a later prompt what earlier turns computed, prompts over answers within the published
    131:1 (Codex) to 320:1 (AgentX's 142K and 444 tokens a request)."""
    sessions = draw_sessions(300, seed=0)
    assert 40 <= statistics.median(len(s.turns) for s in sessions) <= 46
    prompt_sum = output_sum = history_sum = turn30 = 0
    turn30s = []
    for s in sessions:
        used = 0
        for k, (n_in, n_out, _) in enumerate(s.turns):
            prompt = used + n_in + (PREFIX_TOKENS if k == 0 else 0)
            prompt_sum, output_sum = prompt_sum + prompt, output_sum + n_out
            history_sum += used
            if k == 29:
                turn30s.append(prompt)
            used = prompt + n_out
    turn30 = statistics.median(turn30s)
    assert 70_000 < turn30 < 90_000
    assert 131 <= prompt_sum / output_sum <= 320
    assert 400 < output_sum / sum(len(s.turns) for s in sessions) < 500
    assert history_sum / prompt_sum > 0.95


@pytest.mark.parametrize("context", [2048, 4096, 8192, 32768])
def test_fitted_to_a_context_every_prompt_and_answer_fit_and_the_longest_nearly_fills_it(
    context: int,
) -> None:
    convs = agentic(12, seed=4, context=context, block_size=64)
    ends = [prompts(c)[-1] + c.turns[-1].max_tokens for c in convs]
    assert max(ends) <= context and max(ends) > 0.9 * context
    assert statistics.median(len(c.turns) for c in convs) > 30  # no session was cut short
    # A scale too large for the context: sessions end before the turn that would not fit.
    scale = 3 * fitted_scale(draw_sessions(12, seed=4), context, block_size=64)
    capped = agentic(12, seed=4, scale=scale, context=context, block_size=64)
    for conv in capped:
        assert prompts(conv)[-1] + conv.turns[-1].max_tokens <= context
    assert sum(len(c.turns) for c in capped) < sum(len(c.turns) for c in convs)


def test_a_context_too_small_for_the_prefix_or_the_first_turn_is_refused() -> None:
    with pytest.raises(ValueError, match="--trace-block-size"):
        agentic(2, seed=0, context=500, block_size=512)
    with pytest.raises(ValueError, match="lower --scale"):
        agentic(2, seed=0, scale=1.0, context=4096)


def test_the_shipped_trace_is_what_trace_gen_makes_from_its_seed(tmp_path: Path) -> None:
    out = tmp_path / "agentic.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "cli", "bench", "trace-gen", "--out", str(out), *SHIPPED_ARGS],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert out.read_text() == SHIPPED.read_text()
    convs = trace(str(SHIPPED), num_conversations=None, seed=0)
    assert len(convs) == 4 and all(len(c.turns) >= 12 for c in convs)
    assert all(prompts(c)[-1] + c.turns[-1].max_tokens <= 4096 for c in convs)
    # The same Conversations as the workload, which reads its lines as a trace.
    assert convs == agentic(4, seed=0, context=4096)
