"""What every benchmark shares: its errors, how it fails for what it did not measure, and where it
writes."""

from __future__ import annotations

import sys
from pathlib import Path

from profiles import results_path

# A Hugging Face folder with none of these has no tokenizer to load (a configuration with dummy
# weights has none).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# Token ids sent without a tokenizer (synthetic workloads, traces): printable ASCII bytes, ordinary
# tokens in any vocabulary of 128+.
RANDOM_ID_RANGE = (32, 127)
TRACE_BLOCK_SIZE = 512  # tokens a trace's hash id stands for: Mooncake's published traces use 512


class BenchError(Exception):
    """A bad command line or an unreachable server: printed, exit code 2."""


class Unmeasured(BenchError):
    """The run went, but something it was asked to measure measured nothing (each named on stderr):
    exit code 1."""


def fail_unless_measured(missing: dict[str, str], asked: int, what: str) -> None:
    """Raise Unmeasured when any of the `asked` things measured nothing, after one line on stderr
    for each: its name (a key of `missing`) and why (the value)."""
    for name, why in missing.items():
        print(f"not measured: {name}: {why}", file=sys.stderr)
    if missing:
        raise Unmeasured(f"{len(missing)} of {asked} {what} measured nothing (listed above)")


def one_line(exc: BaseException) -> str:
    """An error on one line: a message of several lines (what failed, then the log of a server that
    stopped) as its first line and its last, which says why."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    return lines[0] if len(lines) == 1 else f"{lines[0].rstrip(':')}: {lines[-1]}"


def has_tokenizer(folder: str) -> bool:
    """Whether `folder` holds a Hugging Face tokenizer's files."""
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def default_out(kind: str) -> str:
    """The results folder of a `kind` run begun now: <results>/<kind>-<UTC time>, <results> being
    $PPD_RESULTS_DIR, else ./ppd-results (profiles.results_dir)."""
    return str(results_path(kind))


def results_out(out: str | Path | None, kind: str) -> Path:
    """Where a `kind` run writes: --out, else default_out(kind); said on stderr as the run starts
    (the run says it again at its end)."""
    folder = Path(out or default_out(kind))
    print(f"results go to {folder}", file=sys.stderr, flush=True)
    return folder
