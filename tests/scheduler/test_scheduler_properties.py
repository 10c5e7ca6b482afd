"""The decode worker's scheduler under arbitrary valid traffic (hypothesis): requests of any shape
and sampling parameters, aborts at any stage, prefill jobs that finish or fail in any order,
tokens that stop or not, steps run one at a time or scheduled ahead of the one on the device
(async scheduling). It never raises, every live sequence is in exactly one state, no block a
launched step holds is ever free, and once every request has ended no KV block stays in use."""

from __future__ import annotations

from hypothesis import given, settings, target
from hypothesis import strategies as st

from engine.block_manager import BlockManager
from engine.kv_tier import TierIndex
from engine.sampling_params import SamplingParams
from scheduler.decode_scheduler import DecodeScheduler, Step
from scheduler.messages import GenerateRequest, PrefillDone
from scheduler.sequence import PLACEHOLDER

VOCAB, EOS, BS = 40, 2, 4

sampling = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.7]),
    repetition_penalty=st.sampled_from([1.0, 1.2]),
    max_tokens=st.one_of(st.integers(1, 4), st.integers(20, 40)),  # short ones, and ones that grow
    min_tokens=st.integers(0, 1),
    stop_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=3).map(tuple),
    ignore_eos=st.booleans(),
)
# A small alphabet, so that prompts share prefixes and the cache hits.
prompt = st.lists(st.sampled_from([5, 6, 7, 8]), min_size=1, max_size=24)
step = st.tuples(st.just("step"), st.lists(st.integers(0, VOCAB - 1), min_size=64, max_size=64))
add = st.tuples(
    st.just("add"),
    prompt,
    sampling,
    st.sampled_from(["prefill", "decode"]),
    st.sampled_from([0.0, 60.0]),  # a cache hint's retention, or none
)
prefill_done = st.tuples(
    st.just("prefill_done"), st.integers(0, 30), st.sampled_from([None, EOS, 9, 20])
)
# Steps are most of a worker's life (sequences grow, finish, get preempted); aborts and failures are
# rarer.
op = st.one_of(
    add,
    add,
    step,
    step,
    step,
    step,
    step,
    step,
    prefill_done,
    prefill_done,
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("fail"), st.integers(0, 30)),
)


def check(s: DecodeScheduler, in_flight: Step | None = None) -> None:
    s.check()
    if in_flight is not None:
        for inp in in_flight.inputs:
            # Every block the step on the device reads or writes is still held, and none it writes
            # is cached yet (another request matching it would read KV not written).
            end = inp.start_pos + len(inp.token_ids)
            assert all(s.blocks._blocks[b].ref_count > 0 for b in inp.block_table[: -(-end // BS)])
            assert all(
                s.blocks._blocks[b].hash is None
                for b in inp.block_table[inp.start_pos // BS : -(-end // BS)]
            )


def sampled_tokens(step: Step, tokens: list[int], failed: dict[int, str]) -> list[int | None]:
    return [
        None if pos in failed else tokens[k]
        for k, pos in enumerate(p for p, i in enumerate(step.inputs) if i.sample)
    ]


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(op, min_size=30, max_size=100),
    num_blocks=st.integers(6, 24),
    budget=st.integers(4, 24),
    aggregated=st.booleans(),
    ahead=st.booleans(),
    tier=st.booleans(),
)
def test_any_traffic_keeps_the_scheduler_consistent_and_frees_every_block(
    ops, num_blocks, budget, aggregated, ahead, tier
) -> None:
    s = DecodeScheduler(
        BlockManager(num_blocks, BS, tier=TierIndex(8) if tier else None, retention_share=0.5),
        (EOS,),
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=max(budget, 4),
        inline_all=aggregated,
        vocab_size=VOCAB,
    )
    jobs: list[str] = []  # prefill jobs handed off and not answered yet
    ids: list[str] = []
    in_flight: tuple[Step, list[int | None]] | None = (
        None  # ahead: the step on the device and what it will sample
    )

    def take(flight: tuple[Step, list[int | None]] | None) -> None:
        if flight is not None:
            for out in s.postprocess(flight[0], flight[1]):
                assert out.request_id in ids

    for kind, *args in ops:
        if kind == "add":
            rid = f"r{len(ids)}"
            ids.append(rid)
            tokens, params, route, retain_s = args
            s.add(GenerateRequest(rid, tokens, params, route, retain_s=retain_s))
        elif kind == "abort" and ids:
            rid = ids[args[0] % len(ids)]
            if s.abort(rid):
                assert rid in jobs  # the prefill worker must be told, and answers with PrefillDone
        elif kind == "prefill_done" and jobs:
            rid = jobs.pop(args[0] % len(jobs))
            s.prefill_done(PrefillDone(rid, args[1], None if args[1] is not None else "failed"))
        elif kind in ("step", "fail") and ahead:
            step = s.schedule(ahead=True) if in_flight is not None else None
            if step is None:  # the worker waits for the step on the device, then schedules as usual
                take(in_flight)
                in_flight = None
                step = s.schedule()
            s.blocks.copies_done(s.blocks.take_copies())  # the worker runs them before the step
            jobs += [j.request_id for j in step.jobs]
            for seq, inp in zip(
                step.seqs, step.inputs
            ):  # a placeholder's token comes from the step on the device
                assert (inp.previous >= 0) == (seq.token_ids[-1] == PLACEHOLDER)
                if inp.previous >= 0:
                    assert in_flight[0].sampling_seqs[inp.previous] is seq
                    assert not (seq.sampling.penalized or seq.sampling.guided)
            s.commit(step)
            take(in_flight)
            in_flight = (
                (step, sampled_tokens(step, args[0] if kind == "step" else [9] * 64, {}))
                if step.inputs
                else None
            )
        elif kind in ("step", "fail"):
            step = s.schedule()
            s.blocks.copies_done(s.blocks.take_copies())
            jobs += [j.request_id for j in step.jobs]
            failed = (
                {args[0] % len(step.inputs): "ValueError: boom"}
                if kind == "fail" and step.inputs
                else {}
            )
            tokens = args[0] if kind == "step" else [9] * 64
            for out in s.postprocess(step, sampled_tokens(step, tokens, failed), failed):
                assert out.request_id in ids
        check(s, in_flight[0] if in_flight else None)
    target(float(s.num_preemptions), label="preemptions")  # steer the search to the rarest path
    take(in_flight)
    # Every client leaves, every outstanding prefill job answers: nothing may stay allocated.
    for rid in ids:
        s.abort(rid)
    for rid in jobs:
        s.prefill_done(PrefillDone(rid, None))
    check(s)
    assert not s.by_id and s.blocks.usage == 0.0 and s.blocks.num_free_blocks == num_blocks
