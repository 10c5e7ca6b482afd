"""Summaries of `ppd bench` runs: one JSON-ready dict per run, a markdown table, plots.

Times in a summary are milliseconds (keys say `_ms`); throughputs are per second of the run's wall
duration. Latency statistics cover successful requests only; failed ones count in success_rate.
matplotlib is imported inside the plot functions: the CLI imports this module.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import math
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from bench.client import RequestRecord

log = logging.getLogger("ppd.bench")

GOODPUT_KEYS = ("ttft", "tpot", "e2e")
DEFAULT_WEIGHTS = (1.0, 10.0)  # (w_ttft, w_tpot): the ppd policy's defaults
X_KEYS = (
    "qps",
    "concurrency",
)  # label keys that are the load of a run, not the series it belongs to
# Turn-2+ TTFT by the request's prompt tokens (K = 1024), since a long context's TTFT is a figure of
# its own: (key, label, least, below).
CONTEXT_BUCKETS = (
    ("lt1k", "<1K", 0, 1024),
    ("1k_4k", "1-4K", 1024, 4096),
    ("4k_16k", "4-16K", 4096, 16384),
    ("16k_64k", "16-64K", 16384, 65536),
    ("64k_plus", "64K+", 65536, math.inf),
)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (linear interpolation, numpy's default); None for no values."""
    return float(np.percentile(values, q)) if len(values) else None


def _ms(values: Sequence[float], name: str, qs: Sequence[int]) -> dict[str, float | None]:
    return {
        f"{name}_ms_p{q}": None if (p := percentile(values, q)) is None else p * 1000 for q in qs
    }


def _meets(record: RequestRecord, slos: dict[str, float]) -> bool:
    """Whether a request met every SLO (seconds); one with under 2 output tokens has no TPOT to
    miss."""
    if not record.success:
        return False
    checks = {
        "ttft": record.ttft,
        "tpot": 0.0 if record.tpot is None else record.tpot,
        "e2e": record.latency,
    }
    return all(checks[k] is not None and checks[k] <= slo for k, slo in slos.items())


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    goodput: dict[str, float] | None = None,
    label: dict | None = None,
    weights: tuple[float, float] = DEFAULT_WEIGHTS,
) -> dict[str, Any]:
    """One run's statistics as a JSON-serializable dict; goodput holds SLOs in seconds (see
    parse_goodput); weights (w_ttft, w_tpot) make the turn-2+ objective w_ttft * TTFT p50 + w_tpot *
    TPOT p50 (ms), the ppd policy's."""
    ok = [r for r in records if r.success]
    later = [r for r in ok if r.turn >= 1]
    n = len(records)

    def per_s(amount: float) -> float | None:
        return amount / duration_s if duration_s > 0 else None

    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "label": dict(label or {}),
        "duration_s": duration_s,
        "requests": n,
        "succeeded": len(ok),
        "failed": n - len(ok),
        "success_rate": len(ok) / n if n else None,
        "conversations": len({r.conversation for r in records}),
        **_ms(
            [r.ttft for r in ok if r.turn == 0 and r.ttft is not None], "ttft_turn1", (50, 90, 99)
        ),
        **_ms([r.ttft for r in later if r.ttft is not None], "ttft_turn2plus", (50, 90, 99)),
        **_by_context(later),
        **_ms([r.tpot for r in ok if r.tpot is not None], "tpot", (50, 99)),
        **_ms(
            [r.tpot for r in ok if r.turn >= 1 and r.tpot is not None], "tpot_turn2plus", (50, 99)
        ),
        **_ms([gap for r in ok for gap in r.itl], "itl", (99,)),
        **_ms([r.latency for r in ok if r.latency is not None], "e2e", (50, 99)),
        "output_tokens_per_s": per_s(output),
        "total_tokens_per_s": per_s(prompt + output),
        "requests_per_s": per_s(len(ok)),
        "goodput_slo_ms": {k: v * 1000 for k, v in (goodput or {}).items()},
        "goodput_requests_per_s": None,
        "goodput_fraction": None,
        "prefix_cache_hit_fraction": _hit_fraction(ok),
        "prefix_cache_hit_fraction_turn2plus": _hit_fraction(later),
        "recomputed_fraction_turn2plus": _recomputed_fraction(later),
        "routes": dict(Counter(r.route for r in records if r.route is not None)),
        # Requests the server refused (429 or 503 with Retry-After) and that were sent again: it
        # saturated.
        "refused_then_retried": sum(1 for r in records if r.retries),
        "errors": dict(
            Counter((r.error or "")[:200] for r in records if not r.success).most_common(5)
        ),
    }
    ttft2, tpot2 = summary["ttft_turn2plus_ms_p50"], summary["tpot_turn2plus_ms_p50"]
    summary["objective_w_ttft"], summary["objective_w_tpot"] = float(weights[0]), float(weights[1])
    summary["objective_turn2plus"] = (
        None if ttft2 is None or tpot2 is None else weights[0] * ttft2 + weights[1] * tpot2
    )
    if goodput:
        met = sum(_meets(r, goodput) for r in records)
        summary["goodput_requests_per_s"] = per_s(met)
        summary["goodput_fraction"] = met / n if n else None
    return summary


