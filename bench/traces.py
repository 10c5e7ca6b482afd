"""Mooncake-format traces for `ppd bench --workload trace:FILE`: read and check them, turn their
sessions into Conversations of token ids, and write their lines (for the agentic workload).

A trace is JSONL, one turn a line (docs/benchmarks.md#the-trace-format): `session_id` (a string or
an integer; without one, the line is a one-turn session of its own), `input_length` (the turn's new
tokens), `output_length`, `hash_ids` (the ids of the turn's token blocks) and its time, `timestamp`
(milliseconds since the trace's start, Mooncake's unit) or `delay` (seconds after the previous turn
of the session was answered; on a session's first line, after the trace's start). A session's turns
are its lines in file order.

Equal hash ids give equal blocks, so the server's prefix cache sees the sharing the trace encodes:
hash id h is `block_size` token ids drawn from RANDOM_ID_RANGE by a generator seeded with (seed, h).
A turn's new input is the blocks of its last ceil(input_length / block_size) hash ids, cut to
input_length (Mooncake's hash ids cover the whole prompt, whose history here is the conversation's
own).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.client import Conversation, Turn
from bench.common import RANDOM_ID_RANGE, TRACE_BLOCK_SIZE

log = logging.getLogger("ppd.bench")

EXAMPLE = (
    '{"session_id": "s1", "timestamp": 0, "input_length": 700, "output_length": 40, '
    '"hash_ids": [0, 1]}'
)
MEANING = {
    "input_length": "the turn's new tokens",
    "output_length": "the answer's tokens",
    "hash_ids": "the ids of the turn's token blocks",
}
_TOKEN_IDS = range(*RANDOM_ID_RANGE)


@dataclass
class TraceTurn:
    input_length: int
    output_length: int
    hash_ids: list[int]
    pause: float  # seconds after the previous turn was answered (0 for a session's first)


@dataclass
class TraceSession:
    id: str
    start: float  # seconds from the trace's start
    turns: list[TraceTurn]


def parse_trace(
    lines: Iterable[str], name: str, block_size: int = TRACE_BLOCK_SIZE
) -> list[TraceSession]:
    """The sessions of a trace's lines, in order of their first line; a ValueError names the file
    (`name`), the line, the field and the fix of the first bad line."""
    if block_size < 1:
        raise ValueError(f"the trace block size must be at least 1 token, not {block_size}")
    sessions: dict[str, TraceSession] = {}
    times: dict[str, float] = {}  # each session's last turn, in seconds of trace time
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{name}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{where}: not JSON ({exc.msg}); a line is one turn, e.g. {EXAMPLE}"
            ) from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: not a JSON object; a line is one turn, e.g. {EXAMPLE}")
        turn = _turn(obj, where, block_size)
        sid = _session_id(obj, where) or f"line{lineno}"
        at = _time(obj, where, times.get(sid))
        if sid not in sessions:
            sessions[sid] = TraceSession(sid, at, [])
        elif at < times[sid]:
            raise ValueError(
                f"{where}: timestamp {at * 1000:g} ms is before the previous turn of session "
                f"{sid!r} ({times[sid] * 1000:g} ms): put a session's lines in time order"
            )
        else:
            turn.pause = at - times[sid]
        sessions[sid].turns.append(turn)
        times[sid] = at
    return list(sessions.values())


def _turn(obj: dict, where: str, block_size: int) -> TraceTurn:
    """A line's lengths and hash ids, checked."""
    for field in MEANING:
        if field not in obj:
            raise ValueError(
                f"{where}: missing field {field!r} ({MEANING[field]}); add it, e.g. {EXAMPLE}"
            )
    lengths = []
    for field in ("input_length", "output_length"):
        value = obj[field]
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{where}: {field} must be a whole number of tokens, not {value!r}")
        if value < 1:
            raise ValueError(f"{where}: {field} is {value}; a turn needs at least 1 token there")
        lengths.append(value)
    hash_ids = obj["hash_ids"]
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in hash_ids
    ):
        raise ValueError(f"{where}: hash_ids must be a list of integers (block ids), e.g. [0, 1]")
    if len(hash_ids) * block_size < lengths[0]:
        raise ValueError(
            f"{where}: {len(hash_ids)} hash ids cover {len(hash_ids) * block_size} tokens at "
            f"{block_size} a block, fewer than input_length {lengths[0]}: give the trace's block "
            "size with --trace-block-size"
        )
    return TraceTurn(lengths[0], lengths[1], hash_ids, pause=0.0)


