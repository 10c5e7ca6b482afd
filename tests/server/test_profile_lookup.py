"""The server's lookup of its profiles (server/serve.py): the user's ($PPD_CACHE_DIR/profiles) before the shipped
ones, under the one model name every producer writes (profiles.model_name)."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import pytest

from profiles import PROFILES_DIR, model_name
from scheduler.policy import Objective, PPDPolicy
from server.serve import find_shipped_table, model_slug, partition_profile_for

SHIPPED_TABLE = PROFILES_DIR / "cpu-2core__demo-v2__policy.json"
SHIPPED_PROFILE = PROFILES_DIR / "cpu-2core__demo-v2.json"


def _copy_marked(shipped: Path, folder: Path, marker: str) -> Path:
    """The shipped file copied into folder, its model renamed `marker` so that a reader's choice shows."""
    data = json.loads(shipped.read_text())
    data["model"] = marker
    folder.mkdir(parents=True, exist_ok=True)
    (folder / shipped.name).write_text(json.dumps(data))
    return folder / shipped.name


def _table_model(device: str, model: str) -> str | None:
    policy = PPDPolicy(None, Objective())
    find_shipped_table(policy, device, model)
    return None if policy.table is None else policy.table.model


def test_the_policy_table_of_the_user_is_read_before_the_shipped_one(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    monkeypatch.setenv("PPD_CACHE_DIR", str(tmp_path))
    demo = model_slug(argparse.Namespace(model_path=str(tmp_path / "demo-v2")))
    assert demo == "demo-v2" == model_name(f"{tmp_path}/demo-v2/")
    assert _table_model("cpu-2core", demo) == json.loads(SHIPPED_TABLE.read_text())["model"]  # none of the user's
    _copy_marked(SHIPPED_TABLE, tmp_path / "profiles", "measured here")
    assert _table_model("cpu-2core", demo) == "measured here"


def test_no_table_names_both_folders(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                     caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("PPD_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING):
        assert _table_model("cpu-64core", "demo-v2") is None
    assert str(tmp_path / "profiles") in caplog.text and str(PROFILES_DIR) in caplog.text


def test_the_partition_profile_of_the_user_is_read_before_the_shipped_one(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    monkeypatch.setenv("PPD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("profiles.cpu_device_name", lambda: "cpu-2core")
    args, demo_folder = argparse.Namespace(partition_profile=None), str(tmp_path / "demo-v2")
    assert partition_profile_for(args, "cpu", demo_folder) == str(SHIPPED_PROFILE)
    user = _copy_marked(SHIPPED_PROFILE, tmp_path / "profiles", "measured here")
    assert partition_profile_for(args, "cpu", demo_folder) == str(user)
