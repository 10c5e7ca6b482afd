"""The `agentic` workload: coding-agent sessions synthesized from a seed as the lines of a
Mooncake-format trace, read back through bench/traces.py as a trace file is (`ppd bench trace-gen`
writes them to one).

A session opens with a system-and-tools prefix that every session shares (the same hash ids: a
prefix-cache hit across sessions) and the user's task; each later turn adds a tool's result, or in a
minority of turns a person's message, after a pause; every answer is short. Lengths are drawn at
full scale and then scaled (`scale`; by default so that the longest session fits the server's
context), and a session ends before any turn whose prompt and answer would not fit the context.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.client import Conversation
from bench.common import TRACE_BLOCK_SIZE, BenchError
from bench.traces import parse_trace, trace_conversations, trace_line

# Full-scale shapes, from published measurements of coding agents (docs/benchmarks.md#agentic):
# - vLLM's AgentX write-up (2026-09): median 43 turns a session; 142K input and 444 output tokens
#   a request; over 95% of each prompt a prefix hit; tool pauses about 2 s, human pauses 25 s+;
# - Codex traces on SWE-bench Pro (vLLM x Mooncake, 2026-05-06): context about 80K tokens by turn
#   30, a few hundred to a few thousand new tokens a turn, input:output about 131:1;
# - Mooncake's Tool&Agent trace: the format (512-token blocks of hash ids, ms timestamps).
# Lognormal draws: (median, sigma, least, most). With these, turn 30 holds about 80K tokens, answers
# average about 445 and prompts over answers come to about 155:1, between the sources' 131:1 and
# 320:1 (tests/bench/test_agentic.py checks them).
PREFIX_TOKENS = 8192  # the system prompt and tool definitions, shared by every session
TURNS = (43, 0.35, 4, 200)
TASK = (300, 0.7, 16, 4096)  # the user's first message, after the prefix
TOOL_RESULT = (1500, 0.9, 64, 16384)
HUMAN_MESSAGE = (150, 0.7, 8, 2048)
ANSWER = (300, 0.9, 8, 4096)  # mean about 445
HUMAN_SHARE = 0.1  # of later turns, those after a person rather than a tool
TOOL_PAUSE = (2.0, 0.5)  # seconds: median, sigma
HUMAN_PAUSE = (25.0, 30.0)  # seconds: the least, and the mean of an exponential beyond it
SESSION_RATE = 0.2  # sessions started per second of trace time (Poisson)


@dataclass
class SessionShape:
    """A session at full scale: its start (s) and its turns' (new input tokens, answer tokens,
    pause s); the first turn's input is the task, without the prefix."""

    start: float
    turns: list[tuple[int, int, float]]


def _lognormal(rng: random.Random, median: float, sigma: float, least: int, most: int) -> int:
    return min(most, max(least, round(rng.lognormvariate(math.log(median), sigma))))


def draw_sessions(
    num_sessions: int, seed: int, session_rate: float = SESSION_RATE
) -> list[SessionShape]:
    """num_sessions sessions at full scale, in order of their start, the same for the same seed."""
    if num_sessions < 1 or session_rate <= 0:
        raise ValueError(
            f"need at least 1 session and a session rate > 0; got {num_sessions}, {session_rate}"
        )
    rng = random.Random(seed)
    sessions, start = [], 0.0
    for _ in range(num_sessions):
        turns = [(_lognormal(rng, *TASK), _lognormal(rng, *ANSWER), 0.0)]
        for _ in range(_lognormal(rng, *TURNS) - 1):
            if rng.random() < HUMAN_SHARE:
                pause = HUMAN_PAUSE[0] + rng.expovariate(1 / HUMAN_PAUSE[1])
                new = _lognormal(rng, *HUMAN_MESSAGE)
            else:
                pause = rng.lognormvariate(math.log(TOOL_PAUSE[0]), TOOL_PAUSE[1])
                new = _lognormal(rng, *TOOL_RESULT)
            turns.append((new, _lognormal(rng, *ANSWER), pause))
        sessions.append(SessionShape(start, turns))
        start += rng.expovariate(session_rate)
    return sessions


def _prefix(scale: float, block_size: int) -> int:
    """The shared prefix's tokens at a scale: whole blocks (at least one), so that all its hash ids
    are shared."""
    if block_size < 1:
        raise ValueError(f"the trace block size must be at least 1 token, not {block_size}")
    return block_size * max(1, round(PREFIX_TOKENS * scale / block_size))