def _hit_fraction(records: Sequence[RequestRecord]) -> float | None:
    """Cached over prompt tokens, over the requests whose server reported cached tokens."""
    reporting = [r for r in records if r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens for r in reporting)
    return sum(r.cached_tokens for r in reporting) / prompt if prompt else None


def _by_context(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """TTFT p50 and p99 of each CONTEXT_BUCKETS bucket of prompt tokens (None where it has no
    request), and the requests in each bucket that has some."""
    out: dict[str, Any] = {}
    counts: dict[str, int] = {}
    for key, label, least, below in CONTEXT_BUCKETS:
        ttfts = [r.ttft for r in records if least <= r.prompt_tokens < below and r.ttft is not None]
        out.update(_ms(ttfts, f"ttft_turn2plus_ctx_{key}", (50, 99)))
        if ttfts:
            counts[label] = len(ttfts)
    out["turn2plus_requests_by_context"] = counts
    return out


def _recomputed_fraction(records: Sequence[RequestRecord]) -> float | None:
    """Of the tokens that earlier turns of the same conversation computed (history_tokens), the
    share computed again (not reported cached), over the requests whose server reported cached
    tokens."""
    both = [r for r in records if r.history_tokens and r.cached_tokens is not None]
    history = sum(r.history_tokens for r in both)
    again = sum(max(0, r.history_tokens - r.cached_tokens) for r in both)
    return again / history if history else None


def median_of_runs(runs: Sequence[dict]) -> dict:
    """One summary for repeated runs of the same point: each rate, latency and fraction is the
    median over the runs that have it, counts (requests, routes, errors) are summed, and the runs
    themselves are kept under "runs"."""
    first = runs[0]
    combined: dict[str, Any] = {"label": first["label"], "repeats": len(runs)}
    for key, value in first.items():
        if key in ("label", "goodput_slo_ms"):
            combined[key] = value
        elif isinstance(value, dict):
            total: Counter = Counter()
            for run in runs:
                total.update(run.get(key) or {})
            combined[key] = dict(total)
        elif isinstance(value, int) and not isinstance(value, bool):
            combined[key] = sum(run.get(key) or 0 for run in runs)  # counts add up over the runs
        elif isinstance(value, float) or value is None:
            values = [run[key] for run in runs if isinstance(run.get(key), (int, float))]
            combined[key] = float(np.median(values)) if values else None
    if any(run.get("interrupted") for run in runs):
        combined["interrupted"] = True
    combined["runs"] = list(runs)
    return combined


def parse_weights(text: str) -> tuple[float, float]:
    """'1,10' -> (w_ttft, w_tpot)."""
    try:
        w_ttft, w_tpot = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"bad --objective {text!r}: expected W_TTFT,W_TPOT, e.g. 1,10") from None
    if w_ttft < 0 or w_tpot < 0:
        raise ValueError(f"bad --objective {text!r}: weights must not be negative")
    return w_ttft, w_tpot


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] (milliseconds) -> {'ttft': 0.5, 'tpot': 0.05} (seconds)."""
    slos: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = float("nan")
        if not sep or key not in GOODPUT_KEYS or not 0 < ms < float("inf"):
            raise ValueError(
                f"bad goodput SLO {item!r}: expected KEY:MS with KEY one of "
                f"{', '.join(GOODPUT_KEYS)} "
                f"and MS a positive number of milliseconds, e.g. ttft:500 tpot:50"
            )
        if key in slos:
            raise ValueError(f"goodput SLO {key!r} given twice")
        slos[key] = ms / 1000
    return slos


# --- table --------------------------------------------------------------------------------------


def _num(value: float | None, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def _pair(s: dict, name: str, lo: str = "p50", hi: str = "p99") -> str:
    return f"{_num(s.get(f'{name}_ms_{lo}'))} / {_num(s.get(f'{name}_ms_{hi}'))}"


def _label_keys(summaries: Sequence[dict]) -> list[str]:
    """Label keys in first-seen order, leaving out those that are None in every run."""
    keys: dict[str, None] = {}
    for s in summaries:
        keys.update({k: None for k, v in s.get("label", {}).items() if v is not None})
    return list(keys)


METRIC_COLUMNS = [
    ("ok / requests", lambda s: f"{s['succeeded']} / {s['requests']}"),
    ("TTFT turn 1 p50 / p99 (ms)", lambda s: _pair(s, "ttft_turn1")),
    ("TTFT turn 2+ p50 / p99 (ms)", lambda s: _pair(s, "ttft_turn2plus")),
    ("TPOT p50 / p99 (ms)", lambda s: _pair(s, "tpot")),
    ("TPOT turn 2+ p50 (ms)", lambda s: _num(s.get("tpot_turn2plus_ms_p50"), ".2f")),
    ("objective turn 2+", lambda s: _num(s.get("objective_turn2plus"))),
    ("ITL p99 (ms)", lambda s: _num(s.get("itl_ms_p99"))),
    ("E2E p50 / p99 (ms)", lambda s: _pair(s, "e2e")),
    ("output tok/s", lambda s: _num(s.get("output_tokens_per_s"))),
    ("req/s", lambda s: _num(s.get("requests_per_s"), ".2f")),
    (
        "goodput req/s (share)",
        lambda s: (
            "-"
            if s.get("goodput_fraction") is None
            else f"{s['goodput_requests_per_s']:.2f} ({s['goodput_fraction']:.0%})"
        ),
    ),
    (
        "prefix cache hit",
        lambda s: (
            "-"
            if s.get("prefix_cache_hit_fraction") is None
            else f"{s['prefix_cache_hit_fraction']:.0%}"
        ),
    ),
    (
        "routes",
        lambda s: ", ".join(f"{k} {v}" for k, v in sorted(s.get("routes", {}).items())) or "-",
    ),
]


# The ppd server's own counters a run's host costs come from (their change over the run).
HOST_COUNTERS = (
    "ppd:worker_steps_total",
    "ppd:worker_step_seconds_total",
    "ppd:worker_loop_seconds_total",
    "ppd:api_server_cpu_seconds_total",
    "vllm:generation_tokens_total",
)


def host_costs(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """What a run cost the ppd server's host, from its counters before and after the run (Prometheus
    samples summed over labels): per decode-worker step, the engine's step and the worker's loop
    around it (messages, scheduling, outputs: host time CUDA graphs do not hide), and the API
    servers' CPU per generated token. Empty for a server without those counters (another server, or
    an older ppd). A worker's counters appear with its first stats, so one missing before the run
    counts from zero."""
    if "ppd:api_server_cpu_seconds_total" not in before or not all(
        k in after for k in HOST_COUNTERS
    ):
        return {}
    steps, step_s, loop_s, api_s, tokens = (after[k] - before.get(k, 0.0) for k in HOST_COUNTERS)
    if steps <= 0:
        return {}
    return {
        "engine_step_ms": 1000 * step_s / steps,
        "worker_loop_ms_per_step": 1000 * loop_s / steps,
        "worker_loop_share": loop_s / (loop_s + step_s) if loop_s + step_s > 0 else None,
        "api_cpu_us_per_token": 1e6 * api_s / tokens if tokens > 0 else None,
    }


# The server's second KV tier, from ppd's counters over a run: summary key -> counter.
KV_TIER_COUNTERS = {
    "kv_tier_loaded_tokens": "ppd:kv_tier_loaded_tokens_total",
    "kv_tier_stored_blocks": "ppd:kv_tier_stored_blocks_total",
    "kv_tier_loaded_blocks": "ppd:kv_tier_loaded_blocks_total",
    "kv_tier_dropped_blocks": "ppd:kv_tier_dropped_blocks_total",
}


def kv_tier(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """What the server's second KV tier did over a run (tokens loaded back from it; blocks stored,
    loaded, dropped), from its counters before and after the run; None where the server has no such
    counter. One that appears during the run counts from zero."""
    return {
        key: after[name] - before.get(name, 0.0) if name in after else None
        for key, name in KV_TIER_COUNTERS.items()
    }


def host_cost_table(summaries: Sequence[dict]) -> str:
    """One row per summary with host costs (host_costs); "" when none has them."""
    rows = [s for s in summaries if s.get("worker_loop_ms_per_step") is not None]
    if not rows:
        return ""
    keys = _label_keys(rows)
    header = [
        *keys,
        "engine step ms",
        "worker loop ms / step",
        "loop share of the worker's time",
        "API server CPU µs / token",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += [
        "| "
        + " | ".join(
            [_cell(s["label"].get(k)) for k in keys]
            + [
                _num(s.get("engine_step_ms"), ".2f"),
                _num(s.get("worker_loop_ms_per_step"), ".3f"),
                _num(s.get("worker_loop_share"), ".1%"),
                _num(s.get("api_cpu_us_per_token"), ".0f"),
            ]
        )
        + " |"
        for s in rows
    ]
    return "\n".join(lines)


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _by_context_cell(s: dict) -> str:
    counts = s.get("turn2plus_requests_by_context") or {}
    cells = [
        f"{label} {_pair(s, f'ttft_turn2plus_ctx_{key}')}"
        for key, label, *_ in CONTEXT_BUCKETS
        if label in counts
    ]
    return "; ".join(cells) or "-"


# Columns shown only where some run has the figure: (name, summary key, cell).
OPTIONAL_COLUMNS = [
    (
        "TTFT turn 2+ p50 / p99 by prompt tokens (ms)",
        "turn2plus_requests_by_context",
        _by_context_cell,
    ),
    (
        "prefix cache hit turn 2+",
        "prefix_cache_hit_fraction_turn2plus",
        lambda s: _share(s.get("prefix_cache_hit_fraction_turn2plus")),
    ),
    (
        "recomputed turn 2+",
        "recomputed_fraction_turn2plus",
        lambda s: _share(s.get("recomputed_fraction_turn2plus")),
    ),
    (
        "KV tier loaded tokens",
        "kv_tier_loaded_tokens",
        lambda s: _num(s.get("kv_tier_loaded_tokens"), ".0f"),
    ),
]


def markdown_table(summaries: Sequence[dict]) -> str:
    """One row per run: its label columns, then the key metrics, then the optional ones that some
    run has."""
    keys = _label_keys(summaries)
    columns = METRIC_COLUMNS + [
        (name, cell)
        for name, key, cell in OPTIONAL_COLUMNS
        if any(s.get(key) not in (None, {}) for s in summaries)
    ]
    header = keys + [name for name, _ in columns]
    rows = [
        [_cell(s.get("label", {}).get(k)) for k in keys] + [cell(s) for _, cell in columns]
        for s in summaries
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# Figures a peer comparison divides (ours over the peer's at the same load): below 1 is ours faster
# for the latencies, above 1 ours faster for the throughputs.
RATIO_COLUMNS = [
    ("TTFT turn 1 p50", "ttft_turn1_ms_p50"),
    ("TTFT turn 2+ p50", "ttft_turn2plus_ms_p50"),
    ("TTFT turn 2+ p99", "ttft_turn2plus_ms_p99"),
    ("TPOT p50", "tpot_ms_p50"),
    ("TPOT p99", "tpot_ms_p99"),
    ("E2E p50", "e2e_ms_p50"),
    ("objective turn 2+", "objective_turn2plus"),
    ("output tok/s", "output_tokens_per_s"),
    ("req/s", "requests_per_s"),
]


def add_ratios(summaries: Sequence[dict], peer: str) -> None:
    """Give each summary of another server a "ratio_to": the peer's name and, per RATIO_COLUMNS key,
    its figure over the peer's at the same load (None where either has none)."""

    def load(s: dict) -> tuple:
        return tuple(s["label"].get(k) for k in X_KEYS)

    theirs = {load(s): s for s in summaries if s["label"].get("server") == peer}
    for s in summaries:
        if (base := theirs.get(load(s))) is not None and base is not s:
            s["ratio_to"] = {
                "server": peer,
                **{
                    key: s[key] / base[key] if s.get(key) is not None and base.get(key) else None
                    for _, key in RATIO_COLUMNS
                },
            }


