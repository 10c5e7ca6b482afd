"""Green-context splits: the default decode SM counts, the choice of a split by decode's share, and
(on a GPU) that the driver grants the counts asked for (Hopper: multiples of 8) and the log says
so, that the two groups of a split are disjoint on the device (the SM ids their kernels read from
%smid), that the two streams of a split run at the same time, that a graph captured on a split's
stream replays on that split's SMs, that every split has a decode graph for every batch bucket
giving the eager step's logits, and that torch's own GreenContext.create makes no split (which is
why partition/ does not use it)."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest
import torch

from partition.green import (
    WHOLE,
    GreenError,
    StreamPair,
    StreamSplits,
    check_decode_sms,
    default_decode_sms,
)

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS_PER_SM = 8  # sm_ids programs per SM of the device: every SM a stream may use gets some


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
    assert (
        splits.key_for(64) == 1
        and splits.key_for(None) == WHOLE
        and splits.middle_decode_sms() == 64
    )
    assert (splits.stream("decode", 2), splits.stream("prefill", 2), splits.sms("prefill", 2)) == (
        "d96",
        "p96",
        36,
    )
    with pytest.raises(KeyError, match="no split gives decode 48 SMs"):
        splits.key_for(48)
    assert "32/100, 64/68, 96/36" in splits.describe()


def test_no_code_makes_a_split_from_torchs_green_context_create() -> None:
    """torch's GreenContext.create(n) (2.10, 2.11) splits the whole device's SMs on every call and
    keeps the first group, so two contexts made by two calls may run on the same SMs
    (test_torch_green_contexts_overlap shows it on a GPU). A split is one
    cuDevSmResourceSplitByCount (partition/green.py); no module may call create()."""
    calls = []
    for folder in ("partition", "scheduler", "engine", "server"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "create"
                    and "GreenContext" in ast.unparse(node.func.value)
                ):
                    calls.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert calls == []


# ---- on a GPU ------------------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def splits():
    pytest.importorskip("cuda.bindings", reason="green contexts need cuda-python")
    torch.zeros(1, device="cuda")
    total = torch.cuda.get_device_properties(0).multi_processor_count
    made = StreamSplits.green(default_decode_sms(total))
    yield made
    assert made.destroy() == []


def ran_on(*streams) -> list[set[int]]:
    """The SMs that PROGRAMS_PER_SM x the device's SMs programs, enqueued on each stream at once,
    ran on."""
    from partition.probe_kernels import sm_ids

    programs = PROGRAMS_PER_SM * torch.cuda.get_device_properties(0).multi_processor_count
    launched = []
    for stream in streams:
        with torch.cuda.stream(stream):
            launched.append(sm_ids(programs))
    for stream in streams:
        stream.synchronize()
    return [set(ids.tolist()) for ids in launched]


def split_keys(splits: StreamSplits) -> list[int]:
    return [key for key in splits.keys if key != WHOLE]


@pytest.mark.gpu
@needs_gpu
def test_the_driver_grants_each_split_and_its_rest(splits: StreamSplits) -> None:
    for key in split_keys(splits):
        decode, prefill = splits.sms("decode", key), splits.sms("prefill", key)
        assert decode % 8 == 0 and decode >= 8, (
            f"Hopper grants multiples of 8 SMs, this split got {decode}"
        )
        assert prefill >= 8 and decode + prefill <= splits.total_sms
        assert prefill >= splits.total_sms - decode - 8


@pytest.mark.gpu
@needs_gpu
def test_the_granted_counts_are_logged_and_a_count_hopper_cannot_grant_is_refused(
    splits: StreamSplits, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="ppd.partition"):
        made = StreamSplits.green([16])
    try:
        key = made.key_for(16)
        rest = made.sms("prefill", key)
        assert (
            f"{made.total_sms} SMs; SMs granted to decode/prefill in each split 16/{rest}"
            in caplog.text
        )
    finally:
        assert made.destroy() == []
    if torch.cuda.get_device_capability(0)[0] == 9:  # Hopper: 12 SMs is no group; 8 or 16 are
        with pytest.raises(GreenError):
            StreamSplits.green([12])


@pytest.mark.gpu
@needs_gpu
def test_the_two_groups_of_each_split_are_disjoint_on_the_device(splits: StreamSplits) -> None:
    """Both streams of a split fill the device with programs that record their SM (%smid): the two
    sets of SM ids do not meet, and neither is larger than its group. On the ordinary streams the
    same launch reaches more SMs than any decode group has (the probe sees the whole device, so
    the bounds above are the partition's doing)."""
    (whole,) = ran_on(splits.stream("decode", WHOLE))
    assert len(whole) > max(splits.decode_counts()), (
        f"an unsplit launch reached only {len(whole)} SMs"
    )
    for key in split_keys(splits):
        decode, prefill = ran_on(splits.stream("decode", key), splits.stream("prefill", key))
        assert not decode & prefill, (
            f"split {key}: SMs {sorted(decode & prefill)} ran both sides' programs"
        )
        assert 0 < len(decode) <= splits.sms("decode", key)
        assert 0 < len(prefill) <= splits.sms("prefill", key)


@pytest.mark.gpu
@needs_gpu
def test_a_graph_captured_on_a_split_stream_replays_on_that_splits_sms(
    splits: StreamSplits,
) -> None:
    """The way decode graphs run: captured on a split's decode stream, replayed there while the
    prefill stream of the split runs eagerly. The replay's programs stay on the decode group's
    SMs."""
    from partition.probe_kernels import sm_ids

    programs = PROGRAMS_PER_SM * splits.total_sms
    for key in split_keys(splits):
        decode_stream, prefill_stream = splits.stream("decode", key), splits.stream("prefill", key)
        with torch.cuda.stream(decode_stream):
            sm_ids(programs)  # compiles the kernel outside the capture
        decode_stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=decode_stream):
            replayed = sm_ids(programs)
        with torch.cuda.stream(prefill_stream):
            beside = sm_ids(programs)
        with torch.cuda.stream(decode_stream):
            graph.replay()
        decode_stream.synchronize()
        prefill_stream.synchronize()
        decode, prefill = set(replayed.tolist()), set(beside.tolist())
        assert not decode & prefill, (
            f"split {key}: SMs {sorted(decode & prefill)} ran both sides' programs"
        )
        assert 0 < len(decode) <= splits.sms("decode", key)


