"""Prometheus metrics under vLLM's names (so existing routers and dashboards work), plus ppd:
additions."""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from pathlib import Path

import msgspec
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from scheduler.messages import ITERATION_TOKEN_BUCKETS, WorkerStats

# vLLM's bucket boundaries, so dashboards built for vLLM read ours the same way.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)  # also vLLM's queue, prefill, decode and inference time buckets


def buckets_1_2_5(largest: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to largest (the context length)."""
    found, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > largest:
                return tuple(found)
            found.append(step * scale)
        scale *= 10


SNAPSHOT_INTERVAL_S = 1.0


class PeerStates:
    """What the other API servers (--api-server-count) have observed, so that a scrape, whichever
    process answers it, counts every request: each process writes its own request-side state to a
    file in the run's folder every SNAPSHOT_INTERVAL_S, and reads the others' when scraped (a second
    stale at most)."""

    def __init__(self, folder: str | None = None, me: int = 0, count: int = 1) -> None:
        self.files = [Path(folder) / f"metrics-{i}.msgpack" for i in range(count)] if folder else []
        self.me = me
        self.states: list[dict] = []  # the others' states as read for the scrape being rendered

    def write(self, state: dict) -> None:
        if not self.files:
            return
        tmp = self.files[self.me].with_suffix(".tmp")
        tmp.write_bytes(msgspec.msgpack.encode(state))
        tmp.replace(self.files[self.me])  # atomic: a reader sees the old state or the new one

    def read(self) -> None:
        """Read the others' states once per scrape (every request-side metric adds them)."""
        self.states = []
        for i, file in enumerate(self.files):
            if i == self.me:
                continue
            try:
                self.states.append(msgspec.msgpack.decode(file.read_bytes()))
            except (FileNotFoundError, msgspec.DecodeError):  # not written yet, or being replaced
                continue


def cumulative_buckets(bounds: Sequence[float], counts: Sequence[int]) -> list[tuple[str, int]]:
    """Counts per bucket (the last above every bound) as Prometheus renders them: (le, observations
    up to it)."""
    cumulative, buckets = 0, []
    for bound, n in zip((*bounds, float("inf")), counts):
        cumulative += n
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
    return buckets


class FastHistogram:
    """A Prometheus histogram with one label set, observed without a lock: a bisect and two
    additions per call.

    prometheus_client's Histogram takes a mutex per bucket and per sum on every observation, which,
    per streamed token, cost more than detokenizing it. Observations come only from the event loop's
    thread; a scrape (also on it) renders the counts, cumulated and added to the other API servers',
    in the same exposition as prometheus_client's.
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        buckets: Sequence[float],
        label: tuple[str, str],
        registry: CollectorRegistry,
        peers: PeerStates,
    ) -> None:
        self.name, self.documentation, self.label, self.peers = name, documentation, label, peers
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        """count observations of value."""
        self.counts[bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def state(self) -> list:
        return [self.counts, self.sum]

    def collect(self) -> Iterator[HistogramMetricFamily]:
        counts, total = list(self.counts), self.sum
        for peer in self.peers.states:
            if (state := peer.get(self.name)) is not None:
                counts = [a + b for a, b in zip(counts, state[0])]
                total += state[1]
        family = HistogramMetricFamily(self.name, self.documentation, labels=[self.label[0]])
        family.add_metric([self.label[1]], cumulative_buckets(self.bounds, counts), total)
        yield family

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=[self.label[0]])


class UnitHistogram:
    """A histogram per unit (labels model_name, engine) of what the units' workers count themselves,
    cumulatively since each started (their steps by token count): a worker's counts are added as
    they grow, and a restarted worker's start again from zero without the histogram going down."""

    def __init__(
        self,
        name: str,
        documentation: str,
        buckets: Sequence[float],
        model_name: str,
        registry: CollectorRegistry,
    ) -> None:
        self.name, self.documentation, self.model = name, documentation, model_name
        self.bounds = tuple(buckets)
        self.units: dict[int, list] = {}  # unit -> [counts per bucket (the last: +Inf), sum]
        registry.register(self)

    def grew(
        self, unit: int, old: tuple[list[int], float] | None, new: tuple[list[int], float]
    ) -> None:
        """A worker's cumulative (counts, sum) went from old (None: its first, or it restarted) to
        new."""
        counts, total = self.units.setdefault(unit, [[0] * (len(self.bounds) + 1), 0.0])
        if not new[0]:
            return
        before = (
            old
            if old is not None and old[0] and all(b <= a for a, b in zip(new[0], old[0]))
            else None
        )
        for i, n in enumerate(new[0]):
            counts[i] += n - (before[0][i] if before else 0)
        self.units[unit][1] = total + new[1] - (before[1] if before else 0)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(
            self.name, self.documentation, labels=["model_name", "engine"]
        )
        for unit, (counts, total) in sorted(self.units.items()):
            family.add_metric(
                [self.model, str(unit)], cumulative_buckets(self.bounds, counts), total
            )
        yield family

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=["model_name", "engine"])


