"""Mooncake-format traces: parsing both time forms, the errors a bad line gets, hash ids to token
blocks, and the Conversations a trace's sessions become."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from bench.common import RANDOM_ID_RANGE
from bench.traces import block_tokens, parse_trace, trace, trace_conversations
from bench.workloads import load_workload


def lines(*records: dict) -> list[str]:
    return [json.dumps(r) for r in records]


def turn(sid=None, n_in=10, n_out=3, hash_ids=(0,), **time) -> dict:
    record = {"input_length": n_in, "output_length": n_out, "hash_ids": list(hash_ids), **time}
    return record if sid is None else {"session_id": sid, **record}


def test_timestamps_give_session_starts_and_the_pauses_between_turns() -> None:
    # Two sessions whose lines interleave, as Mooncake's files are sorted by time, and a line
    # without a session: a session of its own.
    sessions = parse_trace(
        lines(
            turn("a", timestamp=1000),
            turn(7, timestamp=1500),
            turn("a", timestamp=4000),
            turn(timestamp=4200),
            turn(7, timestamp=9500),
            turn("a", timestamp=4000),
        )
        + [""],  # a blank line is skipped
        "t.jsonl",
    )
    assert [(s.id, s.start) for s in sessions] == [("a", 1.0), ("7", 1.5), ("line4", 4.2)]
    assert [t.pause for t in sessions[0].turns] == [0.0, 3.0, 0.0]
    assert [t.pause for t in sessions[1].turns] == [0.0, 8.0]
    assert len(sessions[2].turns) == 1


def test_delays_are_the_pauses_after_the_previous_answer() -> None:
    sessions = parse_trace(
        lines(
            turn("s", delay=2.5),  # a first line's delay counts from the trace's start
            turn("s", delay=0.25),
            turn("s", delay=30),
            turn("t", timestamp=500),
            turn("t", delay=1.5),  # the forms mix: a delay after a timestamp
            turn("t", timestamp=10_000),  # and a timestamp after a delay: 0.5 + 1.5, then 10 s
        ),
        "t.jsonl",
    )
    (s, t) = sessions
    assert s.start == 2.5 and [x.pause for x in s.turns] == [0.0, 0.25, 30.0]
    assert t.start == 0.5 and [x.pause for x in t.turns] == [0.0, 1.5, 8.0]


@pytest.mark.parametrize(
    "line, expected",
    [
        ("{not json", ["t.jsonl:2", "not JSON", "a line is one turn"]),
        ("[1, 2]", ["t.jsonl:2", "not a JSON object"]),
        (turn(timestamp=0) | {"input_length": None}, ["t.jsonl:2", "input_length", "whole number"]),
        ({"timestamp": 0, "output_length": 3, "hash_ids": [0]}, ["missing field 'input_length'"]),
        (
            {"timestamp": 0, "input_length": 3, "output_length": 3},
            ["missing field 'hash_ids'", "add it"],
        ),
        (turn(n_in=-5, timestamp=0), ["t.jsonl:2", "input_length is -5", "at least 1 token"]),
        (turn(n_out=0, timestamp=0), ["output_length is 0"]),
        (turn(n_out="12", timestamp=0), ["output_length must be a whole number", "'12'"]),
        (turn(n_in=True, timestamp=0), ["input_length must be a whole number"]),
        (turn(hash_ids=["a"], timestamp=0), ["hash_ids must be a list of integers"]),
        (turn(n_in=600, hash_ids=[1], timestamp=0), ["fewer than input_length", "--trace-block-"]),
        (turn(), ["t.jsonl:2", "missing field timestamp or delay", "give one"]),
        (turn(timestamp=0, delay=1), ["both timestamp and delay", "give one"]),
        (turn(timestamp=-1), ["timestamp must be a number >= 0 (ms)"]),
        (turn(delay="2s"), ["delay must be a number >= 0 (s)"]),
        (turn(sid=[1], timestamp=0), ["session_id must be a string or an integer"]),
        (turn("s", timestamp=50), ["timestamp 50 ms is before", "session 's'", "time order"]),
    ],
)
def test_a_bad_line_is_named_with_its_field_and_fix(line, expected: list[str]) -> None:
    text = line if isinstance(line, str) else json.dumps(line)
    with pytest.raises(ValueError) as info:
        parse_trace([json.dumps(turn("s", timestamp=100)), text], "t.jsonl", block_size=512)
    for part in expected:
        assert part in str(info.value)


def test_equal_hash_ids_give_equal_blocks_and_distinct_ones_different_blocks() -> None:
    block = block_tokens(7, seed=0, block_size=64)
    assert block == block_tokens(7, seed=0, block_size=64) and len(block) == 64
    assert all(RANDOM_ID_RANGE[0] <= i < RANDOM_ID_RANGE[1] for i in block)
    assert block != block_tokens(8, seed=0, block_size=64)
    assert block != block_tokens(7, seed=1, block_size=64), "another seed: a run of its own"
    assert len({tuple(block_tokens(h, 0, 16)) for h in range(200)}) == 200


def test_a_session_becomes_a_conversation_of_its_blocks() -> None:
    block = 4
    sessions = parse_trace(
        lines(
            # Turn 1: blocks 0 and 1 (a shared prefix), then block 2 cut to 2 of its 4 tokens.
            turn("a", n_in=10, n_out=5, hash_ids=[0, 1, 2], timestamp=0),
            # Mooncake's hash ids cover the whole prompt: the new input takes the trailing blocks.
            turn("a", n_in=3, n_out=2, hash_ids=[0, 1, 2, 3, 4], delay=2),
            turn("b", n_in=9, n_out=1, hash_ids=[0, 1, 5], timestamp=3000),
        ),
        "t.jsonl",
        block_size=block,
    )
    a, b = trace_conversations(sessions, seed=3, block_size=block)

    def blk(h: int) -> list[int]:
        return block_tokens(h, 3, block)

    assert a.turns[0].user == blk(0) + blk(1) + blk(2)[:2]
    assert a.turns[1].user == blk(4)[:3]
    assert b.turns[0].user == blk(0) + blk(1) + blk(5)[:1]
    assert a.turns[0].user[:8] == b.turns[0].user[:8], "the shared blocks: a prefix-cache hit"
    assert [(t.max_tokens, t.pause) for t in a.turns] == [(5, 0.0), (2, 2.0)]
    assert (a.id, a.start, b.id, b.start) == ("a", 0.0, "b", 3.0)
    assert a.ignore_eos and b.ignore_eos and a.system is None


def test_trace_reads_a_file_and_takes_the_first_sessions_by_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(
        "\n".join(
            lines(
                turn("late", timestamp=9000),
                turn("early", timestamp=1000),
                turn("middle", timestamp=5000),
                turn("early", delay=1),
            )
        )
        + "\n"
    )
    convs = trace(str(path), num_conversations=2, seed=0)
    assert [(c.id, len(c.turns)) for c in convs] == [("early", 2), ("middle", 1)]
    assert load_workload("trace", path=str(path), num_conversations=2, seed=0) == convs
    assert len(trace(str(path), num_conversations=None, seed=0)) == 3, "None: every session"
    with caplog.at_level(logging.WARNING, logger="ppd.bench"):
        assert len(trace(str(path), num_conversations=5, seed=0)) == 3
    assert "3 sessions of the 5 asked for" in caplog.text
    with pytest.raises(ValueError, match="cannot read the trace"):
        trace(str(tmp_path / "missing.jsonl"), 1, seed=0)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no turn in the trace"):
        trace(str(tmp_path / "empty.jsonl"), 1, seed=0)
