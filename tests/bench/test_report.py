"""The bench report: statistics on hand-made records, goodput, SLO parsing, the table and the
written files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.client import RequestRecord
from bench.report import (
    HOST_COUNTERS,
    KV_TIER_COUNTERS,
    add_ratios,
    host_cost_table,
    host_costs,
    kv_tier,
    markdown_table,
    median_of_runs,
    parse_goodput,
    plot_latency_vs_qps,
    ratio_table,
    read_records,
    summarize,
    write_report,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def rec(
    conversation: str = "c0",
    turn: int = 0,
    ttft: float | None = 0.1,
    latency: float | None = 1.0,
    output_tokens: int = 10,
    prompt_tokens: int = 100,
    itl: list[float] | None = None,
    cached_tokens: int | None = None,
    route: str | None = None,
    error: str | None = None,
    history_tokens: int | None = None,
) -> RequestRecord:
    return RequestRecord(
        conversation=conversation,
        turn=turn,
        start=0.0,
        ttft=ttft,
        itl=itl or [],
        latency=latency,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        cached_tokens=cached_tokens,
        route=route,
        error=error,
        history_tokens=history_tokens,
    )


def linear_percentile(values: list[float], q: float) -> float:
    """Percentile by linear interpolation between the closest ranks, written out for the test."""
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def test_ttft_percentiles_split_turn1_from_later_turns() -> None:
    # Turn 1: TTFTs 0, 1, ..., 100 ms, so the p-th percentile is p ms. Turns 2+: 200, 202, ..., 400
    # ms.
    records = [rec(f"c{i}", 0, ttft=i / 1000) for i in range(101)]
    records += [rec(f"c{i}", 1 + i % 3, ttft=(200 + 2 * i) / 1000) for i in range(101)]
    s = summarize(records, duration_s=10.0)
    assert (
        s["ttft_turn1_ms_p50"],
        s["ttft_turn1_ms_p90"],
        s["ttft_turn1_ms_p99"],
    ) == pytest.approx((50, 90, 99))
    assert (
        s["ttft_turn2plus_ms_p50"],
        s["ttft_turn2plus_ms_p90"],
        s["ttft_turn2plus_ms_p99"],
    ) == pytest.approx((300, 380, 398))
    assert s["requests"] == 202 and s["conversations"] == 101


def test_tpot_itl_and_latency_percentiles() -> None:
    # TPOT = (latency - ttft) / (output - 1): 11 tokens after a 0.1 s TTFT, 10 gaps of t each.
    tpots = [0.01 * (i + 1) for i in range(20)]
    records = [
        rec(f"c{i}", 0, ttft=0.1, latency=0.1 + 10 * t, output_tokens=11)
        for i, t in enumerate(tpots)
    ]
    records[0].itl = [0.001] * 99
    records[1].itl = [1.0]
    s = summarize(records, duration_s=10.0)
    assert s["tpot_ms_p50"] == pytest.approx(1000 * linear_percentile(tpots, 50))
    assert s["tpot_ms_p99"] == pytest.approx(1000 * linear_percentile(tpots, 99))
    # 100 gaps over two requests: 99 of 1 ms, one of 1000 ms; rank 98.01 lies 1% of the way to the
    # big one.
    assert s["itl_ms_p99"] == pytest.approx(1 + 0.01 * 999)
    latencies = [0.1 + 10 * t for t in tpots]
    assert s["e2e_ms_p50"] == pytest.approx(1000 * linear_percentile(latencies, 50))
    assert s["e2e_ms_p99"] == pytest.approx(1000 * linear_percentile(latencies, 99))


def test_failed_requests_count_in_success_rate_but_not_in_latencies() -> None:
    records = [
        rec("a", 0, ttft=0.1, output_tokens=20, prompt_tokens=100),
        rec("a", 1, ttft=0.3, output_tokens=30, prompt_tokens=200),
        rec("b", 0, ttft=50.0, latency=60.0, output_tokens=5, prompt_tokens=100, error="timeout"),
        rec("c", 0, ttft=None, latency=0.01, output_tokens=0, error="HTTP 503"),
    ]
    s = summarize(records, duration_s=5.0)
    assert (s["requests"], s["succeeded"], s["failed"], s["conversations"]) == (4, 2, 2, 3)
    assert s["success_rate"] == pytest.approx(0.5)
    assert s["ttft_turn1_ms_p99"] == pytest.approx(100) and s[
        "ttft_turn2plus_ms_p50"
    ] == pytest.approx(300)
    assert s["e2e_ms_p99"] == pytest.approx(1000)
    assert s["output_tokens_per_s"] == pytest.approx((20 + 30) / 5)
    assert s["total_tokens_per_s"] == pytest.approx((20 + 30 + 100 + 200) / 5)
    assert s["requests_per_s"] == pytest.approx(2 / 5)
    assert s["errors"] == {"timeout": 1, "HTTP 503": 1}


def test_goodput_counts_only_requests_meeting_every_slo() -> None:
    records = [
        rec("ok", ttft=0.1, latency=0.1 + 9 * 0.01, output_tokens=10),  # TTFT 100 ms, TPOT 10 ms
        rec("slow-first", ttft=0.6, latency=0.7, output_tokens=10),  # TTFT misses
        rec("slow-decode", ttft=0.1, latency=0.1 + 9 * 0.1, output_tokens=10),  # TPOT 100 ms misses
        rec("failed", ttft=0.1, latency=0.2, error="boom"),
        rec("one-token", ttft=0.2, latency=0.2, output_tokens=1),
    ]  # no TPOT to miss
    s = summarize(records, duration_s=4.0, goodput={"ttft": 0.5, "tpot": 0.05})
    assert s["goodput_fraction"] == pytest.approx(2 / 5)
    assert s["goodput_requests_per_s"] == pytest.approx(2 / 4)
    assert s["goodput_slo_ms"] == pytest.approx({"ttft": 500, "tpot": 50})
    e2e = summarize(records, duration_s=4.0, goodput={"e2e": 0.5})
    assert e2e["goodput_fraction"] == pytest.approx(2 / 5)  # ok (190 ms) and one-token (200 ms)
    assert summarize(records, 4.0)["goodput_fraction"] is None, "no SLO, no goodput"


def test_prefix_cache_hits_and_routes() -> None:
    records = [
        rec("a", 0, prompt_tokens=100, cached_tokens=0, route="prefill"),
        rec("a", 1, prompt_tokens=200, cached_tokens=150, route="decode"),
        rec("b", 1, prompt_tokens=100, cached_tokens=50, route="decode"),
        rec("c", 0, prompt_tokens=999, cached_tokens=None),  # a server that does not report it
        rec("d", 1, prompt_tokens=100, cached_tokens=100, route="prefill", error="x"),
    ]
    s = summarize(records, duration_s=1.0)
    assert s["prefix_cache_hit_fraction"] == pytest.approx(200 / 400)
    assert s["prefix_cache_hit_fraction_turn2plus"] == pytest.approx(200 / 300)
    assert s["routes"] == {"prefill": 2, "decode": 2}


def test_empty_runs_give_none_not_errors() -> None:
    for s in (summarize([], 0.0), summarize([], 10.0, goodput={"ttft": 0.5}, label={"qps": 1})):
        json.dumps(s)
        assert s["requests"] == 0 and s["success_rate"] is None and s["goodput_fraction"] is None
        assert all(s[k] is None for k in s if "_ms_p" in k)
        assert s["prefix_cache_hit_fraction"] is None and s["routes"] == {}
    assert summarize([], 10.0)["output_tokens_per_s"] == 0
    only_failed = summarize([rec(error="boom")], 1.0, label={"policy": "pd"})
    assert only_failed["success_rate"] == 0 and only_failed["ttft_turn1_ms_p50"] is None
    assert only_failed["label"] == {"policy": "pd"}


def test_summary_is_json_serializable() -> None:
    records = [rec("a", 0, itl=[0.01, 0.02], cached_tokens=3, route="prefill"), rec("a", 1)]
    s = summarize(records, 2.0, {"ttft": 1.0}, {"server": "ppd:ppd", "qps": 2.0})
    assert json.loads(json.dumps(s)) == s


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:500", "tpot:50", "e2e:2000"]) == pytest.approx(
        {"ttft": 0.5, "tpot": 0.05, "e2e": 2.0}
    )
    assert parse_goodput([]) == {}
    for bad in ["ttft500", "ttfb:500", "ttft:abc", "ttft:-1", "ttft:0", "ttft:inf", "ttft:"]:
        with pytest.raises(ValueError, match="KEY:MS") as info:
            parse_goodput([bad])
        assert repr(bad) in str(info.value)
    with pytest.raises(ValueError, match="twice"):
        parse_goodput(["ttft:1", "ttft:2"])


def sweep() -> tuple[list[dict], dict[str, list[RequestRecord]]]:
    summaries, runs = [], {}
    for server in ("ppd:pd", "ppd:ppd"):
        for qps in (1.0, 2.0, 4.0):
            records = [
                rec(
                    f"c{i}",
                    t,
                    ttft=0.05 * qps * (1 + t),
                    latency=0.5 * qps,
                    output_tokens=20,
                    itl=[0.02] * 19,
                    cached_tokens=50 * t,
                    route="decode" if t else "prefill",
                )
                for i in range(5)
                for t in range(2)
            ]
            runs[f"{server}-{qps}"] = records
            summaries.append(
                summarize(
                    records,
                    10.0,
                    {"ttft": 0.2},
                    {"server": server, "qps": qps, "concurrency": None},
                )
            )
    return summaries, runs


def test_markdown_table_has_one_row_per_run() -> None:
    summaries, _ = sweep()
    lines = markdown_table(summaries).splitlines()
    assert len(lines) == 2 + len(summaries)
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[:2] == ["server", "qps"], "a label that is None in every run gets no column"
    assert "TTFT turn 2+ p50 / p99 (ms)" in header
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    assert lines[2].startswith("| ppd:pd | 1.0 |") and lines[-1].startswith("| ppd:ppd | 4.0 |")
    assert (
        markdown_table([summarize([], 0.0, label={"server": "a|b"})])
        .splitlines()[2]
        .startswith("| a\\|b |")
    )


def test_ratios_divide_ours_by_the_peers_at_the_same_load() -> None:
    def run(server: str, qps: float, ttft: float) -> dict:
        return summarize(
            [rec(ttft=ttft), rec(turn=1, ttft=ttft)], 2.0, label={"server": server, "qps": qps}
        )

    ours, ours_alone, theirs = run("ppd:ppd", 1, 0.05), run("ppd:ppd", 2, 0.1), run("vllm", 1, 0.1)
    assert ratio_table([ours, theirs]) == ""
    add_ratios([ours, ours_alone, theirs], "vllm")
    ratio = ours["ratio_to"]
    assert ratio["server"] == "vllm" and ratio["ttft_turn2plus_ms_p50"] == pytest.approx(0.5)
    assert ratio["tpot_ms_p50"] == pytest.approx(0.95 / 0.9) and ratio[
        "output_tokens_per_s"
    ] == pytest.approx(1.0)
    assert (
        "ratio_to" not in ours_alone and "ratio_to" not in theirs
    )  # no vllm run at qps 2; the peer has none
    table = ratio_table([ours, ours_alone, theirs]).splitlines()
    assert len(table) == 3 and table[2].startswith(
        "| ppd:ppd | 1 | vllm | 0.50 | 0.50 | 0.50 | 1.06 |"
    )


def test_write_report_writes_summary_table_plots_and_records(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    summaries, runs = sweep()
    out = tmp_path / "report"
    paths = write_report(summaries, out, runs)
    assert all(p.exists() for p in paths)
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summaries))
    report = (out / "report.md").read_text()
    assert markdown_table(summaries) in report and "latency_vs_qps.png" in report
    pngs = [p for p in paths if p.suffix == ".png"]
    assert {p.name for p in pngs} == {"latency_vs_qps.png", "ttft_pareto.png"}
    for png in pngs:
        assert png.read_bytes().startswith(PNG_SIGNATURE) and png.stat().st_size > 5000
    record_files = sorted(p for p in paths if p.name == "records.jsonl.gz")
    assert len(record_files) == len(runs) and all(":" not in p.parent.name for p in record_files)
    rows = read_records(record_files[0])
    assert read_records(record_files[0].parent) == rows
    assert len(rows) == 10 and rows[0]["conversation"] == "c0" and "itl" in rows[0]


def test_plots_without_a_load_in_the_labels_still_write_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    plot_latency_vs_qps([summarize([], 0.0, label={"server": "x"})], tmp_path / "empty.png")
    assert (tmp_path / "empty.png").read_bytes().startswith(PNG_SIGNATURE)
    closed_loop = [
        summarize([rec(turn=1)], 1.0, label={"server": "x", "qps": None, "concurrency": c})
        for c in (1, 2)
    ]
    paths = write_report(closed_loop, tmp_path / "closed")
    assert all(p.exists() for p in paths)


def test_host_costs_come_from_the_servers_counters_over_the_run() -> None:
    before = dict(zip(HOST_COUNTERS, (100, 2.0, 0.1, 5.0, 1_000)))
    after = dict(
        zip(HOST_COUNTERS, (300, 6.0, 0.3, 5.5, 11_000))
    )  # 200 steps, 4 s in them, 0.2 s around them
    costs = host_costs(before, after)
    assert costs == pytest.approx(
        {
            "engine_step_ms": 20.0,
            "worker_loop_ms_per_step": 1.0,
            "worker_loop_share": 0.2 / 4.2,
            "api_cpu_us_per_token": 50.0,
        }
    )
    assert (
        host_costs({}, after) == {}
        and host_costs(before, {"vllm:generation_tokens_total": 1}) == {}
    )  # a peer
    fresh = {
        "ppd:api_server_cpu_seconds_total": 5.0,
        "vllm:generation_tokens_total": 1_000,
    }  # no step yet
    assert host_costs(fresh, after)["engine_step_ms"] == pytest.approx(20.0)  # 300 steps in 6 s
    assert host_costs(before, before) == {}  # no step ran
    table = host_cost_table(
        [{"label": {"server": "ppd:aggregated"}, **costs}, {"label": {"server": "vllm"}}]
    )
    assert "ppd:aggregated | 20.00 | 1.000 | 4.8% | 50 |" in table and "vllm" not in table
    assert host_cost_table([{"label": {"server": "vllm"}}]) == ""


def test_turn2plus_ttft_by_context_bucket() -> None:
    # Turn 1 (not counted), then turns 2+ at 500, 2,000 and 100,000 prompt tokens; a failed one
    # (not counted).
    records = [rec(turn=0, prompt_tokens=500, ttft=9.0)]
    records += [rec(f"s{i}", 1, prompt_tokens=500, ttft=(10 + i) / 1000) for i in range(101)]
    records += [rec(f"m{i}", 2, prompt_tokens=2000, ttft=0.2) for i in range(3)]
    records += [rec("big", 5, prompt_tokens=100_000, ttft=3.0)]
    records += [rec("x", 1, prompt_tokens=2000, ttft=50.0, error="timeout")]
    s = summarize(records, 10.0)
    assert s["turn2plus_requests_by_context"] == {"<1K": 101, "1-4K": 3, "64K+": 1}
    assert (s["ttft_turn2plus_ctx_lt1k_ms_p50"], s["ttft_turn2plus_ctx_lt1k_ms_p99"]) == (
        pytest.approx(60),
        pytest.approx(109),
    )
    assert s["ttft_turn2plus_ctx_1k_4k_ms_p99"] == pytest.approx(200)
    assert s["ttft_turn2plus_ctx_64k_plus_ms_p50"] == pytest.approx(3000)
    assert (
        s["ttft_turn2plus_ctx_4k_16k_ms_p50"] is None
        and s["ttft_turn2plus_ctx_16k_64k_ms_p99"] is None
    )
    # Buckets are counts over repeats, percentiles medians.
    both = median_of_runs([s, summarize(records[:5], 10.0)])
    assert both["turn2plus_requests_by_context"] == {"<1K": 105, "1-4K": 3, "64K+": 1}
    cell = "<1K 60.0 / 109.0; 1-4K 200.0 / 200.0; 64K+ 3000.0 / 3000.0"
    assert cell in markdown_table([s])


def test_prefix_hits_and_recomputed_tokens_of_later_turns() -> None:
    """Turn 2+: the hit share is cached over prompt tokens; the recomputed share is, of what an
    earlier turn computed (its prompt and answer), the part not cached this time."""
    records = [
        rec("a", 0, prompt_tokens=1000, output_tokens=10, cached_tokens=0),
        # Its history (1,010) all cached: nothing recomputed.
        rec("a", 1, prompt_tokens=1100, cached_tokens=1010, history_tokens=1010),
        # 600 of its 1,210 tokens of history lost (evicted, or another worker): recomputed.
        rec("a", 2, prompt_tokens=1300, cached_tokens=610, history_tokens=1210),
        # Cached beyond its history (the same conversation sent before): nothing recomputed.
        rec("b", 1, prompt_tokens=500, cached_tokens=480, history_tokens=400),
        rec("c", 1, prompt_tokens=500, cached_tokens=None, history_tokens=400),  # not reported
        rec("d", 1, prompt_tokens=500, cached_tokens=0, history_tokens=400, error="boom"),
    ]
    s = summarize(records, 1.0)
    assert s["prefix_cache_hit_fraction_turn2plus"] == pytest.approx(2100 / 2900)
    assert s["recomputed_fraction_turn2plus"] == pytest.approx(600 / (1010 + 1210 + 400))
    header = markdown_table([s]).splitlines()[0]
    assert "prefix cache hit turn 2+" in header and "recomputed turn 2+" in header
    assert "| 72% | 23% |" in markdown_table([s])
    first_turns = summarize([records[0]], 1.0)
    assert first_turns["recomputed_fraction_turn2plus"] is None
    assert "recomputed turn 2+" not in markdown_table([first_turns]), "no figure, no column"


def test_kv_tier_counts_come_from_the_servers_counters_over_the_run() -> None:
    names = list(KV_TIER_COUNTERS.values())
    before = {
        names[0]: 1000.0,
        names[1]: 10.0,
    }  # loaded tokens, stored blocks; the others: none yet
    after = {names[0]: 5096.0, names[1]: 30.0, names[2]: 8.0, names[3]: 2.0}
    assert kv_tier(before, after) == {
        "kv_tier_loaded_tokens": 4096.0,
        "kv_tier_stored_blocks": 20.0,
        "kv_tier_loaded_blocks": 8.0,
        "kv_tier_dropped_blocks": 2.0,
    }
    absent = kv_tier({"vllm:generation_tokens_total": 1.0}, {"vllm:generation_tokens_total": 9.0})
    assert set(absent.values()) == {None}
    with_tier = {**summarize([rec()], 1.0), **kv_tier(before, after)}
    without = {**summarize([rec()], 1.0), **absent}
    table = markdown_table([with_tier, without]).splitlines()
    assert "KV tier loaded tokens" in table[0]
    assert table[2].endswith("| 4096 |") and table[3].endswith("| - |")
    assert "KV tier" not in markdown_table([without])
