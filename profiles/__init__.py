"""Where ppd keeps what it measures, and how a profile is named: <device>__<model>[__<kind>].json.

Profiles a user measures (`ppd profile`) go to the user's folder, $PPD_CACHE_DIR/profiles (default
~/.cache/ppd-serve/profiles); the shipped ones are this package's folder, never written unless --out
names it. A reader looks in the user's folder first, then the shipped one. The results of `ppd
bench` and `ppd probe` go to $PPD_RESULTS_DIR (default ./ppd-results), each run under <kind>-<UTC
time>.
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime, timezone
from pathlib import Path

PROFILES_DIR = Path(__file__).resolve().parent  # the shipped profiles
CACHE_ENV = "PPD_CACHE_DIR"
RESULTS_ENV = "PPD_RESULTS_DIR"


def cache_dir() -> Path:
    """$PPD_CACHE_DIR, else ~/.cache/ppd-serve: what ppd builds once per machine, and the profiles a
    user measures."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "ppd-serve")


def user_profiles_dir() -> Path:
    """Where `ppd profile` writes without --out: $PPD_CACHE_DIR/profiles."""
    return cache_dir() / "profiles"


def profile_dirs() -> tuple[Path, ...]:
    """The folders a profile is looked up in, in order: the user's, then the shipped one."""
    return user_profiles_dir(), PROFILES_DIR


def profile_file(name: str, folder: Path | None = None) -> Path:
    """The profile file `name` in `folder`; without one, the profile a reader takes: the user's
    where there is one, else the shipped one where there is one, else the user's path (where `ppd
    profile` would write it)."""
    if folder is not None:
        return Path(folder) / name
    return next(
        (d / name for d in profile_dirs() if (d / name).is_file()), user_profiles_dir() / name
    )


TIER_PROFILE_SCHEMA = "ppd-tier-profile"


def tier_profile_path(device: str, model: str, folder: Path | None = None) -> Path:
    """`ppd profile tier`'s file, <device>__<model>__tier.json, in `folder`; without one, the one
    a reader takes (profile_file)."""
    return profile_file(f"{slug(device)}__{slug(model)}__tier.json", folder)


def tier_load_rate(device: str, model: str) -> float:
    """The second KV tier's load rate `ppd profile tier` measured for this device and model, in
    tokens/s (0.0: none profiled, or a file that is not such a profile)."""
    try:
        data = json.loads(tier_profile_path(device, model).read_text())
        if data.get("schema") != TIER_PROFILE_SCHEMA:
            return 0.0
        return float(data["load_tokens_per_s"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0.0


def results_dir() -> Path:
    """$PPD_RESULTS_DIR, else ./ppd-results: where `ppd bench` and `ppd probe` write without
    --out."""
    return Path(os.environ.get(RESULTS_ENV) or "ppd-results")


def results_path(kind: str, suffix: str = "") -> Path:
    """A new run's place in the results folder: <kind>-<UTC time><suffix> (a folder, or a file with
    a suffix)."""
    return results_dir() / f"{kind}-{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}{suffix}"


def slug(name: str) -> str:
    """A file-name-safe, lower-case form of a device or model name."""
    return re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-")


def model_name(folder: str | os.PathLike) -> str:
    """The model's part of a profile's name, the one name the profilers write and the server looks
    up: the base name of the folder `ppd serve` loads the model from (the demo's: demo-v2)."""
    return os.path.basename(os.fspath(folder).rstrip("/"))


def unit_device_name(device: str, tensor_parallel_size: int = 1) -> str:
    """The device part of a policy profile's name: a unit's device, and how many of them a
    tensor-parallel unit spans (its steps and their costs differ from one device's: a profile is
    measured with the unit's own -tp)."""
    return device if tensor_parallel_size == 1 else f"{device} x{tensor_parallel_size}"


def cpu_device_name() -> str:
    """The CPU 'device' of a profile: its core count decides the speeds the profile measured."""
    return f"cpu-{len(os.sched_getaffinity(0))}core"


def write_json(path: Path, data: dict) -> Path:
    """data as indented JSON at path, atomically (a temporary file, then a rename): a run stopped
    mid-write leaves the previous file whole. The one writer of profiles, partial runs and result
    files."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
    return path
