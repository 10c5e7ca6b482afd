"""`ppd profile tier`: the second KV tier's copy rate for a model's blocks, written where `ppd
serve` looks for it, and read back as the rate the ppd policy counts a tier-cached prefix's load
at."""

from __future__ import annotations

import argparse
import json

from bench.tier_profile import add_tier_args, main
from profiles import TIER_PROFILE_SCHEMA, cpu_device_name, tier_load_rate
from server.routing.policy import make_policy
from server.serve import find_tier_rate
from tests.tiny_models import write_tiny_model


def test_the_profile_measures_both_directions_and_the_server_reads_its_load_rate(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("PPD_CACHE_DIR", str(tmp_path / "cache"))
    folder = write_tiny_model(tmp_path / "tiny-llama", "llama")
    parser = argparse.ArgumentParser()
    add_tier_args(parser)
    args = parser.parse_args(
        ["--model", str(folder), "--quick", "--kv-offloading-dir", str(tmp_path / "tier")]
    )
    path = main(args)
    assert path.parent == tmp_path / "cache" / "profiles"
    data = json.loads(path.read_text())
    assert data["schema"] == TIER_PROFILE_SCHEMA and data["model"] == "tiny-llama"
    assert data["blocks"] == 64 and data["block_size"] == 16
    assert data["load_tokens_per_s"] > 0 and data["store_tokens_per_s"] > 0
    assert not list((tmp_path / "tier").iterdir())  # the tier's file is gone with its mapping
    rate = tier_load_rate(cpu_device_name(), "tiny-llama")
    assert rate == data["load_tokens_per_s"]
    policy = make_policy("ppd")
    find_tier_rate(policy, cpu_device_name(), "tiny-llama")
    assert policy.tier_tokens_per_s == rate


def test_no_profile_or_another_kind_of_file_is_no_rate(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PPD_CACHE_DIR", str(tmp_path))
    assert tier_load_rate("cpu-2core", "nothing") == 0.0
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "cpu-2core__other__tier.json").write_text('{"schema": "x"}')
    assert tier_load_rate("cpu-2core", "other") == 0.0
