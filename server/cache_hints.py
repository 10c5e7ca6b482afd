"""The clients' cache hints: which conversation a request continues, and how long its KV should
outrank other conversations' at eviction.

- OpenAI (Chat Completions, Completions, Responses): `prompt_cache_key`, routing affinity exactly as
  the `x-session-id` header (the header wins when both are sent), and `prompt_cache_retention`,
  "in_memory" or "24h".
- Anthropic (Messages): `cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}` on the system
  prompt, a tool or a message's content block; the longest ttl of the request counts.

A hinted request's cached blocks stay behind the plain LRU for the retention once it ends
(BlockManager.free's retain_s), within `--kv-retention-share` of each unit's pool, for at most
MAX_RETENTION_S: a day of priority in device memory would let one client's idle sessions crowd
out everyone's live ones. A retention that is cut (24h) or off (--kv-retention-share 0) is still
served, and its usage says what was applied (`ppd_cache_retention`). Blocks past the share, and a
retention once expired, are plain LRU; with a second tier (--kv-offloading-size) the LRU's
evictions go there, whatever the hint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server.errors import RequestError

# The retention each named hint asks for, in seconds: OpenAI's in-memory cache lives "5 to 10
# minutes of inactivity, up to one hour" (we keep the 10), its extended one up to 24 hours;
# Anthropic's ephemeral TTLs are what they say.
RETENTION_S = {"in_memory": 600.0, "24h": 86400.0, "5m": 300.0, "1h": 3600.0}
MAX_RETENTION_S = 3600.0
ANTHROPIC_TTLS = ("5m", "1h")


@dataclass(frozen=True, slots=True)
class CacheHints:
    key: str | None = None  # prompt_cache_key
    retention: str | None = None  # as the client named it: in_memory, 24h, 5m, 1h

    @property
    def requested_s(self) -> float:
        return RETENTION_S[self.retention] if self.retention is not None else 0.0

    def applied_s(self, enabled: bool) -> float:
        """The retention ppd-serve applies (enabled: --kv-retention-share is above 0)."""
        return min(self.requested_s, MAX_RETENTION_S) if enabled else 0.0

    def report(self, enabled: bool) -> dict[str, Any] | None:
        """What a response's usage says of the retention asked (None: none was)."""
        if self.retention is None:
            return None
        applied = self.applied_s(enabled)
        out: dict[str, Any] = {
            "requested": self.retention,
            "requested_seconds": self.requested_s,
            "applied_seconds": applied,
        }
        if not enabled:
            out["note"] = "retention is off on this server (--kv-retention-share 0)"
        elif applied < self.requested_s:
            out["note"] = (
                f"retention is capped at {MAX_RETENTION_S:.0f} s, within a bounded share of the KV "
                "pool"
            )
        return out


def openai_hints(body: Any) -> CacheHints:
    """The hints of a body with OpenAI's prompt_cache_key and prompt_cache_retention fields."""
    return CacheHints(
        getattr(body, "prompt_cache_key", None), getattr(body, "prompt_cache_retention", None)
    )


def anthropic_hints(system: Any, tools: Any, messages: list[Any]) -> CacheHints:
    """The hints of a Messages request: its longest cache_control ttl (the default 5m where a block
    names none). A cache_control the Messages API would refuse is refused here, by its place."""
    ttls: list[str] = []
    places: list[tuple[str, Any]] = []
    if isinstance(system, list):
        places += [(f"system[{i}]", b) for i, b in enumerate(system)]
    places += [(f"tools[{i}]", t) for i, t in enumerate(tools or [])]
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            places += [(f"messages[{i}].content[{j}]", b) for j, b in enumerate(content)]
    for where, block in places:
        if isinstance(block, dict) and (control := block.get("cache_control")) is not None:
            ttls.append(_ttl(control, f"{where}.cache_control"))
    if not ttls:
        return CacheHints()
    return CacheHints(None, max(ttls, key=RETENTION_S.__getitem__))


def _ttl(control: Any, where: str) -> str:
    if not isinstance(control, dict) or control.get("type") != "ephemeral":
        raise RequestError(
            f'{where}: give {{"type": "ephemeral"}}, with "ttl" "5m" or "1h" if you want one',
            param=where,
        )
    ttl = control.get("ttl", "5m")
    if ttl not in ANTHROPIC_TTLS:
        raise RequestError(
            f'{where}.ttl: {ttl!r} is not a cache TTL; use "5m" or "1h"', param=f"{where}.ttl"
        )
    return ttl