def _scaled(n: int, scale: float) -> int:
    return max(1, int(n * scale))


def fitted_scale(sessions: list[SessionShape], context: int | None, block_size: int) -> float:
    """The scale (at most 1) at which the longest session's last prompt and answer fit `context`
    tokens (1 without a context)."""
    longest = max(sum(n_in + n_out for n_in, n_out, _ in s.turns) for s in sessions)
    if context is None or PREFIX_TOKENS + longest <= context:
        return 1.0
    scale = context / (PREFIX_TOKENS + longest)
    for _ in range(3):  # the prefix is whole blocks, so it moves in steps as the scale does
        room = context - _prefix(scale, block_size)
        if room <= 0:
            raise ValueError(
                f"a context of {context} tokens leaves no room beside the shared prefix's block of "
                f"{block_size} tokens: lower --trace-block-size"
            )
        scale = min(1.0, room / longest)
    return scale


def agentic_trace(
    num_conversations: int,
    seed: int,
    scale: float | None = None,
    context: int | None = None,
    block_size: int = TRACE_BLOCK_SIZE,
    session_rate: float = SESSION_RATE,
) -> list[str]:
    """The sessions as trace lines (no newlines): a first turn at its session's `timestamp` (ms),
    later turns after their `delay` (s); hash ids 0.. are the shared prefix's blocks, every other
    block is new. Lengths are times `scale` (rounded down, at least 1; default: fitted_scale), and a
    session ends before a turn whose prompt and answer pass `context`."""
    sessions = draw_sessions(num_conversations, seed, session_rate)
    scale = fitted_scale(sessions, context, block_size) if scale is None else scale
    if scale <= 0:
        raise ValueError(f"the scale must be > 0, not {scale}")
    prefix = _prefix(scale, block_size)
    shared = list(range(prefix // block_size))
    next_id, lines = len(shared), []
    for i, session in enumerate(sessions):
        used = 0  # tokens of context the session's prompts and answers have taken so far
        for k, (n_in, n_out, pause) in enumerate(session.turns):
            n_in, n_out = _scaled(n_in, scale) + (prefix if k == 0 else 0), _scaled(n_out, scale)
            if context is not None and used + n_in + n_out > context:
                break
            fresh = -(-(n_in - prefix if k == 0 else n_in) // block_size)
            hash_ids = (shared if k == 0 else []) + list(range(next_id, next_id + fresh))
            next_id += fresh
            time = (
                {"timestamp": round(session.start * 1000)} if k == 0 else {"delay": round(pause, 3)}
            )
            lines.append(trace_line(f"agentic-{seed}-{i}", time, n_in, n_out, hash_ids))
            used += n_in + n_out
        if not used:
            raise ValueError(
                f"at scale {scale:g} a session's first turn needs more than the context of "
                f"{context} tokens: lower --scale, or leave it out to fit the context"
            )
    return lines


def agentic(
    num_conversations: int,
    seed: int,
    scale: float | None = None,
    context: int | None = None,
    block_size: int = TRACE_BLOCK_SIZE,
    session_rate: float = SESSION_RATE,
) -> list[Conversation]:
    """The agentic sessions (agentic_trace) as Conversations of token ids, read as a trace: the
    same as `--workload trace:FILE` gives for the file `ppd bench trace-gen` writes."""
    lines = agentic_trace(num_conversations, seed, scale, context, block_size, session_rate)
    return trace_conversations(parse_trace(lines, "agentic", block_size), seed, block_size)


# --- ppd bench trace-gen ------------------------------------------------------------------------


def main(args: argparse.Namespace) -> None:
    """`ppd bench trace-gen`: write the agentic sessions as a Mooncake-format JSONL trace."""
    rate = SESSION_RATE if args.session_rate is None else args.session_rate
    try:
        scale = args.scale
        if scale is None:
            sessions = draw_sessions(args.num_conversations, args.seed, rate)
            scale = fitted_scale(sessions, args.max_model_len, args.trace_block_size)
        lines = agentic_trace(
            args.num_conversations,
            args.seed,
            scale,
            args.max_model_len,
            args.trace_block_size,
            rate,
        )
        Path(args.out).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    except (OSError, ValueError) as exc:
        raise BenchError(str(exc)) from exc
    print(
        f"wrote {len(lines)} turns of {args.num_conversations} sessions to {args.out} (scale "
        f"{scale:g}, {args.trace_block_size} tokens a hash id)",
        file=sys.stderr,
    )