def _session_id(obj: dict, where: str) -> str | None:
    sid = obj.get("session_id")
    if sid is not None and (not isinstance(sid, (str, int)) or isinstance(sid, bool)):
        raise ValueError(f"{where}: session_id must be a string or an integer, not {sid!r}")
    return None if sid is None else str(sid)


def _time(obj: dict, where: str, previous: float | None) -> float:
    """A line's trace time in seconds: its timestamp, or its delay after the session's previous
    turn (after the trace's start for a first turn)."""
    if ("timestamp" in obj) == ("delay" in obj):
        what = "both timestamp and delay" if "delay" in obj else "missing field timestamp or delay"
        raise ValueError(
            f"{where}: {what}; give one: timestamp (ms since the trace's start) or delay (s after "
            "the session's previous turn was answered)"
        )
    field, unit = ("timestamp", 1000.0) if "timestamp" in obj else ("delay", 1.0)
    value = obj[field]
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
        raise ValueError(
            f"{where}: {field} must be a number >= 0 ({'ms' if unit > 1 else 's'}), not {value!r}"
        )
    return value / unit if field == "timestamp" else (previous or 0.0) + value


def block_tokens(hash_id: int, seed: int, block_size: int) -> list[int]:
    """The token ids of block `hash_id`: always the same for the same hash id, seed and size."""
    return random.Random(f"{seed}:{hash_id}").choices(_TOKEN_IDS, k=block_size)


def trace_conversations(
    sessions: list[TraceSession], seed: int, block_size: int = TRACE_BLOCK_SIZE
) -> list[Conversation]:
    """The sessions as Conversations: each turn's new input from its trailing hash ids' blocks, cut
    to input_length, its answer exactly output_length (ignore_eos), its pause and the session's
    start kept."""
    blocks: dict[int, list[int]] = {}

    def tokens(turn: TraceTurn) -> list[int]:
        ids: list[int] = []
        needed = -(-turn.input_length // block_size)  # blocks, the last one cut
        for h in turn.hash_ids[len(turn.hash_ids) - needed :]:
            if h not in blocks:
                blocks[h] = block_tokens(h, seed, block_size)
            ids += blocks[h]
        return ids[: turn.input_length]

    return [
        Conversation(
            id=s.id,
            turns=[Turn(tokens(t), t.output_length, pause=t.pause) for t in s.turns],
            ignore_eos=True,
            start=s.start,
        )
        for s in sessions
    ]


def trace(
    path: str, num_conversations: int | None, seed: int, block_size: int = TRACE_BLOCK_SIZE
) -> list[Conversation]:
    """The first num_conversations sessions of a Mooncake-format trace file (by start time; None:
    all), as Conversations of token ids; fewer there, all of them, with a warning."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read the trace {path}: {exc.strerror or exc}") from exc
    sessions = sorted(parse_trace(text.splitlines(), path, block_size), key=lambda s: s.start)
    if not sessions:
        raise ValueError(f"{path}: no turn in the trace; a line is one turn, e.g. {EXAMPLE}")
    if num_conversations is not None and len(sessions) < num_conversations:
        log.warning("%s: %d sessions of the %d asked for", path, len(sessions), num_conversations)
    return trace_conversations(sessions[:num_conversations], seed, block_size)


def trace_line(
    session_id: str, time: dict[str, Any], n_in: int, n_out: int, hash_ids: list[int]
) -> str:
    """One turn as a line of a trace (no newline); `time` is {"timestamp": MS} or {"delay": S}."""
    return json.dumps(
        {
            "session_id": session_id,
            **time,
            "input_length": n_in,
            "output_length": n_out,
            "hash_ids": hash_ids,
        }
    )
