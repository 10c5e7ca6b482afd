"""The server's lookup of its profiles (server/serve.py): the user's ($PPD_CACHE_DIR/profiles)
before the shipped ones, under the one model name every producer writes (profiles.model_name); a
--partition-profile honoured under every partition where a share manager runs, and refused in one
line where none would read it."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path

import pytest

import server.plan
from partition.mps import MpsDaemonPlan
from profiles import PROFILES_DIR, model_name
from server.args import add_serve_args
from server.plan import ServePlan, partition_profile_for
from server.routing.policy import Objective, PPDPolicy
from server.serve import find_shipped_table, model_slug
from tests.tiny_models import write_tiny_model

SHIPPED_TABLE = PROFILES_DIR / "cpu-2core__demo-v2__policy.json"
SHIPPED_PROFILE = PROFILES_DIR / "cpu-2core__demo-v2.json"


def _copy_marked(shipped: Path, folder: Path, marker: str) -> Path:
    """The shipped file copied into folder, its model renamed `marker` so that a reader's choice
    shows."""
    data = json.loads(shipped.read_text())
    data["model"] = marker
    folder.mkdir(parents=True, exist_ok=True)
    (folder / shipped.name).write_text(json.dumps(data))
    return folder / shipped.name


def _table_model(device: str, model: str) -> str | None:
    policy = PPDPolicy(None, Objective())
    find_shipped_table(policy, device, model)
    return None if policy.table is None else policy.table.model


def test_the_policy_table_of_the_user_is_read_before_the_shipped_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PPD_CACHE_DIR", str(tmp_path))
    demo = model_slug(argparse.Namespace(model_path=str(tmp_path / "demo-v2")))
    assert demo == "demo-v2" == model_name(f"{tmp_path}/demo-v2/")
    assert (
        _table_model("cpu-2core", demo) == json.loads(SHIPPED_TABLE.read_text())["model"]
    )  # none of the user's
    _copy_marked(SHIPPED_TABLE, tmp_path / "profiles", "measured here")
    assert _table_model("cpu-2core", demo) == "measured here"


def test_no_table_names_both_folders(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PPD_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING):
        assert _table_model("cpu-64core", "demo-v2") is None
    assert str(tmp_path / "profiles") in caplog.text and str(PROFILES_DIR) in caplog.text


def test_the_partition_profile_of_the_user_is_read_before_the_shipped_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PPD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("profiles.cpu_device_name", lambda: "cpu-2core")
    args, demo_folder = argparse.Namespace(partition_profile=None), str(tmp_path / "demo-v2")
    assert partition_profile_for(args, "cpu", demo_folder) == str(SHIPPED_PROFILE)
    user = _copy_marked(SHIPPED_PROFILE, tmp_path / "profiles", "measured here")
    assert partition_profile_for(args, "cpu", demo_folder) == str(user)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


def _plan(tiny: Path, monkeypatch: pytest.MonkeyPatch, *argv: str, gpu: bool) -> ServePlan:
    """ppd serve's plan for argv, on a GPU host with MPS installed and green contexts (as far as
    planning can tell) or on 2 CPU cores; no process is started."""
    from partition import backends, mps

    monkeypatch.setattr(server.plan, "visible_gpus", lambda: ["0"] if gpu else [])
    monkeypatch.setattr(server.plan, "available_cores", lambda: [0, 1])
    monkeypatch.setattr(backends, "green_available", lambda: True)
    monkeypatch.setattr(
        backends,
        "auto_backend",
        lambda device, with_prefill=True: (
            ("mps", "auto: an MPS daemon runs")
            if gpu
            else ("cpu", "auto: on the CPU each worker gets its own cores")
        ),
    )
    monkeypatch.setattr(
        mps,
        "mps_daemon_plan",
        lambda workdir: MpsDaemonPlan(
            "/usr/bin/nvidia-cuda-mps-control",
            workdir / "pipe",
            workdir / "log",
            start=True,
            why="starting one",
        ),
    )
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    plan = server.plan.plan_serve(
        parser.parse_args(["--model", str(tiny), "--skip-tokenizer-init", "--policy", "pd", *argv])
    )
    shutil.rmtree(plan.ipc_dir)
    return plan


@pytest.mark.parametrize(
    "gpu, argv",
    [
        (False, ["--partition", "cpu", "--share-manager"]),
        (False, ["--share-manager"]),  # auto: cpu
        (True, ["--partition", "green"]),
    ],
)
def test_a_given_partition_profile_reaches_the_share_manager_wherever_one_runs(
    gpu: bool, argv: list[str], tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = _plan(tiny, monkeypatch, *argv, "--partition-profile", str(SHIPPED_PROFILE), gpu=gpu)
    assert all(u.share_manager and u.partition_profile == str(SHIPPED_PROFILE) for u in plan.units)


@pytest.mark.parametrize(
    "gpu, argv, needle",
    [
        (False, ["--partition", "none"], "--partition none"),
        (False, ["--partition", "cpu"], "add --share-manager"),
        (False, [], "add --share-manager"),  # auto: cpu, where the share manager is off by default
        (True, ["--partition", "green", "--no-share-manager"], "--no-share-manager"),
        (True, ["--partition", "mps"], "--partition mps"),
        (
            True,
            [],
            "auto chose mps here",
        ),  # were MPS not to work, auto's fallback would have nothing to honour
        (True, ["--partition", "none"], "--partition none"),
    ],
)
def test_a_partition_profile_no_share_manager_would_read_is_refused_in_one_line(
    gpu: bool, argv: list[str], needle: str, tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(server.plan.UsageError) as refused:
        _plan(tiny, monkeypatch, *argv, "--partition-profile", str(SHIPPED_PROFILE), gpu=gpu)
    message = str(refused.value)
    assert message.startswith("--partition-profile: ") and needle in message and "\n" not in message