def ratio_table(summaries: Sequence[dict]) -> str:
    """One row per summary that add_ratios gave a ratio: its label, then each RATIO_COLUMNS figure
    over the peer's; "" when none has one."""
    rows = [s for s in summaries if "ratio_to" in s]
    if not rows:
        return ""
    keys = _label_keys(rows)
    header = [*keys, "over"] + [f"{name} ratio" for name, _ in RATIO_COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += [
        "| "
        + " | ".join(
            [_cell(s["label"].get(k)) for k in keys]
            + [_cell(s["ratio_to"]["server"])]
            + [_num(s["ratio_to"][key], ".2f") for _, key in RATIO_COLUMNS]
        )
        + " |"
        for s in rows
    ]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    return "-" if value is None else str(value).replace("|", "\\|")


# --- files --------------------------------------------------------------------------------------

RECORDS = (
    "records.jsonl.gz"  # a run's request records, one JSON object a line, compressed (about 0.1x)
)


def read_records(path: str | Path) -> list[dict]:
    """The records of a run: its folder, its records.jsonl.gz, or a plain .jsonl (an older run's, or
    one made by hand)."""
    path = Path(path)
    if path.is_dir():
        path = path / RECORDS if (path / RECORDS).exists() else path / "records.jsonl"
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]


