"""Picks the unit for each request and the route for its prefill.

A conversation's later turns go to the unit that holds its prefix. With a session id (the
`x-session-id` header) a conversation stays on the unit it was placed on, until the session has been
idle for session_ttl_s or the unit restarts. Otherwise the router keeps, per unit, an LRU index of
the chained block hashes it sent there (prompts when sent, prompt + answer when finished); the
longest match wins, ties and misses go to the least-loaded unit (then the one given fewest
requests). With several API servers (--api-server-count), each has a Router and they keep one
another's up to date: every placement and every end is published (`publish`) and applied by the
others (`apply`), so a conversation's next turn finds its unit whichever API server it reaches. Both
are only guesses (the unit may have evicted the blocks): the unit's own prefix cache decides, by
tokens, what is really reused, so an edited history or a lost prefix gets a correct answer, only a
slower one. The route then comes from the policy (server/routing/policy.py), which reads each unit's
live state as its workers last reported it.

A unit with a second KV tier (--kv-offloading-size) keeps what its pool evicts: the index's
oldest hashes then go on to a tier index of the tier's size, and a prompt that continues there is
cached all the same, at the cost of loading those blocks (Placement.est_loaded_tokens, which the
policy adds to either route's time).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.prefix_hash import block_hashes
from scheduler.messages import Finished, Placed, Route, RouterEvent
from server.routing.answer_length import AnswerLengths
from server.routing.policy import Decision, Outcome, Policy, UnitLive

DEFAULT_SESSION_TTL_S = 3600.0
log = logging.getLogger("ppd.router")


@dataclass(frozen=True)
class Placement:
    unit: int
    decision: Decision
    est_cached_tokens: int  # from the pool or the second tier
    session: str | None = None
    earlier_answers: tuple[int, ...] = ()  # the answer lengths of the conversation it continues
    hashes: list[int] = field(
        default_factory=list
    )  # the prompt's block hashes, which travel with it to the unit
    est_loaded_tokens: int = 0  # of est_cached_tokens, those in the unit's second tier

    @property
    def route(self) -> Route:
        return self.decision.route


class Router:
    def __init__(
        self,
        num_units: int,
        block_size: int,
        policy: Policy,
        capacity_blocks: int,
        session_ttl_s: float = DEFAULT_SESSION_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block_size = block_size
        self.policy = policy
        self.capacity = capacity_blocks
        self.index: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_units)]
        # What each unit's second tier holds, by the same guess: the pool index's overflow.
        self.tier_index: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_units)]
        self.tier_capacity = [0] * num_units  # blocks; set from the units' stats
        self.load = [0] * num_units
        self.assigned = [
            0
        ] * num_units  # breaks load ties, so sequential new conversations still spread
        self.live = [UnitLive() for _ in range(num_units)]  # kept current by the engine client
        self.sessions: OrderedDict[str, tuple[int, float]] = (
            OrderedDict()
        )  # session -> (unit, last use), LRU first
        self.session_ttl_s = session_ttl_s
        self.clock = clock
        self.origin = 0  # this API server's index, in the events it publishes
        self.publish: Callable[[RouterEvent], None] | None = None  # set with several API servers
        self.answers = AnswerLengths()

    def route(
        self,
        token_ids: list[int],
        available: Sequence[int],
        max_tokens: int = 1,
        session: str | None = None,
        route_hint: Route | None = None,
        min_tokens: int = 0,
        ignore_eos: bool = False,
    ) -> Placement:
        """Choose one of the available units and a route for a new request that may generate up to
        max_tokens, and count it in that unit's load. The policy is given the answer's expected
        length (server/routing/answer_length.py), which max_tokens only caps. route_hint (a client's
        choice) overrides the policy for an append-prefill."""
        hashes = block_hashes(token_ids, self.block_size)
        unit = self._session_unit(session, available)
        if unit is None:
            matches = {u: sum(self._match(u, hashes)) for u in available}
            unit = min(available, key=lambda u: (-matches[u], self.load[u], self.assigned[u], u))
        in_pool, in_tier = self._match(unit, hashes)
        cached, loaded = (in_pool + in_tier) * self.block_size, in_tier * self.block_size
        new, load, live = len(token_ids) - cached, self.load[unit] + 1, self.live[unit]
        earlier = self.answers.earlier(hashes, session)
        output_tokens = self.answers.estimate(earlier, max_tokens, min_tokens, ignore_eos)
        if route_hint is not None and cached > 0 and self.policy.uses_prefill_worker:
            decision = Decision(route_hint, "client", load)
        else:
            decision = self.policy.route(cached, new, output_tokens, load, live, loaded)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "route %s (%s) unit %d: cached %d new %d output %d load %d cell %s queue %d tokens "
                "at %.0f "
                "tokens/s, decode step %.2f ms, inline %.0f tokens/s",
                decision.route,
                decision.reason,
                unit,
                cached,
                new,
                output_tokens,
                load,
                decision.cell,
                live.prefill_queue_tokens,
                live.prefill_tokens_per_s,
                live.decode_step_ms,
                live.inline_tokens_per_s,
            )
        self._placed(unit, hashes, session)
        self._publish(Placed(self.origin, unit, hashes, session))
        return Placement(unit, decision, cached, session, earlier, hashes, loaded)

    def finished(
        self,
        unit: int,
        token_ids: list[int],
        placement: Placement | None = None,
        outcome: Outcome | None = None,
    ) -> None:
        """A request on unit ended; token_ids (its prompt, and its answer if it finished) are now
        likely cached there. placement: the request's, whose prompt hashes are reused (only the
        blocks after them are hashed now); outcome: what a request that ran to its end did (the
        policy and the answer-length estimate learn from it)."""
        known = placement.hashes if placement is not None else []
        hashes = known + block_hashes(
            token_ids[len(known) * self.block_size :], self.block_size, known[-1] if known else None
        )
        self._finished(unit, hashes)
        if placement is not None and outcome is not None:
            self.policy.observe(placement.decision, outcome)
            self.answers.answered(
                hashes, placement.session, placement.earlier_answers, outcome.output
            )
        self._publish(Finished(self.origin, unit, hashes))

    def _publish(self, event: RouterEvent) -> None:
        """Tell the other API servers' routers. Events are hints: one that cannot go costs them a
        guess, never the request that made it (nor the load it counted, which its end gives
        back)."""
        if self.publish is None:
            return
        try:
            self.publish(event)
        except Exception:  # noqa: BLE001 - whatever the bus does, the request goes on
            log.exception("could not publish a router event to the other API servers")

    def apply(self, event: RouterEvent) -> None:
        """Another API server's placement or end, as if it had been ours."""
        if isinstance(event, Placed):
            self._placed(event.unit, event.hashes, event.session)
        elif isinstance(event, Finished):
            self._finished(event.unit, event.hashes)

    def _placed(self, unit: int, hashes: list[int], session: str | None) -> None:
        self.load[unit] += 1
        self.assigned[unit] += 1
        if session is not None:
            self.sessions[session] = (unit, self.clock())
            self.sessions.move_to_end(session)
        self.remember(unit, hashes)

    def _finished(self, unit: int, hashes: list[int]) -> None:
        self.load[unit] = max(
            0, self.load[unit] - 1
        )  # an event from before a unit's restart may come after it
        self.remember(unit, hashes)

    def remember(self, unit: int, hashes: list[int]) -> None:
        """Note the block hashes as (likely) cached on unit, newest last; the index keeps the newest
        capacity."""
        index, tier = self.index[unit], self.tier_index[unit]
        for h in hashes:
            index[h] = None
            index.move_to_end(h)
            tier.pop(h, None)
        while len(index) > self.capacity:
            h, _ = index.popitem(last=False)
            if self.tier_capacity[unit]:
                tier[h] = None
        while len(tier) > self.tier_capacity[unit]:
            tier.popitem(last=False)

    def recount(self, unit: int, held: int) -> None:
        """The unit's own count of the requests it holds becomes its load: after an API server died,
        the placements it made there (which no end will give back) are gone from the unit, and from
        every router with this."""
        self.load[unit] = held

    def forget_unit(self, unit: int) -> None:
        """The unit restarted with an empty cache: its conversations are placed afresh."""
        self.index[unit].clear()
        self.tier_index[unit].clear()
        self.load[unit] = 0
        self.live[unit] = UnitLive()
        for session in [s for s, (u, _) in self.sessions.items() if u == unit]:
            del self.sessions[session]

    def _session_unit(self, session: str | None, available: Sequence[int]) -> int | None:
        now = self.clock()
        while self.sessions:  # expire idle sessions, oldest first
            oldest, (_, last) = next(iter(self.sessions.items()))
            if now - last <= self.session_ttl_s:
                break
            del self.sessions[oldest]
        if session is None or session not in self.sessions:
            return None
        unit = self.sessions[session][0]
        return unit if unit in available else None

    def _match(self, unit: int, hashes: list[int]) -> tuple[int, int]:
        """The prompt's leading blocks likely cached on unit: (in its pool, then in its tier)."""
        index, tier = self.index[unit], self.tier_index[unit]
        in_pool = 0
        for h in hashes:
            if h not in index:
                break
            in_pool += 1
        in_tier = 0
        for h in hashes[in_pool:]:
            if h not in tier:
                break
            in_tier += 1
        return in_pool, in_tier
