"""Is a process running? For cleaning up after processes that are gone (a dead server's files, an
MPS daemon)."""

from __future__ import annotations

import os
from pathlib import Path


def process_state(pid: int) -> str:
    """A process's state letter from /proc (Z: a zombie, which has exited); "" if unreadable."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def process_alive(pid: int) -> bool:
    """True while pid runs (another user's process counts); False once it has exited, zombies
    included."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return process_state(pid) != "Z"