def write_report(
    summaries: Sequence[dict], out_dir: Path, records_by_run: dict[str, list] | None = None
) -> list[Path]:
    """Write summary.json, report.md, the plots (with matplotlib) and RUN/records.jsonl.gz; return
    the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "summary.json"]
    written[0].write_text(json.dumps(list(summaries), indent=2, default=str) + "\n")
    plots = []
    # A plot draws each server's figures over the loads: with one load a server, a table says it.
    servers = Counter(str(s.get("label", {}).get("server")) for s in summaries)
    swept = max(servers.values(), default=0) > 1
    try:
        for name, plot in (
            ("latency_vs_qps.png", plot_latency_vs_qps),
            ("ttft_pareto.png", plot_ttft_pareto),
        ):
            if swept:
                plot(summaries, out_dir / name)
                plots.append(out_dir / name)
    except ImportError:
        log.warning("no plots: matplotlib is not installed (pip install matplotlib)")
    report = out_dir / "report.md"
    ratios = ratio_table(summaries)
    report.write_text(
        "# ppd bench\n\n"
        + markdown_table(summaries)
        + "\n\n"
        + (
            f"Ours over the peer's, at the same load (latency below 1, throughput above 1: ours "
            f"faster):\n\n{ratios}\n\n"
            if ratios
            else ""
        )
        + (
            f"Host costs of the ppd servers (their counters over each run; medians over the runs):"
            f"\n\n{hosts}\n\n"
            if (hosts := host_cost_table(summaries))
            else ""
        )
        + "".join(f"![{p.stem}]({p.name})\n\n" for p in plots)
        + "TTFT turn 2+: every turn after the first. TPOT: (latency - TTFT) / (output tokens - 1). "
        "Objective turn 2+: w_ttft * TTFT p50 + w_tpot * TPOT p50 of turns 2+ (ms; the weights are "
        "in summary.json). Goodput: requests meeting every SLO in goodput_slo_ms, per second and "
        "as a share of all. Recomputed turn 2+: of the tokens an earlier turn of the same "
        "conversation computed (its prompt and answer), the share not reported cached. KV tier "
        "loaded tokens: the server's ppd:kv_tier_loaded_tokens_total over the run.\n"
    )
    written += [report, *plots]
    used: set[str] = set()
    for run, records in (records_by_run or {}).items():
        folder = re.sub(r"[^\w.=-]+", "_", run) or "run"
        while folder in used:
            folder += "_"
        used.add(folder)
        path = out_dir / folder / RECORDS
        path.parent.mkdir(exist_ok=True)
        # mtime=0: the same records give the same bytes (a rerun leaves git nothing to store).
        path.write_bytes(
            gzip.compress(
                "".join(
                    json.dumps(dataclasses.asdict(r), default=str) + "\n" for r in records
                ).encode(),
                mtime=0,
            )
        )
        written.append(path)
    return written


# --- plots --------------------------------------------------------------------------------------


def _series(summaries: Sequence[dict]) -> tuple[str, dict[str, list[tuple[float, dict]]]]:
    """(the x key, {series name: [(x, summary)] sorted by x}): a series is a label minus the load
    keys."""
    x_key = next(
        (k for k in X_KEYS if any(s.get("label", {}).get(k) is not None for s in summaries)),
        X_KEYS[0],
    )
    series: dict[str, list[tuple[float, dict]]] = {}
    for s in summaries:
        label = s.get("label", {})
        if label.get(x_key) is None:
            continue
        name = (
            " / ".join(str(v) for k, v in label.items() if k not in X_KEYS and v is not None)
            or "run"
        )
        series.setdefault(name, []).append((float(label[x_key]), s))
    return x_key, {name: sorted(points, key=lambda p: p[0]) for name, points in series.items()}


X_AXIS = {
    "qps": "offered load (conversations/s)",
    "concurrency": "concurrency (conversations in flight)",
}


def plot_latency_vs_qps(summaries: Sequence[dict], path: Path) -> None:
    """Turn-2+ TTFT p50 and p99 and TPOT p50 against the offered load, one line per
    policy/server."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    x_key, series = _series(summaries)
    fig = Figure(figsize=(15, 4.5), layout="constrained")
    panels = [
        ("ttft_turn2plus_ms_p50", "TTFT turn 2+ p50 (ms)"),
        ("ttft_turn2plus_ms_p99", "TTFT turn 2+ p99 (ms)"),
        ("tpot_ms_p50", "TPOT p50 (ms)"),
    ]
    for ax, (key, title) in zip(fig.subplots(1, len(panels)), panels):
        for name, points in series.items():
            xy = [(x, s[key]) for x, s in points if s.get(key) is not None]
            ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", label=name)
        ax.set(title=title, xlabel=X_AXIS[x_key], ylabel="ms")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    _legend_or_note(fig, series)
    fig.savefig(path, dpi=110)


