"""Faults injected on purpose, for the tests of what a fault does (a failure on one tensor-parallel
rank, say), where no input can make it happen: PPD_INJECT_FAULT=NAME:FILE makes
inject_fault(NAME) raise once per FILE, the first time it is reached while FILE does not exist
(it creates FILE, so a restarted process does not fail again). Unset, as in any real run,
inject_fault costs a set lookup."""

from __future__ import annotations

import os
from pathlib import Path

_ASKED = dict(
    item.split(":", 1) for item in os.environ.get("PPD_INJECT_FAULT", "").split(",") if ":" in item
)


class InjectedFault(RuntimeError):
    """A fault a test asked for."""


def inject_fault(name: str) -> None:
    """Raise InjectedFault where PPD_INJECT_FAULT names this point and its file is not there yet."""
    if name in _ASKED:
        marker = Path(_ASKED[name])
        try:
            marker.touch(exist_ok=False)
        except FileExistsError:
            return
        raise InjectedFault(f"{name} (PPD_INJECT_FAULT)")
