"""The shipped profiles (`ppd profile`'s output), and how a profile is named: <device>__<model>[__<kind>].json."""

from __future__ import annotations

import os
import re
from pathlib import Path

PROFILES_DIR = Path(__file__).resolve().parent


def slug(name: str) -> str:
    """A file-name-safe, lower-case form of a device or model name."""
    return re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-")


def cpu_device_name() -> str:
    """The CPU 'device' of a profile: its core count decides the speeds the profile measured."""
    return f"cpu-{len(os.sched_getaffinity(0))}core"