def plot_ttft_pareto(summaries: Sequence[dict], path: Path) -> None:
    """Turn-2+ TTFT p50 against output throughput, one line per policy/server, points labelled by
    load."""
    from matplotlib.figure import Figure

    x_key, series = _series(summaries)
    fig = Figure(figsize=(7, 5), layout="constrained")
    ax = fig.subplots()
    unit = " qps" if x_key == "qps" else " conc."
    for name, points in series.items():
        xy = [
            (s["output_tokens_per_s"], s["ttft_turn2plus_ms_p50"], load)
            for load, s in points
            if s.get("output_tokens_per_s") is not None
            and s.get("ttft_turn2plus_ms_p50") is not None
        ]
        ax.plot([x for x, _, _ in xy], [y for _, y, _ in xy], marker="o", label=name)
        for x, y, load in xy:
            ax.annotate(
                f"{load:g}{unit}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8
            )
    ax.set(
        title="TTFT turn 2+ vs throughput (lower right is better)",
        xlabel="output throughput (tokens/s)",
        ylabel="TTFT turn 2+ p50 (ms)",
    )
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    _legend_or_note(fig, series)
    fig.savefig(path, dpi=110)


def _legend_or_note(fig: Any, series: dict) -> None:
    if series:
        fig.axes[0].legend(fontsize=8)
    else:
        fig.text(
            0.5,
            0.5,
            "no run has a load (qps or concurrency) in its label",
            ha="center",
            va="center",
        )
