"""The report of a partition profile (`ppd profile partition` writes it beside the profile): a
markdown summary (decode steps, prefill speed, the GEMM with cuBLAS's SM carveout, interference,
the smallest decode share meeting an ITL SLO) and a plot of the same."""

from __future__ import annotations

from pathlib import Path

from partition.profile import PartitionProfile
from partition.profiler import KINDS

SLO_LADDER_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


def example_slos(result: PartitionProfile) -> list[float]:
    """Up to four round SLOs (ms) inside the range of measured decode steps: where the choice of
    share matters."""
    steps = [p.step_ms for p in result.decode]
    inside = [s for s in SLO_LADDER_MS if min(steps) <= s <= max(steps)] or [SLO_LADDER_MS[0]]
    return (
        [inside[round(i * (len(inside) - 1) / 3)] for i in range(4)] if len(inside) > 4 else inside
    )


def markdown(result: PartitionProfile) -> str:
    """The profile's tables, as the .md beside it."""
    unit, grid = result.unit, result.meta.get("grid", {})
    batches, contexts = (
        sorted({p.batch for p in result.decode}),
        sorted({p.context for p in result.decode}),
    )
    steps = {
        (p.share, p.batch, p.context): f"{p.step_ms:.2f} / {p.step_p90_ms:.2f}"
        for p in result.decode
    }
    prompts, rates = (
        sorted({p.prompt for p in result.prefill}),
        {(p.share, p.prompt): p for p in result.prefill},
    )
    slos = example_slos(result)
    return (
        "\n".join(
            [
                f"# Partition profile: {result.model} on {result.device}",
                "",
                (
                    f"Made by `{result.meta.get('command', 'ppd profile partition')}` on "
                    f"{result.meta.get('created', '?')} "
                    f"({result.meta.get('measured_s', 0):.0f} s measuring). A share is a number of "
                    f"{unit} of {result.total}."
                ),
                "",
                (
                    f"## Decode step (ms, median / p90), alone, by share ({unit}) x batch x context"
                    + (
                        ", replaying CUDA graphs captured on each share"
                        if result.meta.get("decode_graphs")
                        else ""
                    )
                ),
                "",
                *_table(
                    ["share", "batch", *(f"ctx {c}" for c in contexts)],
                    [
                        [str(s), str(b), *(steps[s, b, c] for c in contexts)]
                        for s in result.shares
                        for b in batches
                    ],
                ),
                "",
                "## Prefill tokens/s, alone, by share x prompt (prompts batched to "
                f"~{grid.get('prefill_tokens', '?')} tokens)",
                "",
                *_table(
                    ["share", *(f"prompt {p}" for p in prompts)],
                    [
                        [str(s), *(f"{rates[s, p].tokens_per_s:,.0f}" for p in prompts)]
                        for s in result.shares
                    ],
                ),
                *gemm_markdown(result),
                *interference_markdown(result),
                "",
                "## Smallest decode share meeting an ITL SLO (min_decode_share; -: none does)",
                "",
                *_table(
                    ["batch", "context", *(f"{slo:g} ms" for slo in slos)],
                    [
                        [
                            str(b),
                            str(c),
                            *(str(result.min_decode_share(b, c, slo) or "-") for slo in slos),
                        ]
                        for b in batches
                        for c in contexts
                    ],
                ),
            ]
        )
        + "\n"
    )


def gemm_markdown(result: PartitionProfile) -> list[str]:
    """The GEMM on each share with and without cuBLAS's SM carveout (none where the profile did not
    time it)."""
    rows = result.meta.get("gemm_carveout")
    if not rows:
        return []
    title = (
        f"## A prefill GEMM ({rows[0]['tokens']} tokens, the MLP's up projection) on each share, "
        "alone and with "
        "cuBLAS's SM carveout set to the SMs outside the share "
        "(torch._C._set_sm_carveout_experimental; serving "
        "sets it only where this shows that it helps)"
    )
    body = [
        [
            str(r["share"]),
            str(r["carveout"]),
            f"{r['ms']:.2f}",
            *(
                (f"{r['carveout_ms']:.2f}", f"{r['carveout_ms'] / r['ms']:.2f}")
                if r["carveout"]
                else ("-", "-")
            ),
        ]
        for r in rows
    ]
    return [
        "",
        title,
        "",
        *_table(["share", "carveout", "ms", "ms with the carveout", "ratio"], body),
    ]


