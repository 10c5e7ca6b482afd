"""The lock-free histograms render exactly what prometheus_client's Histogram renders for the same
observations."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from server.metrics import E2E_BUCKETS, ITL_BUCKETS, Metrics, buckets_1_2_5


def _lines(text: bytes, name: str) -> list[str]:
    return [line for line in text.decode().splitlines() if name in line and "_created" not in line]


def test_inter_token_histogram_matches_prometheus_client() -> None:
    metrics = Metrics("demo")
    metrics.inter_token(0.06, 3)  # three tokens in one chunk: three observations of 0.02
    metrics.inter_token(0.01, 1)  # on a bucket bound: counted in it (le)
    metrics.inter_token(100.0, 2)  # above every bound
    reference = CollectorRegistry()
    hist = Histogram(
        "vllm:inter_token_latency_seconds",
        "Time between consecutive tokens.",
        ["model_name"],
        buckets=ITL_BUCKETS,
        registry=reference,
    ).labels("demo")
    for value in (0.02, 0.02, 0.02, 0.01, 50.0, 50.0):
        hist.observe(value)
    name = "vllm:inter_token_latency_seconds"
    assert _lines(metrics.render(), name) == _lines(generate_latest(reference), name)
    assert f'{name}_count{{model_name="demo"}} 6.0' in _lines(metrics.render(), name)


def test_request_histograms_render_their_observations() -> None:
    metrics = Metrics("demo")
    metrics.request_finished(2.0, 10, 5, "stop")
    reference = CollectorRegistry()
    Histogram(
        "vllm:e2e_request_latency_seconds",
        "End-to-end request latency.",
        ["model_name"],
        buckets=E2E_BUCKETS,
        registry=reference,
    ).labels("demo").observe(2.0)
    name = "vllm:e2e_request_latency_seconds"
    assert _lines(metrics.render(), name) == _lines(generate_latest(reference), name)


def test_node_series_sum_the_units_queues_and_average_their_kv_usage() -> None:
    """What a scheduler reading one series per family (llm-d's endpoint picker) must see: the whole
    node."""
    from scheduler.messages import WorkerStats

    metrics = Metrics("demo")
    for unit, (running, waiting, usage) in enumerate([(3, 1, 0.5), (1, 4, 0.25)]):
        metrics.worker_stats(
            unit,
            None,
            WorkerStats(
                num_running=running,
                num_waiting=waiting,
                kv_usage=usage,
                prefix_queries=0,
                prefix_hits=0,
                num_preemptions=0,
            ),
        )
    text = metrics.render().decode()
    assert 'ppd:node_num_requests_running{model_name="demo"} 4.0' in text
    assert 'ppd:node_num_requests_waiting{model_name="demo"} 5.0' in text
    assert 'ppd:node_kv_cache_usage_perc{model_name="demo"} 0.375' in text


def test_a_requests_phases_and_token_counts_render_as_vllms_histograms() -> None:
    metrics = Metrics("demo", max_model_len=1000)
    metrics.request_finished(2.0, 120, 7, "stop", (0.25, 0.5, 1.25))
    metrics.request_finished(0.1, 3, 0, "abort")  # no token: no phases
    reference = CollectorRegistry()
    expected = {
        "vllm:request_queue_time_seconds": (E2E_BUCKETS, [0.25]),
        "vllm:request_prefill_time_seconds": (E2E_BUCKETS, [0.5]),
        "vllm:request_decode_time_seconds": (E2E_BUCKETS, [1.25]),
        "vllm:request_inference_time_seconds": (E2E_BUCKETS, [1.75]),
        "vllm:request_prompt_tokens": (buckets_1_2_5(1000), [120, 3]),
        "vllm:request_generation_tokens": (buckets_1_2_5(1000), [7, 0]),
    }
    docs = {m.name: m.documentation for m in metrics.request_side if hasattr(m, "documentation")}
    for name, (buckets, values) in expected.items():
        hist = Histogram(
            name, docs[name], ["model_name"], buckets=buckets, registry=reference
        ).labels("demo")
        for value in values:
            hist.observe(value)
    for name in expected:
        assert _lines(metrics.render(), name) == _lines(generate_latest(reference), name), name
    assert buckets_1_2_5(1000) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


def test_steps_by_token_count_add_up_across_a_worker_restart() -> None:
    from scheduler.messages import ITERATION_TOKEN_BUCKETS, WorkerStats

    def stats(counts: list[int], total: int) -> WorkerStats:
        return WorkerStats(
            num_running=0,
            num_waiting=0,
            kv_usage=0.0,
            prefix_queries=0,
            prefix_hits=0,
            num_preemptions=0,
            iteration_tokens=counts + [0] * (len(ITERATION_TOKEN_BUCKETS) + 1 - len(counts)),
            iteration_tokens_sum=total,
        )

    metrics = Metrics("demo")
    first, later, restarted = stats([3, 1], 10), stats([5, 2], 20), stats([1], 1)
    metrics.worker_stats(0, None, first)
    metrics.worker_stats(0, first, later)
    metrics.worker_stats(0, later, restarted)  # counts went down: a new worker, counted from zero
    text = metrics.render().decode()
    assert 'vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="demo"} 6.0' in text
    assert 'vllm:iteration_tokens_total_bucket{engine="0",le="8.0",model_name="demo"} 8.0' in text
    assert 'vllm:iteration_tokens_total_count{engine="0",model_name="demo"} 8.0' in text
    assert 'vllm:iteration_tokens_total_sum{engine="0",model_name="demo"} 21.0' in text
