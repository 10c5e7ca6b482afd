"""Where a request's prefill runs: the prefill worker, or inline in the decode worker.

A prompt with no cached prefix (turn 1, or a miss) always goes to the prefill worker; only an
append-prefill over a cached prefix has a choice. Static policies: `pd` (always the prefill worker),
`dlocal` (always the decode worker), `aggregated` (one worker does everything). `ppd` decides per
request:

1. With a profiled table (server/routing/policy_table.py), the request's cell gives each route's
   expected turn-2+ TTFT and TPOT at this load. The prefill route's TTFT is corrected by the live
   state: by how much the prefill worker's queue delay now (queued uncached tokens over its measured
   rate) exceeds its mean when the cell was profiled. Only an excess counts: a queue shorter than
   the profile's does not make the prefill route faster by as much, since its TTFT also waits for
   the pass under way and the hand-off, which the queue does not show
   (docs/policy.md#measurements-behind-the-code). The decode route's TPOT is the table's measured
   slowdown at this load.
2. Without a table (none for this device and model), a cost model stands in, from live rates only:
     TTFT(prefill) = queue delay + new / prefill rate
                     (the prefill worker samples the first token itself)
     TTFT(decode)  = 1.5 decode steps + new / inline rate
                     (the rest of the step under way, then the step that carries the append)
     TPOT(prefill) = decode step
     TPOT(decode)  = decode step + (new / inline rate) / output tokens
   i.e. an inline append delays one step of every running sequence, spread over this request's
   output length (the router's estimate of it, server/routing/answer_length.py: max_tokens is only
   a cap). Of a mixture of experts, new / inline rate also counts the experts the append's tokens
   route to that the decode batch's do not (inline_ms): an append reads experts a small batch
   leaves unread, so it costs a small batch more than its tokens alone.
3. Route to decode when
     w_ttft * (TTFT(prefill) - TTFT(decode)) > w_tpot * (TPOT(decode) - TPOT(prefill)).
4. SLO guards, when given: never inline an append whose step would exceed --itl-slo-ms while the
   prefill route meets --ttft-slo-ms; never send to the prefill worker a request that would miss
   --ttft-slo-ms there while the decode route meets both.
5. Blocks of the cached prefix that sit in the unit's second KV tier (--kv-offloading-size) count
   as cached, and both routes' TTFT include their load (loaded tokens over the tier's rate, as
   the decode worker measures its copies, else as `ppd profile tier` measured it): the decode
   worker loads them before either route runs, so the load moves both routes alike and decides
   only against an SLO.
Observed TTFT and TPOT of each routed append update the estimates of the route it took (which the
unit decides: one that no longer holds the prefix the router guessed prefills it cold) in the cell
of what it was (the cached length the unit found, the tokens it computed, the answer it gave), a
bounded moving average: one observation moves an estimate by at most OBSERVATION_WEIGHT of itself,
so one outlier cannot flip a cell.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from scheduler.config import has_prefill_worker
from scheduler.messages import Route
from server.routing.policy_table import ROUTES, PolicyTable

OBSERVATION_WEIGHT = 0.02  # the most one observation moves a cell's estimate, as a fraction of it
DEFAULT_W_TTFT = 1.0
DEFAULT_W_TPOT = 10.0  # a millisecond of TPOT, paid on every output token, weighs as ten of TTFT


@dataclass(frozen=True)
class Objective:
    """What the operator values: w_ttft * TTFT + w_tpot * TPOT (milliseconds), and optional hard
    SLOs."""

    w_ttft: float = DEFAULT_W_TTFT
    w_tpot: float = DEFAULT_W_TPOT
    ttft_slo_ms: float | None = None
    itl_slo_ms: float | None = None


@dataclass
class UnitLive:
    """A unit's live state as its workers last reported it (rates are 0 until measured)."""

    prefill_queue_tokens: int = 0  # uncached tokens waiting on or running in the prefill worker
    prefill_tokens_per_s: float = 0.0  # the prefill worker's measured speed
    decode_step_ms: float = 0.0  # the decode worker's recent decode-only step time
    inline_tokens_per_s: float = 0.0  # the decode worker's speed on inline prefill tokens
    # Of a mixture of experts: what each expert an inline prefill routes to and the decode batch
    # does not read adds to the decode step, as the decode worker measures it (0: not measured, or
    # a dense model); the sequences in the decode batch.
    inline_expert_ms: float = 0.0
    decode_batch: int = 0
    tier_tokens_per_s: float = 0.0  # the second KV tier's copy rate, as the decode worker measured