class FastCounter:
    """A Prometheus counter (name_total) counted per API server and rendered as the sum over them,
    like FastHistogram."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labels: Sequence[str],
        registry: CollectorRegistry,
        peers: PeerStates,
    ) -> None:
        self.name, self.documentation, self.labels, self.peers = (
            name,
            documentation,
            list(labels),
            peers,
        )
        self.values: dict[tuple[str, ...], float] = {}
        registry.register(self)

    def inc(self, labels: tuple[str, ...], amount: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def state(self) -> list:
        return [[list(k), v] for k, v in self.values.items()]

    def collect(self) -> Iterator[CounterMetricFamily]:
        values = dict(self.values)
        for peer in self.peers.states:
            for labels, value in peer.get(self.name, []):
                values[tuple(labels)] = values.get(tuple(labels), 0.0) + value
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labels)
        for labels, value in sorted(values.items()):
            family.add_metric(list(labels), value)
        yield family

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.name, self.documentation, labels=self.labels)


class CpuSeconds(FastCounter):
    """This API server process's CPU time (user and system), summed over the API servers like the
    counters above: what the HTTP front end costs, per generated token over a run (`ppd bench`
    reports it so)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        model_name: str,
        registry: CollectorRegistry,
        peers: PeerStates,
    ) -> None:
        self._labels = (model_name,)
        super().__init__(name, documentation, ["model_name"], registry, peers)

    def _refresh(self) -> None:
        self.values[self._labels] = time.process_time()

    def state(self) -> list:
        self._refresh()
        return super().state()

    def collect(self) -> Iterator[CounterMetricFamily]:
        self._refresh()
        yield from super().collect()


