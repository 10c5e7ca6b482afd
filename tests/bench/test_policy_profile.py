"""`ppd profile policy`: the table's runs, its file, resuming after an interruption, and a real run
on the demo."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import policy_profile
from bench.policy_profile import Grid, heatmap, markdown, profile
from cli import main as cli
from server.routing.policy_table import PolicyTable, run_key

GRID = Grid(
    contexts=(160, 544), shapes=((8, 64), (128, 8)), loads=(1, 4), turn1_output=32, duration=1.0
)


def fake_summary(context: int, shape: tuple[int, int], load: int, route: str) -> dict:
    """Latencies with a known winner: decode has the lower TTFT, and a TPOT cost that grows with the
    append."""
    ttft = 50.0 + load * 20 if route == "prefill" else 30.0
    tpot = 5.0 + (shape[0] / 20 if route == "decode" else 0.0)
    return {
        "requests": 20,
        "failed": 0,
        "n": 10,
        "ttft_p50_ms": ttft,
        "ttft_p90_ms": 2 * ttft,
        "tpot_p50_ms": tpot,
        "tpot_p90_ms": 2 * tpot,
        "queue_delay_ms": 1.0 * load,
        "routes": [route],
    }


class FakeMeasure:
    """Stands in for a run against a server: records the runs asked for; can be interrupted (Ctrl-C)
    at a run."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.interrupt_at: int | None = None
        self.failing: set[str] = set()  # runs whose every request fails

    def __call__(self, url, model, context, shape, load, route, grid, seed) -> dict:
        self.calls.append(run_key(context, shape, load, route))
        if len(self.calls) == self.interrupt_at:
            raise KeyboardInterrupt
        if self.calls[-1] in self.failing:
            return {
                "requests": 20,
                "failed": 20,
                "n": 0,
                "ttft_p50_ms": None,
                "ttft_p90_ms": None,
                "tpot_p50_ms": None,
                "tpot_p90_ms": None,
                "queue_delay_ms": 0.0,
                "routes": [],
                "errors": {"HTTP 500": 20},
            }
        return fake_summary(context, shape, load, route)


@pytest.fixture
def fake_measure(monkeypatch: pytest.MonkeyPatch) -> FakeMeasure:
    fake = FakeMeasure()
    monkeypatch.setattr(policy_profile, "measure", fake)
    monkeypatch.setattr(policy_profile, "_served_model", lambda url: "demo")
    return fake