def interference_markdown(result: PartitionProfile) -> list[str]:
    """Decode's TPOT beside prefills over its TPOT alone (none where no prefill ran beside it)."""
    busy = [p for p in result.interference if p.concurrent > 0]
    if not busy:
        return []
    cols = sorted({(p.kind, p.concurrent) for p in busy}, key=lambda k: (KINDS.index(k[0]), k[1]))
    rows: dict[tuple, dict] = {}
    for p in busy:
        rows.setdefault((p.decode_share, p.prefill_share, p.batch, p.context), {})[
            (p.kind, p.concurrent)
        ] = p
    body = []
    for (d, ps, b, c), row in rows.items():
        alone = next(iter(row.values())).tpot_alone_ms
        body.append(
            [
                f"{d} / {ps}",
                str(b),
                str(c),
                f"{alone:.2f}",
                *(f"{row[k].tpot_ms / alone:.2f}" if k in row else "" for k in cols),
            ]
        )
    title = (
        f"## Decode TPOT beside prefills, as a ratio of TPOT alone ({busy[0].new_tokens} tokens a "
        "full prefill or "
        "an append; d / p: decode on d and prefill on p of the shares; when both are the whole "
        "device, the two "
        "are time-sliced)"
    )
    header = [
        "decode / prefill share",
        "batch",
        "context",
        "alone (ms)",
        *(f"{k} x{n}" for k, n in cols),
    ]
    return ["", title, "", *_table(header, body)]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + " ---: |" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def plot(result: PartitionProfile, path: Path) -> None:
    """Decode step vs batch per share (a line per context), prefill tokens/s vs prompt per share,
    and the interference ratios, full vs append."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_d, ax_p, ax_i) = plt.subplots(1, 3, figsize=(15, 4.2))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    contexts = sorted({p.context for p in result.decode})
    for i, share in enumerate(result.shares):
        for j, c in enumerate(contexts):
            pts = sorted(
                (p.batch, p.step_ms) for p in result.decode if p.share == share and p.context == c
            )
            ax_d.plot(
                *zip(*pts),
                marker="o",
                color=colours[i % len(colours)],
                linestyle=("-", "--", ":", "-.")[j % 4],
                label=f"{share} {result.unit}, ctx {c}",
            )
        pts = sorted((p.prompt, p.tokens_per_s) for p in result.prefill if p.share == share)
        if pts:
            ax_p.plot(
                *zip(*pts),
                marker="o",
                color=colours[i % len(colours)],
                label=f"{share} {result.unit}",
            )
    ax_d.set(
        xlabel="decode batch",
        ylabel="step (ms, median)",
        title="decode alone",
        xscale="log",
        yscale="log",
    )
    ax_p.set(xlabel="prompt tokens", ylabel="tokens/s", title="prefill alone", xscale="log")
    for ax, ticks in (
        (ax_d, {p.batch for p in result.decode}),
        (ax_p, {p.prompt for p in result.prefill}),
    ):
        ax.set_xticks(sorted(ticks), [str(t) for t in sorted(ticks)], minor=False)
        ax.minorticks_off()
    ax_d.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax_d.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax_d.legend(fontsize=6)
    ax_p.legend(fontsize=7)
    busy = [p for p in result.interference if p.concurrent > 0]
    groups = sorted({(p.decode_share, p.prefill_share, p.batch, p.context) for p in busy})
    series = sorted({(p.kind, p.concurrent) for p in busy}, key=lambda k: (KINDS.index(k[0]), k[1]))
    width = 0.8 / max(1, len(series))
    for k, (kind, n) in enumerate(series):
        ratios = {
            (p.decode_share, p.prefill_share, p.batch, p.context): p.tpot_ms / p.tpot_alone_ms
            for p in busy
            if (p.kind, p.concurrent) == (kind, n)
        }
        ax_i.bar(
            [g + k * width for g in range(len(groups))],
            [ratios.get(g, 0) for g in groups],
            width,
            color=colours[KINDS.index(kind)],
            alpha=0.5 + 0.5 * n / max(p.concurrent for p in busy),
            hatch="" if kind == "full" else "//",
            label=f"{kind} x{n}",
        )
    ax_i.axhline(1.0, color="grey", linewidth=0.8)
    ax_i.set_xticks(
        [g + 0.4 - width / 2 for g in range(len(groups))],
        [f"{d}/{p} b{b} c{c}" for d, p, b, c in groups],
        rotation=90,
        fontsize=6,
    )
    ax_i.set(ylabel="TPOT / TPOT alone", title="decode beside prefills (decode/prefill share)")
    ax_i.legend(fontsize=7)
    fig.suptitle(f"{result.model} on {result.device}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
