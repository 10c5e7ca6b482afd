"""The lock-free histograms render exactly what prometheus_client's Histogram renders for the same observations."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from server.metrics import E2E_BUCKETS, ITL_BUCKETS, Metrics


def _lines(text: bytes, name: str) -> list[str]:
    return [line for line in text.decode().splitlines() if name in line and "_created" not in line]


def test_inter_token_histogram_matches_prometheus_client() -> None:
    metrics = Metrics("demo")
    metrics.inter_token(0.06, 3)  # three tokens in one chunk: three observations of 0.02
    metrics.inter_token(0.01, 1)  # on a bucket bound: counted in it (le)
    metrics.inter_token(100.0, 2)  # above every bound
    reference = CollectorRegistry()
    hist = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive tokens.", ["model_name"],
                     buckets=ITL_BUCKETS, registry=reference).labels("demo")
    for value in (0.02, 0.02, 0.02, 0.01, 50.0, 50.0):
        hist.observe(value)
    name = "vllm:inter_token_latency_seconds"
    assert _lines(metrics.render(), name) == _lines(generate_latest(reference), name)
    assert f'{name}_count{{model_name="demo"}} 6.0' in _lines(metrics.render(), name)


def test_request_histograms_render_their_observations() -> None:
    metrics = Metrics("demo")
    metrics.request_finished(2.0, 10, 5, "stop")
    reference = CollectorRegistry()
    Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", ["model_name"], buckets=E2E_BUCKETS,
              registry=reference).labels("demo").observe(2.0)
    name = "vllm:e2e_request_latency_seconds"
    assert _lines(metrics.render(), name) == _lines(generate_latest(reference), name)


def test_node_series_sum_the_units_queues_and_average_their_kv_usage() -> None:
    """What a scheduler reading one series per family (llm-d's endpoint picker) must see: the whole node."""
    from scheduler.messages import WorkerStats

    metrics = Metrics("demo")
    for unit, (running, waiting, usage) in enumerate([(3, 1, 0.5), (1, 4, 0.25)]):
        metrics.worker_stats(unit, None, WorkerStats(num_running=running, num_waiting=waiting, kv_usage=usage,
                                                     prefix_queries=0, prefix_hits=0, num_preemptions=0))
    text = metrics.render().decode()
    assert 'ppd:node_num_requests_running{model_name="demo"} 4.0' in text
    assert 'ppd:node_num_requests_waiting{model_name="demo"} 5.0' in text
    assert 'ppd:node_kv_cache_usage_perc{model_name="demo"} 0.375' in text
