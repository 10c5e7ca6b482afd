"""Prometheus metrics under vLLM's names (so existing routers and dashboards work), plus ppd: additions."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics, generate_latest
from prometheus_client.core import HistogramMetricFamily

from scheduler.messages import WorkerStats

# vLLM's bucket boundaries, so dashboards built for vLLM read ours the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)


class FastHistogram:
    """A Prometheus histogram with one label set, observed without a lock: a bisect and two additions per call.

    prometheus_client's Histogram takes a mutex per bucket and per sum on every observation, which, per streamed
    token, cost more than detokenizing it. Observations come only from the event loop's thread; a scrape (also on
    it) renders the counts, cumulated, in the same exposition as prometheus_client's.
    """

    def __init__(self, name: str, documentation: str, buckets: Sequence[float], label: tuple[str, str],
                 registry: CollectorRegistry) -> None:
        self.name, self.documentation, self.label = name, documentation, label
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        """count observations of value."""
        self.counts[bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=[self.label[0]])
        cumulative, buckets = 0, []
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            cumulative += n
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
        family.add_metric([self.label[1]], buckets, self.sum)
        yield family

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=[self.label[0]])


class Metrics:
    """Observations from the API server and the workers' stats, rendered as Prometheus text."""

    def __init__(self, model_name: str) -> None:
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self.model = model_name
        labels = ["model_name", "engine"]
        r = self.registry
        self.running = Gauge("vllm:num_requests_running", "Requests in the model's batches (decoding or prefilling).", labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for KV blocks.", labels, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", labels, registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", labels, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.", labels, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Sequences preempted for lack of KV blocks.", labels, registry=r)
        model = ("model_name", model_name)
        self.ttft = FastHistogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS, model, r)
        self.itl = FastHistogram("vllm:inter_token_latency_seconds", "Time between consecutive tokens.", ITL_BUCKETS,
                                 model, r)
        self.e2e = FastHistogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", E2E_BUCKETS,
                                 model, r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", ["model_name"], registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens of finished requests.", ["model_name"], registry=r).labels(model_name)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.", ["model_name", "finished_reason"], registry=r)
        self.prefills = Counter("ppd:prefills", "Prefills by where they ran (prefill worker or inline on the decode worker).",
                                ["model_name", "route"], registry=r)
        self.decisions = Counter("ppd:route_decisions", "The router's route decisions, by route and reason (miss, static, "
                                 "table, queue, model, itl_slo, ttft_slo, client).", ["model_name", "route", "reason"],
                                 registry=r)
        self.prefill_queue = Gauge("ppd:prefill_queue_tokens", "Uncached prompt tokens queued on the prefill worker.",
                                   labels, registry=r)
        self.prefill_speed = Gauge("ppd:prefill_tokens_per_second", "The prefill worker's measured speed.", labels,
                                   registry=r)
        self.rejections = Counter("ppd:requests_rejected", "Requests answered 429 because the server was overloaded, by "
                                  "reason (overloaded: refused on arrival; queue_time: waited too long to start).",
                                  ["model_name", "reason"], registry=r)
        self.decode_step = Gauge("ppd:decode_step_seconds", "The decode worker's recent decode-only step time.", labels,
                                 registry=r)
        self.share = Gauge("ppd:partition_share", "Each worker's share of its unit's device now (cores on the CPU).",
                           [*labels, "role"], registry=r)
        self.share_switches = Counter("ppd:partition_switches", "Times the share manager changed the workers' split.",
                                      labels, registry=r)

    def worker_stats(self, unit: int, old: WorkerStats | None, new: WorkerStats) -> None:
        labels = (self.model, str(unit))
        self.running.labels(*labels).set(new.num_running)
        self.waiting.labels(*labels).set(new.num_waiting)
        self.kv_usage.labels(*labels).set(new.kv_usage)
        self.prefill_queue.labels(*labels).set(new.prefill_queue_tokens)
        self.decode_step.labels(*labels).set(new.decode_step_ms / 1000)
        # Worker counters restart from zero with the worker; Prometheus counters must not go down.
        if new.decode_share:
            self.share.labels(*labels, "decode").set(new.decode_share)
            self.share.labels(*labels, "prefill").set(new.prefill_share)
        for counter, now, before in ((self.prefix_queries, new.prefix_queries, old and old.prefix_queries),
                                     (self.prefix_hits, new.prefix_hits, old and old.prefix_hits),
                                     (self.preemptions, new.num_preemptions, old and old.num_preemptions),
                                     (self.share_switches, new.share_switches, old and old.share_switches)):
            delta = now - (before or 0)
            if delta > 0:
                counter.labels(*labels).inc(delta)

    def prefill_speed_measured(self, unit: int, tokens_per_s: float) -> None:
        self.prefill_speed.labels(self.model, str(unit)).set(tokens_per_s)

    def rejected(self, reason: str) -> None:
        self.rejections.labels(self.model, reason).inc()

    def route_decision(self, route: str, reason: str) -> None:
        self.decisions.labels(self.model, route, reason).inc()

    def prefill_routed(self, route: str) -> None:
        self.prefills.labels(self.model, route).inc()

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def inter_token(self, seconds: float, num_tokens: int) -> None:
        """num_tokens arrived together after `seconds`: each is counted at an equal share of the gap."""
        self.itl.observe(seconds / num_tokens, num_tokens)

    def request_finished(self, e2e_seconds: float, prompt_tokens: int, generated_tokens: int, reason: str) -> None:
        self.e2e.observe(e2e_seconds)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated_tokens)
        self.success.labels(self.model, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