@pytest.mark.gpu
@needs_gpu
def test_torch_green_contexts_overlap() -> None:
    """The torch fact behind test_no_code_makes_a_split_from_torchs_green_context_create: two
    GreenContext.create calls each take their SMs from the whole device, so their streams' programs
    meet on the same SMs. If this fails, torch now splits disjointly, and partition/green.py could
    use it where that torch is installed."""
    green_contexts = pytest.importorskip("torch.cuda.green_contexts")
    if not green_contexts.SUPPORTED or not hasattr(green_contexts.GreenContext, "Stream"):
        pytest.skip(
            "this torch has no green contexts with streams (torch 2.11 added GreenContext.Stream)"
        )
    torch.zeros(1, device="cuda")
    first = green_contexts.GreenContext.create(num_sms=16, device_id=0)
    second = green_contexts.GreenContext.create(num_sms=16, device_id=0)
    a, b = ran_on(first.Stream(), second.Stream())
    assert 0 < len(a) <= 16 and 0 < len(b) <= 16
    assert a & b, f"two create(16) calls ran on disjoint SMs {sorted(a)} and {sorted(b)}"


@pytest.mark.gpu
@needs_gpu
def test_the_two_streams_of_a_split_run_at_the_same_time(splits: StreamSplits) -> None:
    """Kernels enqueued on a split's two streams overlap in time (events bracket each stream's
    work)."""
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
    assert overlap > 0.5 * min(d1 - d0, p1 - p0), (
        f"decode ran {d0:.1f}-{d1:.1f} ms, prefill {p0:.1f}-{p1:.1f} ms"
    )


@pytest.mark.gpu
@needs_gpu
def test_a_decode_graph_captured_on_each_split_gives_the_eager_logits(
    splits: StreamSplits, tmp_path
) -> None:
    from engine.cuda_graphs import bucket_sizes
    from engine.engine import Engine, EngineConfig
    from engine.model_runner import StepInput
    from tests.tiny_models import write_tiny_model

    folder = write_tiny_model(tmp_path / "llama", "llama")
    cfg = EngineConfig(
        model=str(folder),
        dtype="float32",
        device="cuda",
        num_kv_blocks=64,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        shares_device=False,
    )
    streams = {key: splits.stream("decode", key) for key in splits.keys}
    engine = Engine.create(cfg, (f"ppd-test-{id(cfg)}-w", f"ppd-test-{id(cfg)}-kv"), streams)
    runner = engine.runner
    assert set(runner.graph_sets) == set(splits.keys)
    for key, graphs in runner.graph_sets.items():  # a graph per (split, batch bucket)
        assert sorted(graphs.graphs) == graphs.sizes == bucket_sizes(cfg.max_num_seqs), key
    runner.forward(
        [StepInput(list(range(3, 40)), 0, [0, 1, 2]), StepInput(list(range(5, 30)), 0, [3, 4])]
    )
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
