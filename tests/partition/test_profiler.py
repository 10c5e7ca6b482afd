"""`ppd profile partition` and its file: the schema, the share lookups, resuming, and a real run on
the demo."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.demo import demo_model_path
from partition import profiler_cli
from partition.profile import (
    DecodePoint,
    InterferencePoint,
    PartitionProfile,
    PrefillPoint,
    ProfileError,
    profile_path,
)
from partition.profile_report import markdown, plot
from partition.profiler import (
    Grid,
    ProfilerError,
    engine_setup,
    job_key,
    jobs,
    partial_path,
    profile,
)
from partition.profiler_cpu import CpuBench
from profiles import cpu_device_name

# Decode step times (ms) of share 1 at batches 1, 4 and contexts 100, 300; share 2 takes half as
# long.
STEPS_1 = {(1, 100): 2.0, (1, 300): 4.0, (4, 100): 8.0, (4, 300): 12.0}
TINY = Grid(
    shares=(1, 2),
    batches=(1, 4),
    contexts=(100, 300),
    prompts=(64,),
    prefill_tokens=64,
    pairs=((1, 1),),
    concurrent=(1, 4),
    new_tokens=16,
    steps=3,
    prefill_repeat=1,
)


def synthetic() -> PartitionProfile:
    decode = [DecodePoint(1, b, c, ms, ms * 1.5) for (b, c), ms in STEPS_1.items()]
    decode += [DecodePoint(2, b, c, ms / 2, ms * 0.75) for (b, c), ms in STEPS_1.items()]
    return PartitionProfile(
        "cpu-2core",
        "demo-v1",
        "cores",
        2,
        [1, 2],
        decode,
        [PrefillPoint(1, 64, 1000.0)],
        [InterferencePoint(1, 1, 4, 100, "full", 1, 16, 10.0, 8.0)],
        {"note": "by hand"},
    )


# ---- the file ------------------------------------------------------------------------------------


def test_profile_round_trips_through_its_file(tmp_path: Path) -> None:
    original = synthetic()
    path = original.save(tmp_path / "p.json")
    loaded = PartitionProfile.load(path)
    assert loaded.to_json() == original.to_json()
    assert loaded.decode_step_ms(2, 4, 300) == 6.0 and loaded.prefill_tokens_per_s(1, 50) == 1000.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(schema="ppd-policy-table"), "not a ppd partition profile"),
        (lambda d: d.update(version=2), "version 2, this server reads 1"),
        (lambda d: d["decode"][0].pop("step_ms"), "malformed partition profile"),
        (lambda d: d["prefill"][0].update(tokens_per_s="fast"), "malformed partition profile"),
        (lambda d: d.update(shares=[2, 1]), "must be distinct, ascending"),
        (lambda d: d.update(shares=[1, 4]), "must be distinct, ascending, from 1 to total 2"),
        (lambda d: d.update(unit="threads"), "unit 'threads'"),
        (lambda d: d["decode"][0].update(share=3), "needs a listed share"),
    ],
)
def test_a_bad_file_names_its_problem(tmp_path: Path, change, message: str) -> None:
    data = synthetic().to_json()
    change(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=message) as info:
        PartitionProfile.load(path)
    assert str(path) in str(info.value)


def test_unreadable_files_raise_profile_errors(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="cannot read"):
        PartitionProfile.load(tmp_path / "missing.json")
    (tmp_path / "junk.json").write_text("{")
    with pytest.raises(ProfileError, match="not JSON"):
        PartitionProfile.load(tmp_path / "junk.json")


# ---- the lookups ---------------------------------------------------------------------------------


def test_decode_step_is_bilinear_inside_the_grid_and_linear_past_it() -> None:
    p = synthetic()
    assert p.decode_step_ms(1, 4, 300) == 12.0  # a measured point
    # batch 2.5 is halfway from 1 to 4, context 200 halfway from 100 to 300: (3 at batch 1 + 10 at
    # batch 4) / 2.
    assert p.decode_step_ms(1, 2.5, 200) == pytest.approx(6.5)
    # batch 7 is two intervals past 1 along 1 -> 4, at context 300 (4 -> 12): 4 + 2 * 8.
    assert p.decode_step_ms(1, 7, 300) == pytest.approx(20.0)
    # Below the grid: the smallest batch and context, never less than the fastest measured step.
    assert p.decode_step_ms(1, 0, 10) == 2.0
    assert p.decode_step_ms(3, 1, 100) is None  # share not measured


def test_a_share_without_a_full_grid_has_no_prediction() -> None:
    p = synthetic()
    partial = PartitionProfile(p.device, p.model, p.unit, p.total, p.shares, p.decode[:-1])
    assert partial.decode_step_ms(2, 1, 100) is None and partial.decode_step_ms(1, 1, 100) == 2.0


def test_min_decode_share_is_the_smallest_share_within_the_slo() -> None:
    p = synthetic()
    # batch 4, context 300: share 1 steps 12 ms, share 2 steps 6 ms.
    assert p.min_decode_share(4, 300, 20.0) == 1
    assert p.min_decode_share(4, 300, 10.0) == 2
    assert p.min_decode_share(4, 300, 5.0) is None
    # batch 2.5, context 200: share 1 6.5 ms (above), share 2 3.25 ms.
    assert p.min_decode_share(2.5, 200, 5.0) == 2


# ---- the sweep: resuming and starting over -------------------------------------------------------


class FakeBench:
    """Stands in for the engine: step times from STEPS_1 (halved on share 2), doubled beside a
    prefill; records the points asked for and can be interrupted (Ctrl-C) at a point. With
    `drift`, the n-th decode of a point takes drift[n] times as long."""

    unit, total = "cores", 2

    def __init__(self, drift: tuple[float, ...] = (1.0,)) -> None:
        self.calls: list[tuple] = []
        self.interrupt_at: int | None = None
        self.drift = drift

    def _called(self, *point) -> None:
        self.calls.append(point)
        if len(self.calls) == self.interrupt_at:
            raise KeyboardInterrupt

    def decode(self, share, batch, context, steps):
        self._called("decode", share, batch, context)
        slower = self.drift[self.calls.count(self.calls[-1]) - 1]
        return [STEPS_1[batch, context] / share * slower] * steps

    def prefill(self, share, prompt, total, repeat):
        self._called("prefill", share, prompt)
        return 1000.0 * share

    def interference(
        self, decode_share, prefill_share, batch, context, kind, concurrent, new_tokens, steps
    ):
        self._called("interference", decode_share, prefill_share, batch, context, kind, concurrent)
        return [STEPS_1[batch, context] * (2 if concurrent else 1)] * steps

    def gemm(self, share, tokens, repeat):
        self._called("gemm", share)
        return {
            "ms": 2.0,
            "carveout": self.total - share,
            "carveout_ms": 1.5 if share < self.total else 2.0,
        }

    def close(self) -> None:
        pass


def run(bench: FakeBench, out: Path, grid: Grid = TINY) -> PartitionProfile:
    return profile(bench, grid, out, "cpu-2core", "demo-v1", {"command": "test"}, progress=False)


def test_profile_measures_every_point_and_drops_its_partial_file(tmp_path: Path) -> None:
    bench, out = FakeBench(), tmp_path / "p.json"
    result = run(bench, out)
    # decode: 2 shares x 2 batches x 2 contexts; prefill: 2 shares; interference: 4 cells x (alone +
    # 2 kinds x 2).
    assert len(bench.calls) == 8 + 2 + 4 * 5 == len(jobs(TINY))
    assert (
        PartitionProfile.load(out).to_json() == result.to_json() and not partial_path(out).exists()
    )
    assert result.decode_step_ms(2, 4, 300) == 6.0
    point = next(
        p
        for p in result.interference
        if (p.batch, p.context, p.kind, p.concurrent) == (4, 300, "append", 4)
    )
    assert (point.tpot_ms, point.tpot_alone_ms, point.new_tokens) == (24.0, 12.0, 16)
    assert {p.concurrent for p in result.interference} == {0, 1, 4}
    assert "| 1 / 1 | 4 | 300 | 12.00 | 2.00 | 2.00 | 2.00 | 2.00 |" in markdown(result)
    plot(result, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_each_figure_is_the_median_of_its_rounds(tmp_path: Path) -> None:
    bench = FakeBench(drift=(1.0, 5.0, 2.0))
    result = run(bench, tmp_path / "p.json", replace(TINY, rounds=3))
    assert len(bench.calls) == 3 * len(jobs(TINY))
    assert result.decode_step_ms(1, 4, 300) == 24.0  # 12 ms x the middle of 1, 5 and 2


def test_an_interrupted_profile_resumes_without_measuring_again(tmp_path: Path) -> None:
    bench, out = FakeBench(), tmp_path / "p.json"
    bench.interrupt_at = 12
    with pytest.raises(KeyboardInterrupt):
        run(bench, out)
    saved = json.loads(partial_path(out).read_text())["raw"]
    assert len(saved) == 11 and not out.exists()  # the points before Ctrl-C, on disk
    resumed = FakeBench()
    result = run(resumed, out)
    assert len(resumed.calls) == len(jobs(TINY)) - 11
    assert not {job_key(0, call) for call in resumed.calls} & set(saved)
    assert len(result.decode) == 8 and len(result.interference) == 4 * 2 * 3


def test_other_settings_start_over(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bench, out = FakeBench(), tmp_path / "p.json"
    bench.interrupt_at = 5
    with pytest.raises(KeyboardInterrupt):
        run(bench, out)
    again = FakeBench()
    run(again, out, replace(TINY, steps=5))
    assert len(again.calls) == len(jobs(TINY))
    assert "other settings; starting over" in capsys.readouterr().err


def test_the_gemm_with_and_without_the_carveout_lands_in_the_profiles_meta(tmp_path: Path) -> None:
    bench = FakeBench()
    result = run(bench, tmp_path / "p.json", replace(TINY, gemm_tokens=32))
    assert [c for c in bench.calls if c[0] == "gemm"] == [("gemm", 1), ("gemm", 2)]
    assert result.meta["gemm_carveout"] == [
        {"share": 1, "tokens": 32, "carveout": 1, "ms": 2.0, "carveout_ms": 1.5},
        {"share": 2, "tokens": 32, "carveout": 0, "ms": 2.0, "carveout_ms": 2.0},
    ]
    text = markdown(PartitionProfile.load(tmp_path / "p.json"))
    assert "cuBLAS's SM carveout" in text and "| 1 | 1 | 2.00 | 1.50 | 0.75 |" in text
    assert "| 2 | 0 | 2.00 | - | - |" in text
    plain = FakeBench()  # a grid without gemm_tokens (every CPU grid) times none
    assert "gemm_carveout" not in run(plain, tmp_path / "q.json").meta and "gemm" not in {
        c[0] for c in plain.calls
    }


def test_a_gpu_grid_times_the_gemm_only_where_torch_can_set_the_carveout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parser = argparse.ArgumentParser()
    profiler_cli.add_partition_args(parser)
    choose = profiler_cli.choose_grid
    assert choose(parser.parse_args([]), gpu=False, total=2).gemm_tokens == 0
    with pytest.raises(ProfilerError, match="on the CPU leave it out"):
        choose(parser.parse_args(["--gemm-tokens", "64"]), gpu=False, total=2)
    monkeypatch.setattr(profiler_cli, "sm_carveout_available", lambda: True)
    assert choose(parser.parse_args(["--quick"]), gpu=True, total=132).gemm_tokens == 8192
    assert choose(parser.parse_args(["--gemm-tokens", "0"]), gpu=True, total=132).gemm_tokens == 0
    monkeypatch.setattr(profiler_cli, "sm_carveout_available", lambda: False)
    assert choose(parser.parse_args([]), gpu=True, total=132).gemm_tokens == 0
    with pytest.raises(ProfilerError, match="cannot set cuBLAS's SM carveout"):
        choose(parser.parse_args(["--gemm-tokens", "64"]), gpu=True, total=132)


def test_bad_grid_arguments_name_the_fix() -> None:
    parser = argparse.ArgumentParser()
    profiler_cli.add_partition_args(parser)
    with pytest.raises(ProfilerError, match="distinct, increasing"):
        profiler_cli.choose_grid(parser.parse_args(["--batches", "8,1"]), gpu=False, total=2)
    with pytest.raises(ProfilerError, match="up to 2 cores"):
        profiler_cli.choose_grid(parser.parse_args(["--shares", "1,4"]), gpu=False, total=2)
    with pytest.raises(ProfilerError, match="multiples of 8"):
        profiler_cli.choose_grid(parser.parse_args(["--shares", "12,64"]), gpu=True, total=132)


def test_ppd_profile_alone_runs_partition_then_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import policy_profile
    from cli import main as cli

    ran = []
    monkeypatch.setattr(profiler_cli, "main", lambda args: ran.append(("partition", args.quick)))
    monkeypatch.setattr(policy_profile, "main", lambda args: ran.append(("policy", args.quick)))
    assert cli.main(["profile", "--quick"]) == 0 and ran == [("partition", True), ("policy", True)]
    ran.clear()
    assert cli.main(["profile", "partition"]) == 0 and ran == [("partition", False)]


@pytest.fixture
def fake_run(monkeypatch: pytest.MonkeyPatch) -> dict:
    """`ppd profile partition` with nothing measured: the synthetic profile saved where the command
    writes; returns what it saw (the model folder, the outputs)."""
    seen: dict = {}
    fake_cfg = type("Cfg", (), {"num_kv_blocks": 1})()

    def fake_setup(folder, grid, device, dtype):
        seen["folder"] = folder
        return fake_cfg, 0

    def fake_profile(bench, grid, out, *rest):
        seen.setdefault("outs", []).append(out)
        return synthetic().save(out)

    class NoBench:
        decode_graphs = False

        def __init__(self, *args) -> None:
            pass

        def close(self) -> None:
            pass

    monkeypatch.setattr(profiler_cli, "engine_setup", fake_setup)
    monkeypatch.setattr(profiler_cli, "CpuBench", NoBench)
    monkeypatch.setattr(profiler_cli, "profile", fake_profile)
    monkeypatch.setattr(profiler_cli, "markdown", lambda result: "")
    monkeypatch.setattr(profiler_cli, "plot", lambda result, path: None)
    monkeypatch.setattr(profiler_cli, "_busy_cores", lambda: 0.0)
    return seen


def test_model_demo_and_an_out_folder(fake_run: dict, tmp_path: Path) -> None:
    """`--model demo` is the built-in demo model, as wherever --model is taken; `--out` a folder
    gets the profile under its default name (an existing folder, or a new one named with a
    trailing separator)."""
    from cli import main as cli

    new_folder = tmp_path / "new"
    for out in (str(tmp_path), f"{new_folder}/", str(tmp_path / "named.json")):
        assert (
            cli.main(
                [
                    "profile",
                    "partition",
                    "--model",
                    "demo",
                    "--device",
                    "cpu",
                    "--quick",
                    "--out",
                    out,
                ]
            )
            == 0
        )
    assert fake_run["folder"] == str(demo_model_path())
    default = profile_path(cpu_device_name(), demo_model_path().name).name
    assert fake_run["outs"] == [tmp_path / default, new_folder / default, tmp_path / "named.json"]


def test_without_out_the_profile_goes_to_the_user_folder_and_the_server_reads_it_first(
    fake_run: dict, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """No --out: $PPD_CACHE_DIR/profiles/<device>__demo-v2.json, said as the run starts, never the
    shipped profiles/ (in an install, site-packages); the server's lookup of the demo then takes it
    before the shipped one."""
    from cli import main as cli
    from profiles import PROFILES_DIR
    from server.plan import partition_profile_for

    monkeypatch.setenv("PPD_CACHE_DIR", str(tmp_path / "cache"))
    shipped = {path: path.read_bytes() for path in PROFILES_DIR.iterdir() if path.is_file()}
    assert cli.main(["profile", "partition", "--model", "demo", "--device", "cpu", "--quick"]) == 0
    written = tmp_path / "cache" / "profiles" / f"{cpu_device_name()}__demo-v2.json"
    assert (
        fake_run["outs"] == [written] and written.is_file() and written.with_suffix(".md").is_file()
    )
    assert f"into {written}" in capsys.readouterr().err
    assert {path: path.read_bytes() for path in PROFILES_DIR.iterdir() if path.is_file()} == shipped
    args = argparse.Namespace(partition_profile=None)
    assert partition_profile_for(args, "cpu", fake_run["folder"]) == str(written)


# ---- real runs -----------------------------------------------------------------------------------


@pytest.mark.slow  # a whole run against a live server: the second suite
def test_a_real_run_on_the_demo_writes_a_loadable_profile(tmp_path: Path) -> None:
    # Decode on core 0 and prefill on core 1 (on a 1-core machine, both on core 0).
    grid = Grid(
        shares=(1,),
        batches=(2,),
        contexts=(16,),
        prompts=(16,),
        prefill_tokens=16,
        pairs=((1, 1),),
        concurrent=(1,),
        new_tokens=8,
        steps=2,
        prefill_repeat=1,
    )
    out = tmp_path / "cpu.json"
    bench = CpuBench(*engine_setup(str(demo_model_path()), grid, "cpu", "auto"))
    try:
        result = profile(bench, grid, out, "cpu-test", "demo-v1", {}, progress=False)
    finally:
        bench.close()
    loaded = PartitionProfile.load(out)
    assert loaded.unit == "cores" and loaded.shares == [1]
    assert all(p.step_ms > 0 and p.step_p90_ms >= p.step_ms for p in loaded.decode)
    assert loaded.prefill and all(p.tokens_per_s > 0 for p in loaded.prefill)
    assert {(p.kind, p.concurrent) for p in loaded.interference} == {
        ("full", 0),
        ("full", 1),
        ("append", 0),
        ("append", 1),
    }
    assert all(p.tpot_ms > 0 for p in loaded.interference)
    assert result.decode_step_ms(1, 2, 16) == loaded.decode[0].step_ms


@pytest.mark.gpu
def test_a_real_run_on_green_context_streams(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from partition.profiler_gpu import GpuBench, sm_carveout_available

    grid = Grid(
        shares=(16, 32),
        batches=(2,),
        contexts=(64,),
        prompts=(64,),
        prefill_tokens=64,
        pairs=(),
        concurrent=(1,),
        new_tokens=32,
        steps=3,
        prefill_repeat=1,
        gemm_tokens=64 if sm_carveout_available() else 0,
    )
    cfg, decode_blocks = engine_setup(str(demo_model_path()), grid, "cuda", "auto")
    bench = GpuBench(cfg, decode_blocks)
    try:
        grid = replace(grid, pairs=((32, bench.total - 32),))  # the rest of the device's SMs
        result = profile(
            bench, grid, tmp_path / "gpu.json", "gpu-test", "demo-v1", {}, progress=False
        )
        assert (
            bench.decode_graphs
        )  # the triton backend: every share's decode replays its own graphs
    finally:
        bench.close()
    assert result.unit == "sms" and all(p.step_ms > 0 for p in result.decode)
    assert all(p.tpot_ms > 0 for p in result.interference)
    if grid.gemm_tokens:
        assert [(r["share"], r["carveout"]) for r in result.meta["gemm_carveout"]] == [
            (16, bench.total - 16),
            (32, bench.total - 32),
        ]
        assert all(r["ms"] > 0 and r["carveout_ms"] > 0 for r in result.meta["gemm_carveout"])
