"""The `ppd bench` load generator against the stub server (a subprocess: its own event loop and
GIL)."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import statistics
import time
import urllib.request
import warnings
from itertools import islice

import pytest

from bench.client import (
    NEEDS_TOKEN_IDS,
    Conversation,
    LoadConfig,
    RequestRecord,
    Turn,
    _Stream,
    poisson_arrivals,
    run_load,
)
from bench.report import summarize
from bench.stub_server import start_stub

TTFT_MS, ITL_MS = 20.0, 8.0
FAST = {"stub": {"ttft_ms": 2, "itl_ms": 1}}  # for tests about content, not timing


@pytest.fixture(scope="module")
def stub():
    with start_stub(ttft_ms=TTFT_MS, itl_ms=ITL_MS) as server:
        yield server


def call(stub, path: str, method: str = "GET") -> dict | list:
    with urllib.request.urlopen(
        urllib.request.Request(stub.url + path, method=method), timeout=10
    ) as resp:
        return json.loads(resp.read())


def run(stub, conversations: list[Conversation], **kw) -> list[RequestRecord]:
    """run_load with a fresh stub log; progress off."""
    call(stub, "/stub/reset", "POST")
    return asyncio.run(run_load(LoadConfig(stub.url, "stub", **kw), conversations, progress=False))


def once(stub, conversation: Conversation, **kw) -> list[RequestRecord]:
    """Run one conversation once: an open loop whose second arrival is due long after the end."""
    return run(stub, [conversation], qps=1e-9, duration=30.0, **kw)


def test_chat_sends_the_full_history_with_the_servers_answers(stub):
    conv = Conversation(
        "c0",
        [Turn("hello there", 3), Turn("tell me more", 2), Turn("thanks", 1)],
        system="be brief",
        ignore_eos=True,
    )
    records = once(stub, conv, extra_body=FAST)
    assert [(r.turn, r.error) for r in records] == [(0, None), (1, None), (2, None)]
    bodies = [entry["body"] for entry in call(stub, "/stub/log")]
    assert [b["messages"] for b in bodies] == [
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}],
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": " w0 w1 w2"},
            {"role": "user", "content": "tell me more"},
        ],
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": " w0 w1 w2"},
            {"role": "user", "content": "tell me more"},
            {"role": "assistant", "content": " w0 w1"},
            {"role": "user", "content": "thanks"},
        ],
    ]
    for body, max_tokens in zip(bodies, (3, 2, 1)):
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert (
            body["max_tokens"] == max_tokens
            and body["temperature"] == 0.0
            and body["ignore_eos"] is True
        )
        assert body["model"] == "stub" and body["stub"] == FAST["stub"]  # extra_body merged in
        assert "return_token_ids" not in body


def test_token_timing_asks_for_token_ids_and_times_the_first_token_not_the_first_text(stub):
    conv = Conversation("c0", [Turn("hello there", 3), Turn("tell me more", 2)], ignore_eos=True)
    records = once(stub, conv, extra_body=FAST, token_timing=True)
    assert [r.error for r in records] == [None, None]
    assert all(entry["body"]["return_token_ids"] is True for entry in call(stub, "/stub/log"))
    # A detokenizer holding back half a character: the tokens' chunks carry ids and no text until it
    # completes.
    stream = _Stream(start=0.0)
    stream.feed(b'data: {"choices":[{"delta":{"content":""},"token_ids":[195]}]}\n\n', 1.0)
    stream.feed(b'data: {"choices":[{"delta":{},"token_ids":[168]}]}\n\n', 2.0)
    stream.feed(
        b'data: {"choices":[{"delta":{"content":"\xc3\xa8!"},"token_ids":[33]}]}\n\ndata: '
        b"[DONE]\n\n",
        3.0,
    )
    record = stream.record("c", 0, None)
    assert (record.ttft, record.itl, record.output_tokens) == (1.0, [1.0, 1.0], 3)


def test_completions_sends_prompt_plus_generated_plus_new_ids(stub):
    conv = Conversation("c0", [Turn([1, 2, 3], 3), Turn([4, 5], 2), Turn([6], 1)])
    records = once(stub, conv, api="completions", extra_body=FAST)
    assert [r.error for r in records] == [None, None, None]
    bodies = [entry["body"] for entry in call(stub, "/stub/log")]
    assert [b["prompt"] for b in bodies] == [
        [1, 2, 3],
        [1, 2, 3, 1000, 1001, 1002, 4, 5],
        [1, 2, 3, 1000, 1001, 1002, 4, 5, 1000, 1001, 6],
    ]
    assert all(b["return_token_ids"] is True and "ignore_eos" not in b for b in bodies)
    assert [r.prompt_tokens for r in records] == [3, 8, 11] and [
        r.output_tokens for r in records
    ] == [3, 2, 1]


@pytest.mark.parametrize("honor", [True, False])
def test_a_refused_request_is_sent_again_after_the_retry_after_unless_told_not_to(
    stub, honor: bool
):
    refused = Conversation("c0", [Turn("hello [stub:http429=0.4]", 4)])
    records = run(
        stub, [refused], concurrency=1, duration=1.0, timeout=1.0, honor_retry_after=honor
    )
    arrivals = [entry["arrived"] for entry in call(stub, "/stub/log")]
    assert all(r.error.startswith("HTTP 429") for r in records)
    if honor:  # one request sent at about 0, 0.4 and 0.8 s, as OpenAI's SDK would, then its timeout
        assert (
            2 <= len(arrivals) <= 3 and min(b - a for a, b in zip(arrivals, arrivals[1:])) >= 0.39
        )
        assert len(records) == 1 and records[0].retries == len(arrivals) - 1
    else:  # every refusal fails its request, and the slot sends the next at once: a storm
        assert len(records) == len(arrivals) > 20 and all(r.retries == 0 for r in records)


def test_a_saturated_server_answers_every_request_in_the_end_and_the_report_says_so(stub):
    """What a server past its capacity does (429 with Retry-After until a slot frees): the request
    succeeds, its TTFT counts from its first sending, and the summary counts it as refused then
    retried, not failed."""
    conv = Conversation(
        "c0", [Turn("busy [stub:http429=0.2,2]", 3), Turn("and then", 2)], ignore_eos=True
    )
    records = once(stub, conv, extra_body=FAST)
    assert [(r.turn, r.error, r.retries) for r in records] == [(0, None, 2), (1, None, 0)]
    assert records[0].ttft >= 0.4  # two refusals, 0.2 s each, before the answer
    summary = summarize(records, 1.0)
    assert summary["failed"] == 0 and summary["refused_then_retried"] == 1


def test_cache_hints_and_the_history_each_later_turn_carries(stub):
    conv = Conversation("session-1", [Turn([1, 2, 3], 3), Turn([4, 5], 2), Turn([6], 1)])
    records = once(stub, conv, api="completions", extra_body=FAST, cache_hints=True)
    bodies = [entry["body"] for entry in call(stub, "/stub/log")]
    assert [(b["prompt_cache_key"], b["prompt_cache_retention"]) for b in bodies] == [
        ("session-1", "24h")
    ] * 3
    # The previous prompt and its answer, by the server's usage: 3 + 3, then 8 + 2.
    assert [r.history_tokens for r in records] == [None, 6, 10]
    once(stub, conv, api="completions", extra_body=FAST)
    assert not any("prompt_cache_key" in e["body"] for e in call(stub, "/stub/log")), "off: none"


def test_replay_starts_sessions_at_their_scaled_times_and_each_turn_after_its_pause(stub):
    scale = 0.1
    pauses = {("a", 1): 2.0, ("a", 2): 4.0, ("b", 1): 1.0}
    conversations = [
        Conversation(
            "b", [Turn([5], 2), Turn([6], 2, pause=1.0)], ignore_eos=True, start=13.0
        ),  # not first in the list: replay goes by start times
        Conversation(
            "a",
            [Turn([1, 2], 2), Turn([3], 2, pause=2.0), Turn([4], 2, pause=4.0)],
            ignore_eos=True,
            start=10.0,
        ),
    ]
    began = time.perf_counter()
    records = run(
        stub,
        conversations,
        api="completions",
        replay=True,
        time_scale=scale,
        duration=30.0,
        extra_body=FAST,
    )
    took = time.perf_counter() - began
    by_turn = {(r.conversation, r.turn): r for r in records}
    assert sorted(by_turn) == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1)], "each once"
    assert all(r.success for r in records)
    # Start times count from the earliest session's, times the scale: b 0.3 s after a.
    assert by_turn["b", 0].start - by_turn["a", 0].start > 0.29
    # No turn is sent before its scaled pause has passed since the previous answer ended.
    for (cid, k), pause in pauses.items():
        previous = by_turn[cid, k - 1]
        assert by_turn[cid, k].start >= previous.start + previous.latency + pause * scale - 1e-3
    assert took < 10, "the replay ends when its sessions have, not at the duration"


def test_pauses_are_kept_in_a_closed_loop_and_no_turn_is_sent_past_the_duration(stub):
    conv = Conversation("c", [Turn([1], 2), Turn([2], 2, pause=0.3), Turn([3], 2, pause=30.0)])
    began = time.perf_counter()
    records = run(stub, [conv], api="completions", concurrency=1, duration=1.0, extra_body=FAST)
    assert [(r.conversation, r.turn) for r in records] == [("c", 0), ("c", 1)]
    assert records[1].start >= records[0].start + records[0].latency + 0.3 - 1e-3
    assert time.perf_counter() - began < 10, "a pause past the duration is not waited out"


def test_completions_multi_turn_without_token_ids_fails_clearly(stub):
    conv = Conversation("c0", [Turn([1, 2], 2), Turn([3], 2), Turn([4], 2)])
    records = once(
        stub, conv, api="completions", extra_body={"stub": {"token_ids": False, "ttft_ms": 2}}
    )
    assert [(r.turn, r.error) for r in records] == [(0, None), (1, NEEDS_TOKEN_IDS)]
    assert len(call(stub, "/stub/log")) == 1  # the later turns were never sent


def test_record_timing_usage_route_and_cache(stub):
    records = once(stub, Conversation("c0", [Turn(f"turn {k}", 8) for k in range(15)]))
    stub_first_token = [entry["first_token_s"] for entry in call(stub, "/stub/log")]
    assert len(records) == len(stub_first_token) == 15 and all(r.success for r in records)
    for k, (r, first_token) in enumerate(zip(records, stub_first_token)):
        assert r.output_tokens == 8 and len(r.itl) == 7 and r.route == "decode"
        assert (r.prompt_tokens, r.cached_tokens) == (
            2 * (k + 1) + 8 * k,
            10 * k,
        )  # words; all but the new turn
        # Never early: the stub writes the first token TTFT_MS or later after the request arrived,
        # and the client sent it before that and reads the token after.
        assert TTFT_MS / 1000 <= first_token <= r.ttft
        assert r.latency >= r.ttft + sum(r.itl) - 1e-9  # [DONE] comes after the last token
    # A single request on a shared 2-core VM may see a scheduling hiccup of a few ms; medians do
    # not: the client stamps the first token, not the second (ITL_MS later). 2.01 ms was seen in a
    # loaded suite, so the bound is half an ITL.
    assert (
        statistics.median(r.ttft - first_token for r, first_token in zip(records, stub_first_token))
        < ITL_MS / 2 / 1000
    )
    # The stub's own sleep overshoots on a busy machine (23.5 ms for 20 in a loaded default suite):
    # its time is checked from below, the client's part above.
    assert TTFT_MS / 1000 <= statistics.median(r.ttft for r in records) <= TTFT_MS / 1000 + 0.01
    # the stub's sleeps between tokens overshoot under load as its first one does
    assert (
        0.9 * ITL_MS / 1000 <= statistics.median(r.tpot for r in records) <= ITL_MS / 1000 + 0.003
    )


def test_timeout_fails_the_request_and_stops_its_conversation(stub):
    conv = Conversation("c0", [Turn("a", 2), Turn("b [stub:sleep=5]", 2), Turn("c", 2)])
    records = once(stub, conv, timeout=0.3, extra_body=FAST)
    assert [(r.turn, r.error) for r in records] == [(0, None), (1, "timeout")]
    assert (
        records[1].latency == pytest.approx(0.3, abs=0.1)
        and records[1].tpot is None
        and not records[1].success
    )
    assert len(call(stub, "/stub/log")) == 2  # turn 2 was never sent
    deadline = time.monotonic() + 5
    while call(stub, "/stub/stats")["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)  # the stub notices the closed connection
    assert call(stub, "/stub/stats")["in_flight"] == 0


def test_http_error_and_stream_error_are_failures_with_the_servers_message(stub):
    bad = Conversation("bad", [Turn("x [stub:http400]", 2), Turn("never", 2)])
    broken = Conversation("broken", [Turn("x [stub:sse-error]", 4), Turn("never", 2)])
    records = run(stub, [bad, broken], concurrency=2, duration=0.05, extra_body=FAST)
    assert records and all(
        r.turn == 0 and not r.success for r in records
    )  # no second turn after a failure
    errors = {r.conversation.split("#")[0]: r.error for r in records}
    assert errors == {
        "bad": "HTTP 400: stub: bad request as asked",
        "broken": "stub: stream error as asked",
    }
    assert all(
        r.ttft is not None for r in records if r.conversation.startswith("broken")
    )  # a token came first


def test_stream_parsing_takes_any_servers_chunks():
    stream = _Stream(start=0.0)
    role = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}'
    assert not stream.feed(
        b": keep-alive\n\n" + role + b"\n\nda", 1.0
    )  # a comment, a line split across reads
    assert not stream.feed(
        b'ta: {"choices":[{"delta":{"reasoning_content":"hmm"},"x":1}]}\r\n\r\n', 2.0
    )
    assert not stream.feed(b'data:{"choices":[{"delta":{"content":"Hi"}}],"usage":null}\n\n', 3.5)
    assert stream.feed(
        b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,'
        b'"prompt_tokens_details":null}}\n\ndata: [DONE]\n\n',
        4.0,
    )
    record = stream.record("c", 0, None)
    assert (record.ttft, record.itl, record.latency) == (
        2.0,
        [1.5],
        4.0,
    )  # the role chunk is no token
    assert (record.prompt_tokens, record.output_tokens, record.cached_tokens, record.success) == (
        5,
        2,
        None,
        True,
    )
    assert (
        "".join(stream.texts) == "Hi" and stream.ids is None
    )  # reasoning is no part of the history

    no_usage = _Stream(start=0.0)
    no_usage.feed(
        b'data: {"choices":[{"text":"a","token_ids":[7]}]}\n\ndata: '
        b'{"choices":[{"text":"","token_ids":[8]}]}'
        b"\n\ndata: [DONE]\n\n",
        1.0,
    )
    assert no_usage.record("c", 0, None).output_tokens == 2 and no_usage.ids == [7, 8]


def test_poisson_arrivals_are_reproducible_with_the_right_rate():
    first = list(islice(poisson_arrivals(50.0, seed=1), 20_000))
    assert first == list(islice(poisson_arrivals(50.0, seed=1), 20_000))
    assert first[:10] != list(islice(poisson_arrivals(50.0, seed=2), 10))
    assert first[0] == 0.0 and all(b > a for a, b in zip(first, first[1:]))
    assert first[-1] / (len(first) - 1) == pytest.approx(1 / 50, rel=0.02)


def test_open_loop_starts_conversations_on_the_poisson_schedule(stub):
    qps, duration = 40.0, 1.0
    conversations = [Conversation(f"c{i}", [Turn("hi", 2), Turn("more", 2)]) for i in range(5)]
    records = run(stub, conversations, qps=qps, seed=7, duration=duration, extra_body=FAST)
    due = [t for t in islice(poisson_arrivals(qps, seed=7), 1000) if t < duration]
    starts = sorted(r.start for r in records if r.turn == 0)
    assert len(starts) == len(due) > 20
    lateness = [(s - starts[0]) - t for s, t in zip(starts, due)]
    assert statistics.median(lateness) < 0.005 and max(map(abs, lateness)) < 0.05
    # The list is cycled with distinct ids, each conversation runs both turns.
    assert {r.conversation for r in records} >= {"c0", "c4", "c0#2"}
    assert all(r.success for r in records)


def test_closed_loop_keeps_exactly_concurrency_in_flight(stub):
    conversations = [Conversation(f"c{i}", [Turn("a b", 5), Turn("c", 3)]) for i in range(4)]
    records = run(
        stub,
        conversations,
        concurrency=3,
        duration=0.5,
        extra_body={"stub": {"ttft_ms": 5, "itl_ms": 1}},
    )
    assert call(stub, "/stub/stats")["max_in_flight"] == 3
    events = sorted([(r.start, 1) for r in records] + [(r.start + r.latency, -1) for r in records])
    in_flight = peak = 0
    for _, step in events:
        in_flight += step
        peak = max(peak, in_flight)
    assert peak <= 3 and all(r.success for r in records) and len(records) > 30


def test_bad_configs_are_refused_with_a_reason():
    conv = [Conversation("c0", [Turn("hi", 1)])]
    with pytest.raises(ValueError, match="exactly one of qps"):
        asyncio.run(
            run_load(
                LoadConfig("http://127.0.0.1:1", "m", qps=1.0, concurrency=2), conv, progress=False
            )
        )
    with pytest.raises(ValueError, match="or replay"):
        asyncio.run(
            run_load(LoadConfig("http://127.0.0.1:1", "m", qps=1.0, replay=True), conv, False)
        )
    with pytest.raises(ValueError, match="time_scale"):
        asyncio.run(
            run_load(LoadConfig("http://127.0.0.1:1", "m", replay=True, time_scale=-1), conv, False)
        )
    with pytest.raises(ValueError, match="token ids"):
        asyncio.run(
            run_load(
                LoadConfig("http://127.0.0.1:1", "m", api="completions", concurrency=1),
                conv,
                progress=False,
            )
        )


def test_timings_under_load_are_the_clients_own_and_never_earlier_than_the_server():
    """Under about 350 offered requests/s, every request succeeds and each record's TTFT is at least
    the stub's own measured time from the request's arrival to its first token: a client that
    stamped the wrong request or started its clock late would report less. What the client costs
    (its requests/s and timing overhead over the stub's time, printed here with -s) is a figure of
    the machine, not a pass/fail: 340 requests/s and 0.7 ms on the 2-core machine when measured.
    """
    # 6 slots x (10 ms + 3 x 2 ms) per request. Unique texts (no list cycling) let each record find
    # its stub entry.
    conversations = [
        Conversation(f"c{i}", [Turn(f"c{i} turn {j}", 4) for j in range(5)]) for i in range(3000)
    ]
    with start_stub(ttft_ms=10, itl_ms=2) as server:
        cfg = LoadConfig(server.url, "stub", concurrency=6, duration=4.0)
        records = asyncio.run(run_load(cfg, conversations, progress=False))
        stub_first_token = {
            e["body"]["messages"][-1]["content"]: e["first_token_s"]
            for e in call(server, "/stub/log")
        }
    assert len(records) > 50 and all(r.success for r in records), {r.error for r in records}
    overhead = sorted(r.ttft - stub_first_token[f"{r.conversation} turn {r.turn}"] for r in records)
    assert overhead[0] >= 0, (
        f"a TTFT {overhead[0] * 1e3:.3f} ms shorter than the server's own time to it"
    )
    span = max(r.start + r.latency for r in records) - min(r.start for r in records)
    print(
        f"\n{len(records)} requests, {len(records) / span:.0f} requests/s; client overhead p50 "
        f"{overhead[len(overhead) // 2] * 1e3:.3f} ms, p90 "
        f"{overhead[int(0.9 * len(overhead))] * 1e3:.3f} ms"
    )


def test_cancel_keeps_completed_records_and_leaves_nothing_open(stub, caplog):
    conversations = [Conversation(f"c{i}", [Turn("a", 10), Turn("b", 10)]) for i in range(4)]
    cfg = LoadConfig(stub.url, "stub", concurrency=4, duration=30.0)
    records: list[RequestRecord] = []

    async def main() -> None:
        task = asyncio.create_task(run_load(cfg, conversations, progress=False, records=records))
        while len(records) < 8:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    call(stub, "/stub/reset", "POST")
    gc.collect()  # what earlier tests of this process left for the collector, collected outside
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        asyncio.run(main())
        gc.collect()
    assert not [str(w.message) for w in caught]
    assert not [
        r.getMessage() for r in caplog.records
    ]  # e.g. "Task was destroyed", "Unclosed client session"
    assert len(records) >= 8 and all(r.success and r.output_tokens == 10 for r in records)
    deadline = time.monotonic() + 5
    while call(stub, "/stub/stats")["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (
        call(stub, "/stub/stats")["in_flight"] == 0
    )  # the abandoned requests' connections were closed


def test_progress_bar_goes_to_stderr(stub, capsys):
    conversations = [
        Conversation("bad", [Turn("x [stub:http400]", 1)]),
        Conversation("ok", [Turn("y", 1)]),
    ]
    cfg = LoadConfig(stub.url, "stub", concurrency=1, duration=0.1, extra_body=FAST)
    records = asyncio.run(run_load(cfg, conversations, progress=True))
    err = capsys.readouterr().err
    assert "requests" in err and f"failed={sum(not r.success for r in records)}" in err
