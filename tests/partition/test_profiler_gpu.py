"""`ppd profile partition`'s GPU bench, on the CPU with stand-ins for the green contexts and the
engine: each share's decode replays a graph set captured on that share's stream and sized for its
SMs; a pair's prefill runs eagerly on a sibling engine; the GEMM is timed with cuBLAS's SM carveout
set to the SMs outside the share, then reset."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from partition import profiler_gpu, share_timer
from partition.profiler_gpu import GpuBench

TOTAL = 132


class FakeRunner:
    def __init__(self) -> None:
        self.captured: list[tuple[dict, dict | None]] = []
        self.selected = None  # the graph set steps replay now
        self.backend = SimpleNamespace(supports_cuda_graphs=True)
        self.kv_pool = torch.zeros(1)

    def capture_graphs(
        self, max_batch: int, streams: dict, sms: dict | None = None, max_tokens: int = 512
    ) -> None:
        assert max_batch == 8 and max_tokens == 0, (
            "decode buckets only: the profile's prefills fit no token bucket"
        )
        self.captured.append((streams, sms))

    def use_graphs(self, key) -> None:
        assert any(key in streams for streams, _ in self.captured), f"no set {key} captured"
        self.selected = key


class FakeEngine:
    def __init__(self, name: str) -> None:
        self.name, self.runner = name, FakeRunner()
        self.plan, self.num_kv_blocks = SimpleNamespace(block_size=16), 64
        self.cfg, self.device = SimpleNamespace(max_num_seqs=8), torch.device("cpu")
        self.mcfg = SimpleNamespace(hidden_size=8, intermediate_size=16)


class FakeGreens:
    """Splits name their groups by SM count; a context is granted what was asked."""

    def __init__(self, driver, device: int) -> None:
        pass

    def whole_device(self):
        return SimpleNamespace(sm=SimpleNamespace(smCount=TOTAL))

    def split(self, resource, sms: int):
        return ("group", sms), ("rest", TOTAL - sms)

    def create(self, resource):
        return f"green stream {resource[0]} {resource[1]}", resource[1]

    def destroy(self) -> list[str]:
        return []


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch):
    """A GpuBench over fakes, and the steps it ran: (engine, graph set selected, stream entered)."""
    owner, sibling = FakeEngine("owner"), FakeEngine("sibling")
    entered: list = []
    steps: list[tuple] = []
    monkeypatch.setattr("partition.driver.cuda_driver", lambda: object())
    monkeypatch.setattr(profiler_gpu.Engine, "create", classmethod(lambda cls, cfg, names: owner))
    monkeypatch.setattr(profiler_gpu.Engine, "sibling", classmethod(lambda cls, engine: sibling))
    monkeypatch.setattr(profiler_gpu, "fill_random_kv", lambda engine: None)
    monkeypatch.setattr(profiler_gpu, "release_engine", lambda engine: None)
    monkeypatch.setattr(profiler_gpu, "GreenStreams", FakeGreens)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: "ordinary stream")

    @contextlib.contextmanager
    def stream(s):
        entered.append(s)
        yield
        entered.pop()

    def step(engine, inputs) -> float:
        steps.append((engine.name, engine.runner.selected, entered[-1] if entered else None))
        return 0.0

    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(share_timer, "greedy_step", step)
    made = GpuBench(None, decode_blocks=32)
    made.steps = steps
    yield made
    made.close()


def test_each_share_decodes_through_graphs_captured_on_its_stream_for_its_sms(
    bench: GpuBench,
) -> None:
    assert bench.decode_graphs and bench.total == TOTAL
    bench.decode(64, 2, 16, 3)
    bench.decode(TOTAL, 2, 16, 3)
    bench.decode(64, 4, 16, 3)  # a share's set is captured once
    assert bench.engine.runner.captured == [
        ({("share", 64): "green stream group 64"}, {("share", 64): 64}),
        ({("share", TOTAL): "ordinary stream"}, None),
    ]
    assert set(bench.steps) == {
        ("owner", ("share", 64), "green stream group 64"),
        ("owner", ("share", TOTAL), "ordinary stream"),
    }


def test_a_pair_decodes_on_its_own_graphs_beside_an_eager_prefill_on_the_rest(
    bench: GpuBench,
) -> None:
    assert len(bench.interference(64, TOTAL - 64, 2, 16, "append", 1, 8, 3)) == 3
    assert bench.engine.runner.captured == [
        ({("pair", 64): "green stream group 64"}, {("pair", 64): 64})
    ]
    decode = [s for s in bench.steps if s[0] == "owner"]
    prefill = [s for s in bench.steps if s[0] == "sibling"]
    assert (
        set(decode) == {("owner", ("pair", 64), "green stream group 64")} and len(decode) == 3 + 3
    )  # + warm-up
    assert prefill and set(prefill) == {("sibling", None, f"green stream rest {TOTAL - 64}")}
    assert bench.sibling.runner.captured == []


def test_the_gemm_is_timed_with_the_sms_outside_the_share_carved_out_then_reset(
    bench: GpuBench, monkeypatch: pytest.MonkeyPatch
) -> None:
    carveouts = []
    monkeypatch.setattr(torch._C, "_set_sm_carveout_experimental", carveouts.append, raising=False)
    found = bench.gemm(64, 32, repeat=2)
    assert carveouts == [TOTAL - 64, None]
    assert found["carveout"] == TOTAL - 64 and found["ms"] > 0 and found["carveout_ms"] > 0
    carveouts.clear()
    whole = bench.gemm(TOTAL, 32, repeat=2)
    assert carveouts == [] and whole["carveout"] == 0 and whole["carveout_ms"] == whole["ms"]
