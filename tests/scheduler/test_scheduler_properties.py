"""The decode worker's scheduler under arbitrary valid traffic (hypothesis): requests of any shape and sampling
parameters, aborts at any stage, prefill jobs that finish or fail in any order, tokens that stop or not. It never
raises, every live sequence is in exactly one state, and once every request has ended no KV block stays in use."""

from __future__ import annotations

from hypothesis import given, settings, target
from hypothesis import strategies as st

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from scheduler.decode_scheduler import DecodeScheduler
from scheduler.sequence import SeqState
from scheduler.messages import GenerateRequest, PrefillDone

VOCAB, EOS, BS = 40, 2, 4

sampling = st.builds(SamplingParams, temperature=st.sampled_from([0.0, 0.7]),
                     max_tokens=st.one_of(st.integers(1, 4), st.integers(20, 40)),  # short ones, and ones that grow
                     min_tokens=st.integers(0, 1), stop_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=3).map(tuple),
                     ignore_eos=st.booleans())
# A small alphabet, so that prompts share prefixes and the cache hits.
prompt = st.lists(st.sampled_from([5, 6, 7, 8]), min_size=1, max_size=24)
step = st.tuples(st.just("step"), st.lists(st.integers(0, VOCAB - 1), min_size=64, max_size=64))
add = st.tuples(st.just("add"), prompt, sampling, st.sampled_from(["prefill", "decode"]))
prefill_done = st.tuples(st.just("prefill_done"), st.integers(0, 30), st.sampled_from([None, EOS, 9, 20]))
# Steps are most of a worker's life (sequences grow, finish, get preempted); aborts and failures are rarer.
op = st.one_of(add, add, step, step, step, step, step, step, prefill_done, prefill_done,
               st.tuples(st.just("abort"), st.integers(0, 30)), st.tuples(st.just("fail"), st.integers(0, 30)))


def check(s: DecodeScheduler) -> None:
    states = [q.request_id for q in (*s.waiting, *s.remote.values(), *s.prefilling, *s.running)]
    assert sorted(states) == sorted(s.by_id), "each live sequence in exactly one state"
    for q in s.by_id.values():
        assert (q.request_id in s.blocks) == (q.state is not SeqState.WAITING)
    assert len(s.running) + len(s.prefilling) + len(s.remote) <= s.max_num_seqs


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(op, min_size=30, max_size=100), num_blocks=st.integers(6, 24), budget=st.integers(4, 24),
       aggregated=st.booleans())
def test_any_traffic_keeps_the_scheduler_consistent_and_frees_every_block(ops, num_blocks, budget, aggregated) -> None:
    s = DecodeScheduler(BlockManager(num_blocks, BS), (EOS,), max_model_len=64, max_num_seqs=4,
                        max_num_batched_tokens=max(budget, 4), inline_all=aggregated, vocab_size=VOCAB)
    jobs: list[str] = []  # prefill jobs handed off and not answered yet
    ids: list[str] = []
    for kind, *args in ops:
        if kind == "add":
            rid = f"r{len(ids)}"
            ids.append(rid)
            tokens, params, route = args
            s.add(GenerateRequest(rid, tokens, params, route))
        elif kind == "abort" and ids:
            rid = ids[args[0] % len(ids)]
            if s.abort(rid):
                assert rid in jobs  # the prefill worker must be told, and answers with PrefillDone
        elif kind == "prefill_done" and jobs:
            rid = jobs.pop(args[0] % len(jobs))
            s.prefill_done(PrefillDone(rid, args[1], None if args[1] is not None else "failed"))
        elif kind in ("step", "fail"):
            step = s.schedule()
            jobs += [j.request_id for j in step.jobs]
            failed = {args[0] % len(step.inputs): "ValueError: boom"} if kind == "fail" and step.inputs else {}
            tokens = args[0] if kind == "step" else [9] * 64
            sampled = [None if pos in failed else tokens[k] for k, pos in
                       enumerate(p for p, i in enumerate(step.inputs) if i.sample)]
            for out in s.postprocess(step, sampled, failed):
                assert out.request_id in ids
        check(s)
    target(float(s.num_preemptions), label="preemptions")  # steer the search to the rarest path
    # Every client leaves, every outstanding prefill job answers: nothing may stay allocated.
    for rid in ids:
        s.abort(rid)
    for rid in jobs:
        s.prefill_done(PrefillDone(rid, None))
    check(s)
    assert not s.by_id and s.blocks.usage == 0.0 and s.blocks.num_free_blocks == num_blocks
