"""Picks the unit for each request and the route for its prefill.

A conversation's later turns go to the unit that holds its prefix. The router
keeps, per unit, an LRU index of the chained block hashes it sent there (prompts
when sent, prompt + answer when finished); the longest match wins, ties and
misses go to the least-loaded unit (then the one given fewest requests). The index is only a guess (the unit may
have evicted the blocks): the unit's own prefix cache decides, by tokens, what
is really reused, so an edited history gets a correct answer, only a slower one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from engine.prefix_hash import block_hashes
from scheduler.messages import Route
from scheduler.policy import Policy


@dataclass(frozen=True)
class Decision:
    unit: int
    route: Route
    est_cached_tokens: int


class Router:
    def __init__(self, num_units: int, block_size: int, policy: Policy, capacity_blocks: int) -> None:
        self.block_size = block_size
        self.policy = policy
        self.capacity = capacity_blocks
        self.index: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_units)]
        self.load = [0] * num_units
        self.assigned = [0] * num_units  # breaks load ties, so sequential new conversations still spread

    def route(self, token_ids: list[int], available: Sequence[int]) -> Decision:
        """Choose one of the available units and a route for a new request, and count it in that unit's load."""
        hashes = block_hashes(token_ids, self.block_size)
        matches = {u: self._match(self.index[u], hashes) for u in available}
        unit = min(available, key=lambda u: (-matches[u], self.load[u], self.assigned[u], u))
        cached = matches[unit] * self.block_size
        self.load[unit] += 1
        self.assigned[unit] += 1
        self.remember(unit, token_ids, hashes)
        return Decision(unit, self.policy.route(cached, len(token_ids) - cached), cached)

    def finished(self, unit: int, token_ids: list[int]) -> None:
        """A request on unit ended; token_ids (prompt + answer) are now likely cached there."""
        self.load[unit] -= 1
        self.remember(unit, token_ids)

    def remember(self, unit: int, token_ids: list[int], hashes: list[int] | None = None) -> None:
        index = self.index[unit]
        for h in hashes if hashes is not None else block_hashes(token_ids, self.block_size):
            index[h] = None
            index.move_to_end(h)
        while len(index) > self.capacity:
            index.popitem(last=False)

    def forget_unit(self, unit: int) -> None:
        """The unit restarted with an empty cache."""
        self.index[unit].clear()
        self.load[unit] = 0

    @staticmethod
    def _match(index: OrderedDict[int, None], hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in index:
                break
            n += 1
        return n