def test_profile_measures_every_cell_on_both_routes_and_decides_x_star(
    fake_measure: FakeMeasure, tmp_path: Path
) -> None:
    out = tmp_path / "t.json"
    table = profile(
        "http://unused",
        GRID,
        out,
        "cpu-2core",
        "demo",
        {"command": "test"},
        1.0,
        10.0,
        progress=False,
    )
    assert len(fake_measure.calls) == 2 * 2 * 2 * 2 and len(table.cells) == 8
    # 8 new tokens: decode saves 40+ ms of TTFT for 0.4 ms of TPOT (x 10): decode. 128: 6.4 ms of
    # TPOT (x 10) costs more than the 40 ms saved at load 1, less than the 100 ms saved at load 4.
    assert (
        table.cells[(0, 0, 0)].x_star == 1
        and table.cells[(0, 1, 0)].x_star == 0
        and table.cells[(0, 1, 1)].x_star == 1
    )
    assert PolicyTable.load(out).to_json() == table.to_json()
    assert "| 160 | 128 / 8 | 1 |" in markdown(table)
    heatmap(table, tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_interrupted_profile_resumes_without_repeating_runs(
    fake_measure: FakeMeasure, tmp_path: Path
) -> None:
    out = tmp_path / "t.json"
    fake_measure.interrupt_at = 5
    with pytest.raises(KeyboardInterrupt):
        profile("http://unused", GRID, out, "cpu-2core", "demo", {}, 1.0, 10.0, progress=False)
    saved = PolicyTable.load(out)
    assert len(saved.raw) == 4  # the runs before the interruption, on disk
    fake_measure.interrupt_at = None
    before = len(fake_measure.calls)
    table = profile("http://unused", GRID, out, "cpu-2core", "demo", {}, 1.0, 10.0, progress=False)
    assert not set(fake_measure.calls[before:]) & set(saved.raw) and len(table.raw) == 16


def test_a_profile_of_another_model_is_not_resumed(
    fake_measure: FakeMeasure, tmp_path: Path
) -> None:
    out = tmp_path / "t.json"
    PolicyTable.from_runs(
        GRID.contexts, GRID.shapes, GRID.loads, {}, 1.0, 10.0, "cpu-2core", "other"
    ).save(out)
    with pytest.raises(policy_profile.BenchError, match="other on cpu-2core"):
        profile("http://unused", GRID, out, "cpu-2core", "demo", {}, 1.0, 10.0, progress=False)


def test_runs_that_measured_nothing_fail_the_profile_and_are_measured_again(
    fake_measure: FakeMeasure,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    monkeypatch.setattr(
        policy_profile, "_describe", lambda url, serve_args: ("cpu-2core", "demo", False)
    )
    argv = [
        "profile",
        "policy",
        "--url",
        "http://unused",
        "--out",
        str(tmp_path / "t.json"),
        "--contexts",
        "160",
        "--shapes",
        "8x64",
        "--loads",
        "1,4",
        "--no-progress",
    ]
    fake_measure.failing = {run_key(160, (8, 64), 1, "decode")}
    assert cli.main(argv) == 1
    (line,) = [
        line for line in capsys.readouterr().err.splitlines() if line.startswith("not measured:")
    ]
    assert (
        line
        == "not measured: 160x8x64@1:decode: no turn-2 request succeeded; 20 of 20 failed (20 x "
        "HTTP 500)"
    )
    fake_measure.failing = set()
    before = len(fake_measure.calls)
    assert cli.main(argv) == 0
    assert fake_measure.calls[before:] == [
        run_key(160, (8, 64), 1, "decode")
    ]  # only the run that measured nothing


# about 13 s on 2 cores: in the second suite, under the default one's budget
@pytest.mark.slow
def test_the_server_it_starts_logs_beside_the_table(tmp_path: Path) -> None:
    assert (
        cli.main(
            ["profile", "policy", "--serve-args=--no-such-flag", "--out", str(tmp_path / "t.json")]
        )
        == 2
    )
    assert "unrecognized arguments: --no-such-flag" in (tmp_path / "t.serve.log").read_text()
    folder = tmp_path / "tables"
    # --out a folder: the log goes in it (under a placeholder name until the table is named)
    folder.mkdir()
    assert cli.main(["profile", "policy", "--serve-args=--no-such-flag", "--out", str(folder)]) == 2
    assert (
        "unrecognized arguments: --no-such-flag"
        in (folder / "policy-profile.serve.log").read_text()
    )


def test_the_model_flags_go_to_the_server_it_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # The server gets --model and --dtype as `ppd serve` takes them: a folder that is not a model
    # stops it, and its log says which folder it was given.
    missing = tmp_path / "no-model"
    argv = [
        "profile",
        "policy",
        "--model",
        str(missing),
        "--dtype",
        "float32",
        "--out",
        str(tmp_path / "t.json"),
    ]
    assert cli.main(argv) == 2
    assert str(missing) in (tmp_path / "t.serve.log").read_text()
    assert (
        cli.main([*argv[:4], "--serve-args=--model demo", "--out", str(tmp_path / "t.json")]) == 2
    )
    assert "--model demo in --serve-args differ" in capsys.readouterr().err
    assert cli.main(["profile", "policy", "--url", "http://unused", "--model", "demo"]) == 2
    assert "with --url it is running already" in capsys.readouterr().err


def test_out_a_folder_gets_the_table_under_its_default_name(
    fake_measure: FakeMeasure, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(
        policy_profile, "_describe", lambda url, serve_args: ("cpu-2core", "demo", False)
    )
    argv = [
        "profile",
        "policy",
        "--url",
        "http://unused",
        "--contexts",
        "160",
        "--shapes",
        "8x64",
        "--loads",
        "1",
        "--no-progress",
        "--out",
    ]
    assert cli.main([*argv, str(tmp_path)]) == 0
    default = policy_profile.table_path("cpu-2core", "demo").name
    assert PolicyTable.load(tmp_path / default).model == "demo"
    assert cli.main([*argv, f"{tmp_path / 'new'}/"]) == 0 and (tmp_path / "new" / default).is_file()


def test_without_out_the_table_goes_to_the_user_folder_under_the_name_the_server_reads(
    fake_measure: FakeMeasure, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """No --out: $PPD_CACHE_DIR/profiles/<device>__demo-v2__policy.json for a server that serves the
    demo (its /v1/models says "demo"), the file `ppd serve --model demo` looks up; the shipped
    tables are left alone."""
    from profiles import PROFILES_DIR, cpu_device_name
    from server.routing.policy_table import table_path
    from server.serve import model_slug

    monkeypatch.setenv("PPD_CACHE_DIR", str(tmp_path / "cache"))
    shipped = {path: path.read_bytes() for path in PROFILES_DIR.iterdir() if path.is_file()}
    health = {"status": "ok", "units": [{"device": {"kind": "cpu"}}]}
    monkeypatch.setattr(
        policy_profile.httpx,
        "get",
        lambda url, **kw: type("R", (), {"json": lambda self: health})(),
    )
    monkeypatch.setattr(policy_profile, "_served", lambda url: {"id": "demo", "root": "demo"})
    assert (
        cli.main(
            [
                "profile",
                "policy",
                "--url",
                "http://unused",
                "--contexts",
                "160",
                "--shapes",
                "8x64",
                "--loads",
                "1",
                "--no-progress",
            ]
        )
        == 0
    )
    written = tmp_path / "cache" / "profiles" / f"{cpu_device_name()}__demo-v2__policy.json"
    assert PolicyTable.load(written).model == "demo-v2" and written.with_suffix(".md").is_file()
    served_demo = type("Plan", (), {"model_path": str(tmp_path / "cache" / "demo-v2")})()
    assert (
        table_path(cpu_device_name(), model_slug(served_demo)) == written
    )  # what the server reads
    assert {path: path.read_bytes() for path in PROFILES_DIR.iterdir() if path.is_file()} == shipped


def test_the_table_names_the_model_as_the_server_looks_it_up(tmp_path: Path) -> None:
    from server.serve import model_slug

    folder = tmp_path / "Llama-3.1-8B"
    folder.mkdir()
    served = {
        "id": "llama",
        "root": "llama",
    }  # --served-model-name llama: the folder is known only to who started it
    assert policy_profile._model_name(served, ["--model", str(folder)]) == "Llama-3.1-8B"
    assert policy_profile._model_name(served, ["--model", "demo"]) == "demo-v2"
    assert policy_profile._model_name({"id": "demo", "root": "demo"}, []) == "demo-v2"
    assert (
        policy_profile._model_name({"id": "m", "root": str(folder)}, []) == "Llama-3.1-8B"
    )  # vLLM's root
    for path in (folder, tmp_path / "demo-v2"):
        assert model_slug(type("Plan", (), {"model_path": f"{path}/"})()) == path.name


@pytest.mark.slow  # a whole run against a live server: the second suite
def test_real_runs_force_each_route_on_the_demo(start_server, tmp_path: Path) -> None:
    server = start_server("--policy", "pd")
    grid = Grid(contexts=(160,), shapes=((16, 16),), loads=(2,), turn1_output=16, duration=1.5)
    table = profile(
        server.url, grid, tmp_path / "t.json", "cpu-2core", "demo", {}, 1.0, 10.0, progress=False
    )
    for route in ("prefill", "decode"):
        run = table.raw[run_key(160, (16, 16), 2, route)]
        assert run["failed"] == 0 and run["n"] > 0 and run["routes"] == [route]
        # TPOT is measured, but may be 0 here: on 2 busy cores a 16-token answer can reach the
        # client in one read.
        assert run["ttft_p50_ms"] > 0 and run["tpot_p50_ms"] is not None and run["tpot_p50_ms"] >= 0
    assert table.cells[(0, 0, 0)].x_star in (0, 1)
