"""Continuous batching decisions of the decode worker, with a real block manager and made-up
tokens."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams, TokenLogprobs
from scheduler.decode_scheduler import DecodeScheduler
from scheduler.messages import GenerateRequest, PrefillDone
from scheduler.sequence import SeqState

BS = 4
EOS = 2
VOCAB = 1000


def make(
    num_blocks: int = 64, budget: int = 16, aggregated: bool = False, max_num_seqs: int = 8
) -> DecodeScheduler:
    return DecodeScheduler(
        BlockManager(num_blocks, BS),
        (EOS,),
        max_model_len=256,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        inline_all=aggregated,
        vocab_size=VOCAB,
    )


def req(rid: str, prompt: list[int], route: str = "decode", **sampling) -> GenerateRequest:
    return GenerateRequest(
        rid, prompt, SamplingParams(**{"temperature": 0.0, "max_tokens": 100, **sampling}), route
    )


def run_remote_prefill(s: DecodeScheduler, rid: str, token: int = 50) -> None:
    step = s.schedule()
    assert [j.request_id for j in step.jobs] == [rid]
    s.prefill_done(PrefillDone(rid, token))


def decode_steps(s: DecodeScheduler, n: int, token: int = 60) -> list:
    outputs = []
    for _ in range(n):
        step = s.schedule()
        outputs += s.postprocess(step, [token] * len(step.sampling_seqs))
    return outputs


def test_miss_goes_to_prefill_worker_then_decodes() -> None:
    s = make()
    s.add(req("a", list(range(10, 20))))
    step = s.schedule()
    (job,) = step.jobs
    assert (job.num_cached, job.output_index, job.token_ids) == (0, 0, list(range(10, 20)))
    assert not step.inputs and s.by_id["a"].state is SeqState.REMOTE
    s.prefill_done(PrefillDone("a", 77))
    step = s.schedule()
    (inp,) = step.inputs
    # The token the prefill worker sampled is the next input; the prompt's KV is all there.
    assert (inp.token_ids, inp.start_pos, inp.sample) == ([77], 10, True)


def test_cached_prefix_with_decode_hint_prefills_inline_in_chunks() -> None:
    s = make(budget=8)
    history = list(range(10, 30))
    s.add(req("t1", history, max_tokens=1))
    run_remote_prefill(s, "t1")  # finishes at once (max_tokens 1); its full blocks stay cached
    assert not s.by_id
    turn2 = history + [50] + list(range(100, 120))
    s.add(req("t2", turn2, route="decode"))
    first = s.schedule()
    assert not first.jobs
    (inp,) = first.inputs
    assert (
        inp.start_pos == 20 and len(inp.token_ids) == 8 and not inp.sample
    )  # 20 of 41 prompt tokens cached
    s.postprocess(first, [])
    chunks = [first]
    while not chunks[-1].inputs[0].sample:
        chunks.append(s.schedule())
        if not chunks[-1].inputs[0].sample:
            s.postprocess(chunks[-1], [])
    outputs = s.postprocess(chunks[-1], [9])
    assert sum(len(c.inputs[0].token_ids) for c in chunks) == len(turn2) - 20
    assert (
        outputs[0].route == "decode"
        and outputs[0].num_cached_tokens == 20
        and outputs[0].token_ids == [9]
    )


def test_prefill_hint_with_cache_hit_goes_remote_reusing_prefix() -> None:
    s = make()
    history = list(range(10, 30))
    s.add(req("t1", history, max_tokens=1))
    run_remote_prefill(s, "t1")
    s.add(req("t2", history + [7, 8, 9], route="prefill"))
    (job,) = s.schedule().jobs
    assert job.num_cached == 20


def test_decode_budget_shared_with_inline_prefill() -> None:
    s = make(budget=6, aggregated=True)
    s.add(req("a", [5] * 3))
    s.postprocess(s.schedule(), [11])  # aggregated: the whole prompt inline, sampled
    s.add(req("b", [6] * 20))
    step = s.schedule()
    assert [len(i.token_ids) for i in step.inputs] == [
        1,
        5,
    ]  # one decode token, the rest of the budget to b


def test_abort_during_remote_prefill_frees_blocks_only_when_done() -> None:
    s = make(num_blocks=16)
    s.add(req("a", list(range(10))))
    s.schedule()
    free_before = s.blocks.num_free_blocks
    assert s.abort("a") is True  # the prefill worker must be told
    assert s.blocks.num_free_blocks == free_before  # still being written by the prefill worker
    assert s.prefill_done(PrefillDone("a", None)) == []
    assert s.blocks.num_free_blocks == 16 and not s.by_id


def test_abort_running_frees_at_once() -> None:
    s = make(num_blocks=16)
    s.add(req("a", list(range(10))))
    run_remote_prefill(s, "a")
    assert s.abort("a") is False
    assert s.blocks.num_free_blocks == 16 and s.blocks.usage == 0 and not s.running


def test_finish_reasons() -> None:
    s = make()
    s.add(req("eos", [3, 4, 5]))
    s.add(req("ign", [3, 4, 6], ignore_eos=True, max_tokens=3))
    s.add(req("stop", [3, 4, 7], stop_token_ids=(99,)))
    step = s.schedule()
    for job in step.jobs:
        s.prefill_done(PrefillDone(job.request_id, 60))
    step = s.schedule()
    tokens = {"eos": EOS, "ign": EOS, "stop": 99}
    outs = {
        o.request_id: o
        for o in s.postprocess(step, [tokens[q.request_id] for q in step.sampling_seqs])
    }
    assert outs["eos"].finish_reason == "stop" and outs["stop"].finish_reason == "stop"
    assert outs["ign"].finish_reason is None
    outs = {o.request_id: o for o in s.postprocess(s.schedule(), [EOS])}
    assert outs["ign"].finish_reason == "length"  # 3 tokens: max_tokens reached
    assert not s.by_id and s.blocks.usage == 0


def test_first_token_can_finish_request() -> None:
    s = make(num_blocks=16)
    s.add(req("a", [3, 4, 5]))
    s.schedule()
    (out,) = s.prefill_done(PrefillDone("a", EOS))
    assert out.finish_reason == "stop" and out.index == 1 and out.token_ids == []
    assert s.blocks.num_free_blocks == 16


def test_preemption_recomputes_with_generated_tokens() -> None:
    s = make(num_blocks=6, budget=16)  # 24 slots; watermark 1 block
    s.add(req("old", list(range(10, 18)), route="prefill"))  # 2 blocks + 1 slot each
    s.add(req("new", list(range(20, 28)), route="prefill"))
    step = s.schedule()
    for job in step.jobs:
        s.prefill_done(PrefillDone(job.request_id, 60))
    preempted = None
    for _ in range(12):
        step = s.schedule()
        s.postprocess(step, [61] * len(step.sampling_seqs))
        if s.num_preemptions:
            preempted = s.by_id["new"]
            break
    assert preempted is not None and preempted.state is SeqState.PREEMPTED
    assert preempted.num_output > 1 and preempted.request_id not in s.blocks
    # The older sequence keeps decoding; once it ends the preempted one is recomputed with what it
    # generated.
    s.abort("old")
    step = s.schedule()
    (job,) = step.jobs
    assert job.token_ids == preempted.token_ids and job.output_index == preempted.num_output
    assert job.num_cached > 0  # its own full blocks were still in the prefix cache
    assert s.stats().num_preemptions == 1


def test_prompt_larger_than_pool_fails_clearly() -> None:
    s = make(num_blocks=4)
    error = s.add(req("big", list(range(40))))
    assert error is not None and "KV blocks" in error.error and not s.by_id


def test_max_num_seqs_limits_admission() -> None:
    s = make(max_num_seqs=2)
    for i in range(3):
        s.add(req(f"r{i}", [10 + i] * 5))
    step = s.schedule()
    assert len(step.jobs) == 2 and len(s.waiting) == 1
    assert s.stats().num_running == 2 and s.stats().num_waiting == 1


def test_a_request_no_worker_can_run_is_refused_with_400() -> None:
    s = make()
    cases = {
        "empty": req("empty", []),
        "vocab": req("vocab", [10, VOCAB]),
        "negative": req("negative", [-1, 10]),
        "stop": req("stop", [10, 11], stop_token_ids=(VOCAB + 5,)),
        "minmax": req("minmax", [10, 11], max_tokens=4, min_tokens=5),
        "top_p": req("top_p", [10, 11], top_p=0.0),
        "long": req("long", list(range(10, 10 + 256))),
    }
    for rid, r in cases.items():
        out = s.add(r)
        assert out is not None and out.error_status == 400 and out.request_id == rid, rid
    assert not s.by_id and s.blocks.num_free_blocks == s.blocks.num_blocks
    s.add(req("a", [10, 11]))
    again = s.add(req("a", [12, 13]))
    assert again is not None and "already running" in again.error  # the first one is untouched
    assert s.by_id["a"].token_ids == [10, 11]


def test_a_failed_input_ends_its_request_alone_and_frees_its_blocks() -> None:
    s = make()
    for i, rid in enumerate(("a", "b", "c")):
        s.add(req(rid, list(range(10 + 20 * i, 30 + 20 * i))))
        run_remote_prefill(s, rid)
    step = s.schedule()
    assert [q.request_id for q in step.seqs] == ["a", "b", "c"]
    outs = s.postprocess(step, [61, None, 62], {1: "ValueError: boom"})
    by_id = {o.request_id: o for o in outs}
    assert by_id["b"].error and "boom" in by_id["b"].error and by_id["b"].error_status == 500
    assert by_id["a"].token_ids == [61] and by_id["c"].token_ids == [62]
    assert "b" not in s.by_id and "b" not in s.blocks
    decode_steps(s, 3)
    assert [q.token_ids[-4:] for q in (s.by_id["a"], s.by_id["c"])] == [
        [61, 60, 60, 60],
        [62, 60, 60, 60],
    ]


def test_prompt_logprobs_skip_the_cache_and_ask_in_the_first_pass_only() -> None:
    s = make(budget=8, aggregated=True)
    history = list(range(10, 30))
    s.add(req("t1", history, max_tokens=1))
    while s.by_id:
        step = s.schedule()
        s.postprocess(step, [50] * len(step.sampling_seqs))
    # The same prompt again, with prompt logprobs: none of it comes from the cache; every chunk asks
    # for the logprobs of its positions' next prompt tokens, the last position (which predicts the
    # output) excepted.
    s.add(req("t2", history, prompt_logprobs=2))
    asked = []
    while True:
        step = s.schedule()
        (inp,) = step.inputs
        if not asked:
            assert inp.start_pos == 0
        asked += inp.prompt_logprobs.targets
        assert inp.prompt_logprobs.top == 2
        fake = {0: [TokenLogprobs(-1.0, 1, [], [])] * len(inp.prompt_logprobs.targets)}
        outputs = s.postprocess(step, [60] * len(step.sampling_seqs), prompt_logprobs=fake)
        if inp.sample:
            break
    assert asked == history[1:]
    (out,) = outputs
    assert out.index == 0 and len(out.prompt_logprobs) == len(history) - 1
    assert s.by_id["t2"].num_cached == 0
    # Decoding after that asks nothing, and a later output carries none.
    step = s.schedule()
    assert step.inputs[0].prompt_logprobs is None
    assert s.postprocess(step, [61])[0].prompt_logprobs is None


def test_inline_prefills_go_shortest_remaining_first() -> None:
    """A short append admitted after a long prompt is not held behind it: each step gives the budget
    to the prefill with the fewest tokens left, and the long one takes what is left of the budget
    in the same step."""
    s = make(num_blocks=128, budget=16, aggregated=True)
    s.add(req("long", list(range(10, 70))))  # 60 tokens: four steps' budget
    first = s.schedule()
    assert [len(i.token_ids) for i in first.inputs] == [16]
    s.postprocess(first, [])
    s.add(req("short", list(range(100, 106))))  # 6 tokens, admitted behind it
    step = s.schedule()
    assert [(q.request_id, len(i.token_ids)) for q, i in zip(step.seqs, step.inputs)] == [
        ("short", 6),
        ("long", 10),
    ]
    outputs = s.postprocess(step, [61])  # the short prompt's first token at once
    assert [(o.request_id, o.token_ids) for o in outputs] == [("short", [61])]
    step = (
        s.schedule()
    )  # then: the short one decodes, the long one goes on with the rest of the budget
    assert [(q.request_id, len(i.token_ids)) for q, i in zip(step.seqs, step.inputs)] == [
        ("short", 1),
        ("long", 15),
    ]


def test_prefill_batch_tokens_finishes_appends_one_after_another() -> None:
    """With --prefill-batch-tokens, a further inline prefill joins a step only while the step's
    prefill tokens are below it, so that appends finish one after another rather than all at the
    end of one long step."""

    def first_step(limit: int | None) -> list[tuple[str, int]]:
        s = make(num_blocks=128, budget=32, aggregated=True)
        s.prefill_batch_tokens = limit
        s.add(req("a", list(range(10, 16))))
        s.add(req("b", list(range(20, 27))))
        step = s.schedule()
        return [(q.request_id, len(i.token_ids)) for q, i in zip(step.seqs, step.inputs)]

    assert first_step(None) == [("a", 6), ("b", 7)]
    assert first_step(8) == [
        ("a", 6),
        ("b", 7),
    ]  # 6 < 8: b joins (and may take the step past the limit)
    assert first_step(6) == [("a", 6)]  # a alone: b waits a step


def test_a_request_starts_when_its_first_chunk_is_in_a_step() -> None:
    """What --max-queue-time-s waits for: a step names the requests whose first inline chunk it
    carries, once each; a request handed to the prefill worker, or still waiting for a slot, has not
    started here."""
    s = make(budget=8, aggregated=True, max_num_seqs=1)
    s.add(req("long", list(range(10, 30))))
    s.add(req("queued", [5] * 4))
    step = s.schedule()
    assert step.started == ["long"] and len(s.waiting) == 1
    s.postprocess(step, [])
    step = s.schedule()  # its second chunk: already started
    assert step.started == [] and len(s.waiting) == 1
    remote = make()
    remote.add(req("miss", [7] * 9))
    step = remote.schedule()
    assert [j.request_id for j in step.jobs] == ["miss"] and step.started == []


def test_a_failed_input_ends_its_request_with_the_status_of_its_failure() -> None:
    """A request's own failure (its grammar) is the client's 400; the engine's is a 500."""
    from engine.engine import InputFailure

    s = make()
    for rid in ("own", "engine"):
        s.add(req(rid, list(range(10, 14)), route="prefill"))
        run_remote_prefill(s, rid)
    step = s.schedule()
    failed = {
        0: InputFailure("GuidedError: left the grammar", 400),
        1: InputFailure("RuntimeError: device", 500),
    }
    outs = {o.request_id: o for o in s.postprocess(step, [None, None], failed)}
    assert (outs["own"].error_status, outs["engine"].error_status) == (400, 500)
    assert not s.by_id and s.blocks.usage == 0.0