@dataclass(frozen=True)
class Decision:
    """A route and why. Every decision, the table's or not, carries the load it was made at: the
    policy files what the request did under that load."""

    route: Route
    reason: str  # miss | static | table | queue | model | itl_slo | ttft_slo | client
    load: int  # requests in flight on the unit, this one included
    cell: tuple[int, int, int] | None = None  # the table cell it was decided in
    queue_correction_ms: float = 0.0  # added to the table's prefill TTFT by the live state
    load_ms: float = 0.0  # added to both routes' TTFT: loading the prefix's blocks from the tier


@dataclass(frozen=True)
class Outcome:
    """What a routed request did: the route its unit ran its prefill on, the cached length the unit
    found, the tokens it computed, the answer's length, and the latencies the client saw."""

    route: Route
    cached: int
    new: int
    output: int
    ttft_ms: float
    tpot_ms: float | None  # None for a one-token answer


class Policy:
    """A static policy: `pd`, `dlocal` or `aggregated`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.uses_prefill_worker = has_prefill_worker(name)
        # The second tier's copy rate before a unit measured its own (`ppd profile tier`; 0: none).
        self.tier_tokens_per_s = 0.0
        # Of a mixture of experts: the experts n tokens read in all layers under uniform routing
        # (ModelConfig.expected_experts; None: a dense model).
        self.experts: Callable[[float], float] | None = None

    def load_ms(self, loaded: int, live: UnitLive) -> float:
        """Milliseconds to load `loaded` tokens' blocks from the unit's second tier."""
        rate = live.tier_tokens_per_s or self.tier_tokens_per_s
        return 1000.0 * loaded / rate if loaded and rate > 0 else 0.0

    def inline_ms(self, new: int, live: UnitLive, rate: float) -> float:
        """Milliseconds an inline prefill of `new` tokens adds to the decode step: its tokens at the
        inline speed (rate when not measured yet), and, of a mixture of experts, the experts its
        tokens route to that the decode batch does not read (uniform routing's expectation, each at
        the decode worker's measured cost)."""
        ms = 1000.0 * new / rate if rate > 0 else 0.0
        if self.experts is not None and live.inline_expert_ms > 0:
            batch = live.decode_batch
            ms += live.inline_expert_ms * (self.experts(batch + new) - self.experts(batch))
        return ms

    def route(
        self, cached: int, new: int, output: int, load: int, live: UnitLive, loaded: int = 0
    ) -> Decision:
        """Where the prefill of a request with `cached` tokens cached (`loaded` of them in the
        unit's second tier), `new` to compute and `output` to generate runs, with `load` requests
        in flight on its unit (this one included)."""
        if not self.uses_prefill_worker:
            return Decision("decode", "static", load)
        if cached == 0:
            return Decision("prefill", "miss", load)
        return Decision("decode" if self.name == "dlocal" else "prefill", "static", load)

    def observe(self, decision: Decision, outcome: Outcome) -> None:
        """A routed request finished: what it did."""


class PPDPolicy(Policy):
    """Per-request routing from a profiled table (or a cost model), the live state and the
    operator's weights."""

    def __init__(self, table: PolicyTable | None, objective: Objective) -> None:
        super().__init__("ppd")
        self.objective = objective
        self.table: PolicyTable | None = None
        self.estimates: dict[tuple[int, int, int], dict[str, list[float]]] = {}
        if table is not None:
            self.use_table(table)

    def use_table(self, table: PolicyTable) -> None:
        self.table = table.with_weights(self.objective.w_ttft, self.objective.w_tpot)
        # Working copies of each measured (TTFT, TPOT) median, which observations move.
        self.estimates = {
            key: {r: [s.ttft_p50_ms, s.tpot_p50_ms] for r, s in cell.routes.items()}
            for key, cell in table.cells.items()
            if all(r in cell.routes for r in ROUTES)
        }

    def route(
        self, cached: int, new: int, output: int, load: int, live: UnitLive, loaded: int = 0
    ) -> Decision:
        if cached == 0:
            return Decision("prefill", "miss", load)
        obj, step = self.objective, live.decode_step_ms
        load_ms = self.load_ms(loaded, live)
        rate = live.prefill_tokens_per_s
        queue_ms = 1000.0 * live.prefill_queue_tokens / rate if rate > 0 else 0.0
        inline_ms = self.inline_ms(new, live, live.inline_tokens_per_s or rate)
        key = self.table.key(cached, new, output, load) if self.table is not None else None
        est = self.estimates.get(key) if key is not None else None
        correction = 0.0
        if est is not None:
            correction = (
                max(0.0, queue_ms - self.table.cells[key].routes["prefill"].queue_delay_ms)
                if rate > 0
                else 0.0
            )
            ttft_p, tpot_p = est["prefill"][0] + correction, est["prefill"][1]
            ttft_d, tpot_d = est["decode"]
            reason = "table"
        else:
            own_ms = 1000.0 * new / rate if rate > 0 else inline_ms
            ttft_p, ttft_d = queue_ms + own_ms, 1.5 * step + inline_ms
            tpot_p, tpot_d = step, step + inline_ms / max(output, 1)
            reason, key = "model", None
        ttft_p, ttft_d = ttft_p + load_ms, ttft_d + load_ms
        tpot_cost = obj.w_tpot * (tpot_d - tpot_p)
        decode = obj.w_ttft * (ttft_p - ttft_d) > tpot_cost
        if correction and decode != (obj.w_ttft * (ttft_p - correction - ttft_d) > tpot_cost):
            reason = (
                "queue"  # the live queue overturned what the cell's estimates alone would choose
            )
        if (
            obj.itl_slo_ms is not None
            and decode
            and step + inline_ms > obj.itl_slo_ms
            and not (obj.ttft_slo_ms is not None and ttft_p > obj.ttft_slo_ms)
        ):
            decode, reason = False, "itl_slo"
        elif (
            obj.ttft_slo_ms is not None
            and not decode
            and ttft_p > obj.ttft_slo_ms >= ttft_d
            and not (obj.itl_slo_ms is not None and step + inline_ms > obj.itl_slo_ms)
        ):
            decode, reason = True, "ttft_slo"
        return Decision("decode" if decode else "prefill", reason, load, key, correction, load_ms)

    def observe(self, decision: Decision, outcome: Outcome) -> None:
        if self.table is None or outcome.cached == 0:  # a cold prefill: no append, no cell
            return
        est = self.estimates.get(
            self.table.key(outcome.cached, outcome.new, outcome.output, decision.load)
        )
        if est is None:
            return
        route = est[outcome.route]
        # The estimate is the cell's typical latency: remove what the live queue added at decision
        # time.
        route[0] = _blend(
            route[0],
            outcome.ttft_ms - (decision.queue_correction_ms if outcome.route == "prefill" else 0.0),
        )
        if outcome.tpot_ms is not None:
            route[1] = _blend(route[1], outcome.tpot_ms)


def _blend(old: float, observed: float) -> float:
    """Move old towards observed by at most OBSERVATION_WEIGHT of old."""
    bound = OBSERVATION_WEIGHT * max(old, 1e-3)
    return old + max(-bound, min(bound, OBSERVATION_WEIGHT * (observed - old)))


def make_policy(
    name: str, table: PolicyTable | None = None, objective: Objective | None = None
) -> Policy:
    """The policy called name (one of scheduler.config.POLICIES)."""
    return PPDPolicy(table, objective or Objective()) if name == "ppd" else Policy(name)