class Metrics:
    """Observations from the API server and the workers' stats, rendered as Prometheus text.

    The workers' stats reach every API server alike, so each renders them itself; what an API server
    observes of its own requests (latencies, tokens, finishes, routes, rejections) is summed over
    all of them (PeerStates).
    """

    def __init__(
        self, model_name: str, peers: PeerStates | None = None, max_model_len: int = 8192
    ) -> None:
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self.peers = p = peers or PeerStates()
        self.model = model_name
        labels = ["model_name", "engine"]
        r = self.registry
        self.running = Gauge(
            "vllm:num_requests_running",
            "Requests in the model's batches (decoding or prefilling).",
            labels,
            registry=r,
        )
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting for KV blocks.", labels, registry=r
        )
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "Fraction of KV blocks in use (1 = full).",
            labels,
            registry=r,
        )
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            labels,
            registry=r,
        )
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prompt tokens served from the prefix cache.",
            labels,
            registry=r,
        )
        self.preemptions = Counter(
            "vllm:num_preemptions", "Sequences preempted for lack of KV blocks.", labels, registry=r
        )
        model = ("model_name", model_name)
        self.ttft = FastHistogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS, model, r, p
        )
        self.itl = FastHistogram(
            "vllm:inter_token_latency_seconds",
            "Time between consecutive tokens.",
            ITL_BUCKETS,
            model,
            r,
            p,
        )
        self.e2e = FastHistogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            E2E_BUCKETS,
            model,
            r,
            p,
        )
        self.queue_time = FastHistogram(
            "vllm:request_queue_time_seconds",
            "Time a request waited before its first prompt chunk ran.",
            E2E_BUCKETS,
            model,
            r,
            p,
        )
        self.prefill_time = FastHistogram(
            "vllm:request_prefill_time_seconds",
            "Time from a request's first prompt chunk to its first token.",
            E2E_BUCKETS,
            model,
            r,
            p,
        )
        self.decode_time = FastHistogram(
            "vllm:request_decode_time_seconds",
            "Time from a request's first token to its last.",
            E2E_BUCKETS,
            model,
            r,
            p,
        )
        self.inference_time = FastHistogram(
            "vllm:request_inference_time_seconds",
            "Time from a request's first prompt chunk to its last token (prefill and decode).",
            E2E_BUCKETS,
            model,
            r,
            p,
        )
        tokens = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = FastHistogram(
            "vllm:request_prompt_tokens", "Prompt tokens of finished requests.", tokens, model, r, p
        )
        self.request_generation_tokens = FastHistogram(
            "vllm:request_generation_tokens",
            "Generated tokens of finished requests.",
            tokens,
            model,
            r,
            p,
        )
        self.iteration_tokens = UnitHistogram(
            "vllm:iteration_tokens_total",
            "Tokens per engine step of the decode worker (prompt chunks and decodes).",
            ITERATION_TOKEN_BUCKETS,
            model_name,
            r,
        )
        self.cache_info = Gauge(
            "vllm:cache_config_info",
            "The KV cache's configuration (the value is 1).",
            [
                "model_name",
                "engine",
                "block_size",
                "cache_dtype",
                "enable_prefix_caching",
                "num_gpu_blocks",
                "gpu_memory_utilization",
            ],
            registry=r,
        )
        self.prompt_tokens = FastCounter(
            "vllm:prompt_tokens", "Prompt tokens of finished requests.", ["model_name"], r, p
        )
        self.generation_tokens = FastCounter(
            "vllm:generation_tokens", "Generated tokens of finished requests.", ["model_name"], r, p
        )
        self.success = FastCounter(
            "vllm:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            r,
            p,
        )
        self.prefills = FastCounter(
            "ppd:prefills",
            "Prefills by where they ran (prefill worker or inline on the decode worker).",
            ["model_name", "route"],
            r,
            p,
        )
        self.decisions = FastCounter(
            "ppd:route_decisions",
            "The router's route decisions, by route and reason (miss, "
            "static, table, queue, model, itl_slo, ttft_slo, client).",
            ["model_name", "route", "reason"],
            r,
            p,
        )
        self.prefill_queue = Gauge(
            "ppd:prefill_queue_tokens",
            "Uncached prompt tokens queued on the prefill worker.",
            labels,
            registry=r,
        )
        self.prefill_speed = Gauge(
            "ppd:prefill_tokens_per_second",
            "The prefill worker's measured speed.",
            labels,
            registry=r,
        )
        self.rejections = FastCounter(
            "ppd:requests_rejected",
            "Requests answered 429 because the server was overloaded, "
            "by reason (overloaded: refused on arrival; queue_time: waited too long to start).",
            ["model_name", "reason"],
            r,
            p,
        )
        self.api_cpu = CpuSeconds(
            "ppd:api_server_cpu_seconds",
            "CPU seconds of the API server processes.",
            model_name,
            r,
            p,
        )
        for counter in (
            self.prompt_tokens,
            self.generation_tokens,
        ):  # shown from the start, as vLLM's are
            counter.inc((model_name,), 0)
        self.request_side = (
            self.ttft,
            self.itl,
            self.e2e,
            self.queue_time,
            self.prefill_time,
            self.decode_time,
            self.inference_time,
            self.request_prompt_tokens,
            self.request_generation_tokens,
            self.prompt_tokens,
            self.generation_tokens,
            self.success,
            self.prefills,
            self.decisions,
            self.rejections,
            self.api_cpu,
        )
        self.decode_step = Gauge(
            "ppd:decode_step_seconds",
            "The decode worker's recent decode-only step time.",
            labels,
            registry=r,
        )
        self.inline_speed = Gauge(
            "ppd:inline_tokens_per_second",
            "What an inline prefill token costs the decode worker's step, as a speed (0 until "
            "measured).",
            labels,
            registry=r,
        )
        self.inline_expert = Gauge(
            "ppd:inline_expert_seconds",
            "Of a mixture of experts: what each expert an inline prefill reads that the decode "
            "batch does not adds to the decode worker's step (0 until measured; 0 for a dense "
            "model).",
            labels,
            registry=r,
        )
        self.share = Gauge(
            "ppd:partition_share",
            "Each worker's share of its unit's device now (cores on the CPU).",
            [*labels, "role"],
            registry=r,
        )
        self.share_switches = Counter(
            "ppd:partition_switches",
            "Times the share manager changed the workers' split.",
            labels,
            registry=r,
        )
        self.steps = Counter(
            "ppd:worker_steps", "Engine steps the decode worker ran.", labels, registry=r
        )
        self.step_seconds = Counter(
            "ppd:worker_step_seconds",
            "Seconds the decode worker spent in engine steps (inputs, forward pass, sampling).",
            labels,
            registry=r,
        )
        self.loop_seconds = Counter(
            "ppd:worker_loop_seconds",
            "Seconds the decode worker's loop spent around its "
            "steps: messages in, scheduling, outputs out (host time CUDA graphs do not hide).",
            labels,
            registry=r,
        )
        # The second KV tier (--kv-offloading-size): its fill, and blocks stored, loaded back and
        # dropped (as blocks, bytes and, for loads, tokens).
        self.tier_usage = Gauge(
            "ppd:kv_tier_usage_perc",
            "Fraction of the second KV tier's blocks in use (1 = full).",
            labels,
            registry=r,
        )
        self.retained = Gauge(
            "ppd:kv_retained_blocks",
            "Evictable KV blocks that clients' cache retention hints keep behind the LRU.",
            labels,
            registry=r,
        )
        self.tier_counters = {
            name: Counter(f"ppd:kv_tier_{name}", what, labels, registry=r)
            for name, what in (
                ("stored_blocks", "KV blocks the pool evicted and the second tier stored."),
                ("stored_bytes", "Bytes of KV the second tier stored."),
                ("loaded_blocks", "KV blocks loaded back from the second tier into the pool."),
                ("loaded_bytes", "Bytes of KV loaded back from the second tier."),
                ("loaded_tokens", "Prompt tokens whose KV was loaded from the second tier."),
                (
                    "dropped_blocks",
                    "KV blocks the second tier let go (its LRU) or had no room for.",
                ),
            )
        }
        # The node as one engine, for schedulers that read a single series per family (llm-d's
        # endpoint picker): the requests of all units, and their mean KV usage (the node's router
        # balances its units).
        node = ["model_name"]
        self.node_running = Gauge(
            "ppd:node_num_requests_running",
            "vllm:num_requests_running summed over the units.",
            node,
            registry=r,
        )
        self.node_waiting = Gauge(
            "ppd:node_num_requests_waiting",
            "vllm:num_requests_waiting summed over the units.",
            node,
            registry=r,
        )
        self.node_kv_usage = Gauge(
            "ppd:node_kv_cache_usage_perc",
            "vllm:kv_cache_usage_perc averaged over the units.",
            node,
            registry=r,
        )
        self._units: dict[
            int, WorkerStats
        ] = {}  # each unit's latest stats, for the node series at a scrape

    def worker_stats(self, unit: int, old: WorkerStats | None, new: WorkerStats) -> None:
        labels = (self.model, str(unit))
        self.running.labels(*labels).set(new.num_running)
        self.waiting.labels(*labels).set(new.num_waiting)
        self.kv_usage.labels(*labels).set(new.kv_usage)
        self.prefill_queue.labels(*labels).set(new.prefill_queue_tokens)
        self.decode_step.labels(*labels).set(new.decode_step_ms / 1000)
        self.inline_speed.labels(*labels).set(new.inline_tokens_per_s)
        self.inline_expert.labels(*labels).set(new.inline_expert_ms / 1000)
        self._units[unit] = new
        self.iteration_tokens.grew(
            unit,
            old and (old.iteration_tokens, old.iteration_tokens_sum),
            (new.iteration_tokens, new.iteration_tokens_sum),
        )
        # Worker counters restart from zero with the worker; Prometheus counters must not go down.
        if new.decode_share:
            self.share.labels(*labels, "decode").set(new.decode_share)
            self.share.labels(*labels, "prefill").set(new.prefill_share)
        self.retained.labels(*labels).set(new.kv_retained_blocks)
        counts = list(self._tier_counts(labels, new, old))
        for counter, now, before in (
            *counts,
            (self.prefix_queries, new.prefix_queries, old and old.prefix_queries),
            (self.prefix_hits, new.prefix_hits, old and old.prefix_hits),
            (self.preemptions, new.num_preemptions, old and old.num_preemptions),
            (self.share_switches, new.share_switches, old and old.share_switches),
            (self.steps, new.steps, old and old.steps),
            (self.step_seconds, new.step_seconds, old and old.step_seconds),
            (self.loop_seconds, new.loop_seconds, old and old.loop_seconds),
        ):
            delta = now - (before or 0)
            child = counter.labels(
                *labels
            )  # a unit's series shows from its first stats, at 0, as vLLM's do
            if delta > 0:
                child.inc(delta)

    def _tier_counts(
        self, labels: tuple[str, str], new: WorkerStats, old: WorkerStats | None
    ) -> Iterator[tuple]:
        """(counter, now, before) of the second tier's counters; its fill gauge set."""
        if (tier := new.tier) is None:
            return
        self.tier_usage.labels(*labels).set(tier.blocks / tier.capacity)
        was = old.tier if old is not None else None
        c = self.tier_counters
        for name, now, before in (
            ("stored_blocks", tier.stored, was and was.stored),
            ("stored_bytes", tier.stored * tier.block_bytes, was and was.stored * was.block_bytes),
            ("loaded_blocks", tier.loaded, was and was.loaded),
            ("loaded_bytes", tier.loaded * tier.block_bytes, was and was.loaded * was.block_bytes),
            ("loaded_tokens", tier.loaded * tier.block_size, was and was.loaded * was.block_size),
            ("dropped_blocks", tier.dropped, was and was.dropped),
        ):
            yield c[name], now, before

    def prefill_speed_measured(self, unit: int, tokens_per_s: float) -> None:
        self.prefill_speed.labels(self.model, str(unit)).set(tokens_per_s)

    def rejected(self, reason: str) -> None:
        self.rejections.inc((self.model, reason))

    def route_decision(self, route: str, reason: str) -> None:
        self.decisions.inc((self.model, route, reason))

    def prefill_routed(self, route: str) -> None:
        self.prefills.inc((self.model, route))

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def inter_token(self, seconds: float, num_tokens: int) -> None:
        """num_tokens arrived together after `seconds`: each is counted at an equal share of the
        gap."""
        self.itl.observe(seconds / num_tokens, num_tokens)

    def cache_config(
        self,
        unit: int,
        block_size: int,
        cache_dtype: str,
        num_blocks: int,
        gpu_memory_utilization: float | None,
    ) -> None:
        """A unit's KV cache, once it is ready (vLLM's info gauge: the labels say it)."""
        self.cache_info.labels(
            self.model,
            str(unit),
            str(block_size),
            cache_dtype,
            "True",
            str(num_blocks),
            "" if gpu_memory_utilization is None else str(gpu_memory_utilization),
        ).set(1)

    def request_finished(
        self,
        e2e_seconds: float,
        prompt_tokens: int,
        generated_tokens: int,
        reason: str,
        phases: tuple[float, float, float] | None = None,
    ) -> None:
        """A request ended; phases: its (queue, prefill, decode) seconds, where it generated a
        token."""
        self.e2e.observe(e2e_seconds)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generated_tokens)
        if phases is not None:
            queue, prefill, decode = (max(0.0, s) for s in phases)
            self.queue_time.observe(queue)
            self.prefill_time.observe(prefill)
            self.decode_time.observe(decode)
            self.inference_time.observe(prefill + decode)
        self.prompt_tokens.inc((self.model,), prompt_tokens)
        self.generation_tokens.inc((self.model,), generated_tokens)
        self.success.inc((self.model, reason))

    def write_state(self) -> None:
        """Publish this API server's request-side counts to the others (with several API
        servers)."""
        self.peers.write({m.name: m.state() for m in self.request_side})

    def render(self) -> bytes:
        self.peers.read()
        if units := self._units.values():  # summed at a scrape, not on every worker message
            self.node_running.labels(self.model).set(sum(u.num_running for u in units))
            self.node_waiting.labels(self.model).set(sum(u.num_waiting for u in units))
            self.node_kv_usage.labels(self.model).set(sum(u.kv_usage for u in units) / len(units))
        return generate_latest(self.registry)
