"""`ppd bench sampling` on the CPU with the demo model: every feature's decode step against
greedy's."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from bench.sampling_cost import (
    QUICK_SWEEP,
    Batch,
    Point,
    Report,
    Sweep,
    configurations,
    markdown,
    run,
    verdicts,
)
from cli.main import main as ppd
from engine.demo import demo_model_path
from engine.engine import Engine, EngineConfig
from engine.step_timing import release_engine
from tests.tiny_models import write_tiny_model


def test_quick_run_reports_every_configuration_at_each_batch(
    cache_dir: Path, tmp_path: Path
) -> None:
    folder = str(demo_model_path(cache_dir))
    assert (
        ppd(
            [
                "bench",
                "sampling",
                "--quick",
                "--threads",
                "1",
                "--model",
                folder,
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    data = json.loads(next(tmp_path.glob("sampling-*.json")).read_text())
    names = list(configurations(320))
    got = {(p["config"], p["batch"]): p for p in data["points"]}
    assert set(got) == {(n, b) for n in names for b in QUICK_SWEEP.batches}
    for (name, _), p in got.items():
        assert p["ms"] > 0 and p["p90_ms"] > 0 and p["ratio"] > 0 and p["restarts"] >= 0
        assert len(p["round_ms"]) == QUICK_SWEEP.rounds
        if name == "greedy":
            assert p["ratio"] == 1.0
    # Requests of at most 8 tokens over 6 steps: rows end and new requests take them.
    assert sum(p["restarts"] for p in got.values()) > 0
    assert data["tokenizer"] == folder and data["target"]["batch"] == 64
    md = next(tmp_path.glob("sampling-*.md")).read_text()
    assert "| json_schema |" in md and "within 10%" in md and "not measured at batch 64" in md


def test_rows_grow_with_their_tokens_and_restart_when_they_end(cache_dir: Path) -> None:
    folder = str(demo_model_path(cache_dir))
    cfg = EngineConfig(
        model=folder,
        load_format="dummy",
        device="cpu",
        max_model_len=33,
        max_num_seqs=3,
        max_num_batched_tokens=3,
        num_kv_blocks=9,
        shares_device=False,
        tokenizer=folder,
    )
    engine = Engine.create(cfg, ("ppd-test-sampling-weights", "ppd-test-sampling-kv"))
    try:
        params = configurations(engine.mcfg.vocab_size)[
            "all"
        ]  # penalties and a grammar: both keep request state
        grow = Batch(engine, params, 3, 32, max_output=1000, rng=random.Random(0))
        ids = [row.request_id for row in grow.rows]
        for _ in range(4):
            grow.step()
        for row, old in zip(grow.rows, ids):
            # Unless an EOS ended it, a request holds its prompt and every token it sampled.
            assert row.request_id != old or len(row.token_ids) == 32 + 4
        grow.close()
        short = Batch(engine, params, 3, 32, max_output=1, rng=random.Random(0))
        for _ in range(3):
            short.step()
        assert short.restarts == 9 and all(len(row.token_ids) == 32 for row in short.rows)
        short.close()
    finally:
        release_engine(engine)
        engine.sampler.guided.close()


def test_markdown_states_the_target_and_each_structured_config_against_it() -> None:
    sweep = Sweep((64,), 256, 10, 2, 1, 200)
    points = [
        Point("greedy", 64, 10.0, 11.0, 1.0, 0),
        Point("json_schema", 64, 10.5, 11.0, 1.05, 3),
        Point("json_object", 64, 12.0, 13.0, 1.2, 2),
    ]
    report = Report("cpu", "demo", "float32", "byte-level stand-in", sweep, points)
    assert verdicts(report) == {
        "json_schema": "meets (1.05 x greedy)",
        "json_object": "misses (1.20 x greedy)",
    }
    md = markdown(report)
    assert "within 10% of plain decoding's step time at batch 64" in md
    assert "- json_schema: meets" in md and "- json_object: misses" in md and "--tokenizer" in md


def test_a_model_without_a_tokenizer_gets_a_byte_level_stand_in(tmp_path: Path) -> None:
    folder = write_tiny_model(tmp_path / "model", "llama", vocab_size=1000)
    report = run(str(folder), torch.device("cpu"), Sweep((2,), 16, 2, 1, 1, 4))
    assert report.tokenizer == "byte-level stand-in"
    assert all(p.ms > 0 for p in report.points) and {p.config for p in report.points} >= {
        "json_schema",
        "all",
    }
    assert "--tokenizer FOLDER" in markdown(report)
