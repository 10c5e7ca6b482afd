"""Green-context splits: the default decode SM counts, the choice of a split by decode's share, and (on a GPU) that
the driver grants the counts asked for, that the two streams of a split run at the same time, and that a decode
graph captured on a split's stream gives the eager step's logits."""

from __future__ import annotations

import pytest
import torch

from partition.green import WHOLE, StreamPair, StreamSplits, check_decode_sms, default_decode_sms


def test_default_splits_are_quarters_in_multiples_of_eight() -> None:
    assert default_decode_sms(132) == (32, 64, 96)  # an H100 SXM
    assert default_decode_sms(114) == (24, 56, 80)  # an H100 PCIe
    assert default_decode_sms(16) == (8,)  # a small device: one split, 8 and 8
    for total in range(16, 200):
        counts = default_decode_sms(total)
        assert counts and all(c % 8 == 0 and 8 <= c < total for c in counts)


def test_decode_counts_are_checked_against_the_device() -> None:
    assert check_decode_sms([96, 32, 64, 32], 132) == (32, 64, 96)
    with pytest.raises(ValueError, match="leave prefill some"):
        check_decode_sms([64, 132], 132)
    with pytest.raises(ValueError, match="no SM counts"):
        check_decode_sms([])


def test_a_split_is_found_by_decode_share_and_whole_by_none() -> None:
    pairs = {k: StreamPair(f"d{n}", f"p{n}", n, 132 - n) for k, n in enumerate((32, 64, 96))}
    splits = StreamSplits(132, StreamPair("d", "p", 132, 132), pairs)
    assert splits.decode_counts() == (32, 64, 96) and splits.keys == [WHOLE, 0, 1, 2]
    assert splits.key_for(64) == 1 and splits.key_for(None) == WHOLE and splits.middle_decode_sms() == 64
    assert (splits.stream("decode", 2), splits.stream("prefill", 2), splits.sms("prefill", 2)) == ("d96", "p96", 36)
    with pytest.raises(KeyError, match="no split gives decode 48 SMs"):
        splits.key_for(48)
    assert "32/100, 64/68, 96/36" in splits.describe()


# ---- on a GPU ---------------------------------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def splits():
    pytest.importorskip("cuda.bindings", reason="green contexts need cuda-python")
    torch.zeros(1, device="cuda")
    total = torch.cuda.get_device_properties(0).multi_processor_count
    made = StreamSplits.green(default_decode_sms(total))
    yield made
    assert made.destroy() == []


@pytest.mark.gpu
@needs_gpu
def test_the_driver_grants_each_split_and_its_rest(splits: StreamSplits) -> None:
    for key in splits.keys:
        if key != WHOLE:
            assert splits.sms("decode", key) + splits.sms("prefill", key) <= splits.total_sms
            assert splits.sms("prefill", key) >= splits.total_sms - splits.sms("decode", key) - 8


@pytest.mark.gpu
@needs_gpu
def test_the_two_streams_of_a_split_run_at_the_same_time(splits: StreamSplits) -> None:
    """Kernels enqueued on a split's two streams overlap in time (events bracket each stream's work)."""
    key = splits.key_for(splits.decode_counts()[len(splits.decode_counts()) // 2])
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    marks = {}
    for role in ("decode", "prefill"):
        stream = splits.stream(role, key)
        with torch.cuda.stream(stream):
            torch.matmul(a, a)  # warm-up (cuBLAS workspace for this stream)
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    for role in ("decode", "prefill"):
        stream = splits.stream(role, key)
        stream.wait_event(start)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            begin.record()
            for _ in range(20):
                torch.matmul(a, a)
            end.record()
        marks[role] = (begin, end)
    torch.cuda.synchronize()
    (db, de), (pb, pe) = marks["decode"], marks["prefill"]
    d0, d1 = start.elapsed_time(db), start.elapsed_time(de)
    p0, p1 = start.elapsed_time(pb), start.elapsed_time(pe)
    overlap = min(d1, p1) - max(d0, p0)
    assert overlap > 0.5 * min(d1 - d0, p1 - p0), f"decode ran {d0:.1f}-{d1:.1f} ms, prefill {p0:.1f}-{p1:.1f} ms"


@pytest.mark.gpu
@needs_gpu
def test_a_decode_graph_captured_on_each_split_gives_the_eager_logits(splits: StreamSplits, tmp_path) -> None:
    from engine.engine import Engine, EngineConfig
    from engine.model_runner import StepInput
    from tests.tiny_models import write_tiny_model

    folder = write_tiny_model(tmp_path / "llama", "llama")
    cfg = EngineConfig(model=str(folder), dtype="float32", device="cuda", num_kv_blocks=64, max_num_seqs=8,
                       max_num_batched_tokens=64, shares_device=False)
    streams = {key: splits.stream("decode", key) for key in splits.keys}
    engine = Engine.create(cfg, (f"ppd-test-{id(cfg)}-w", f"ppd-test-{id(cfg)}-kv"), streams)
    runner = engine.runner
    assert set(runner.graph_sets) == set(splits.keys)
    runner.forward([StepInput(list(range(3, 40)), 0, [0, 1, 2]), StepInput(list(range(5, 30)), 0, [3, 4])])
    decode = [StepInput([7], 37, [0, 1, 2]), StepInput([9], 25, [3, 4])]
    graphs, runner.graphs = runner.graphs, None
    eager = runner.forward(decode).clone()
    runner.graphs = graphs
    for key in splits.keys:
        runner.use_graphs(key)
        with torch.cuda.stream(splits.stream("decode", key)):
            replayed = runner.forward(decode).clone()
        torch.cuda.synchronize()
        torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4)
