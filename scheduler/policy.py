"""Where a request's prefill runs: the prefill worker, or inline in the decode worker.

A prompt with no cached prefix (turn 1, or a miss) always goes to the prefill
worker; only an append-prefill over a cached prefix has a choice. `ppd` here is
the simple first rule (short appends stay on the decode worker); the profiled
PPD tables replace it later.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.messages import Route

DEFAULT_PPD_MAX_APPEND = 256


@dataclass(frozen=True)
class Policy:
    """name is one of scheduler.config.POLICIES; ppd_max_append is ppd's threshold in uncached tokens."""

    name: str
    ppd_max_append: int = DEFAULT_PPD_MAX_APPEND

    def route(self, num_cached: int, num_new: int) -> Route:
        if self.name == "aggregated":
            return "decode"
        if num_cached == 0 or self.name == "pd":
            return "prefill"
        if self.name == "dlocal":
            return "decode"
        return "decode" if num_new <= self.ppd_max_append else "prefill"
