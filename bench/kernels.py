"""`python -m bench.kernels [--out DIR] [--quick] [--only NAME ...]`: time the Triton kernels on a
GPU.

Every kernel runs at Llama-3.1-8B sizes (H=32, Hkv=8, D=128, hidden 4096, intermediate 14336, bf16,
KV block 16) over a small grid of launch configs, and once with the config the code picks today
(`default`); the mixture-of-experts layer (engine/kernels/moe.py: align, the grouped GEMMs, the
top-k sum) at Qwen3-30B-A3B's (128 experts of width 768 over hidden 2048, 8 a token) from 1 to 4096
tokens, its bytes those of the experts the tokens routed to (random router logits), its FLOPs the
chosen experts' alone. Times are medians of triton.testing.do_bench (warm-up first, L2 flushed
between runs).
Attention is planned once per config and relaunched as the engine does (engine/kernels/launch.py),
so a small kernel's time is not its host time. Bandwidth counts the bytes a kernel must read and
write once; attention also reports TFLOP/s (two matmuls of 2 x queries x keys x D per head, each
(query, key) pair under the causal mask once). Both are set against this GPU's measured copy
bandwidth (read + write of a 1 GiB device-to-device copy) and bf16 matmul rate (8192^3), measured in
the same run. Appends sweep tiles x KV splits of the general grid; a mixed step (64 decodes at 1K
beside a 256-token append over 4K) sweeps the two grids' launch (sequential or fused, MIXED_LAUNCH)
x the append's splits. Before timing, each config's output is checked against the default's, so a
fast but wrong config cannot win. Prints one markdown row per shape (default vs best config); --out
writes every measurement as JSON. Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path

import torch

H, HKV, D, BS = 32, 8, 128, 16
HIDDEN, INTER = 4096, 14336
DT = torch.bfloat16


@dataclass
class Row:
    kernel: str
    shape: str
    config: str
    ms: float | None  # None: the config failed to compile or disagreed with the default's output
    gbps: float | None
    tflops: float | None
    note: str = ""


@dataclass(frozen=True)
class Split:
    """An attention tile (None: the table's) with its KV splits; for a mixed step, how its two grids
    launch."""

    tile: object
    splits: int
    mixed: str = ""


@dataclass
class Case:
    """One shape of one kernel: run(config) launches it; configs are the sweep (None = the code's
    default)."""

    kernel: str
    shape: str
    run: Callable[[object], torch.Tensor]
    configs: list[object]
    nbytes: int
    flops: int = 0


def time_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def label(config: object) -> str:
    """ "default", "num_warps=4", "block_m=128 tile_n=64 num_warps=8 num_stages=3", or with a Split
    "... splits=2" ("default tile splits=2 fused")."""
    if config is None:
        return "default"
    if isinstance(config, Split):
        tile = "default tile" if config.tile is None else label(config.tile)
        return " ".join(x for x in (tile, f"splits={config.splits}", config.mixed) if x)
    if is_dataclass(config):
        return " ".join(f"{k}={v}" for k, v in asdict(config).items())
    return f"num_warps={config}"


def measure_one(case: Case, config: object, reference: torch.Tensor | None) -> Row:
    name = label(config)
    try:
        out = case.run(config)
        torch.cuda.synchronize()
        if reference is not None and not torch.allclose(
            out.float(), reference.float(), rtol=2e-2, atol=2e-2
        ):
            return Row(
                case.kernel,
                case.shape,
                name,
                None,
                None,
                None,
                "output differs from the default config",
            )
        ms = time_ms(lambda: case.run(config))
    except Exception as e:  # noqa: BLE001 - a config that does not fit (shared memory, registers) is skipped
        return Row(
            case.kernel, case.shape, name, None, None, None, f"{type(e).__name__}: {str(e)[:80]}"
        )
    return Row(
        case.kernel,
        case.shape,
        name,
        ms,
        case.nbytes / ms / 1e6,
        case.flops / ms / 1e9 if case.flops else None,
    )


def sweep(case: Case) -> list[Row]:
    reference = case.run(None).clone()
    rows = [measure_one(case, None, None)]
    rows += [measure_one(case, c, reference) for c in case.configs]
    return rows


# ---- cases ---------------------------------------------------------------------------------------


def attention_configs(decode: bool, quick: bool) -> list[object]:
    from engine.kernels.attention import AttentionConfig

    if quick:
        return []
    if decode:
        return [
            AttentionConfig(16, n, w, s) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)
        ]
    return [
        AttentionConfig(m, n, w, s)
        for m in (64, 128)
        for n in (32, 64, 128)
        for w in (4, 8)
        for s in (2, 3, 4)
    ]


def append_configs(quick: bool) -> list[object]:
    """Tiles of 32 to 128 rows with 4 or 8 warps (8 warps hold a tile in fewer registers each: two
    programs may share an SM), each with 1, 2 and 4 KV splits."""
    from engine.kernels.attention import AttentionConfig

    if quick:
        return []
    tiles = [
        AttentionConfig(m, n, w, s)
        for m in (32, 64, 128)
        for n in (64, 128)
        for w in (4, 8)
        for s in (2, 3, 4)
    ]
    return [Split(tile, splits) for tile in tiles for splits in (1, 2, 4)]


class Paged:
    """One KV cache sized for the largest case, with random contents and block tables in a random
    block order."""

    def __init__(self, max_tokens: int, device: str = "cuda") -> None:
        self.num_blocks = max_tokens // BS + 1
        self.k = torch.randn(self.num_blocks * BS, HKV, D, dtype=DT, device=device)
        self.v = torch.randn_like(self.k)
        self.order = torch.randperm(self.num_blocks, device=device).to(torch.int32)

    def tables(self, batch: int, ctx: int) -> torch.Tensor:
        width = -(-ctx // BS)
        return self.order[: batch * width].view(batch, width)


def attention_runner(
    q: torch.Tensor,
    out: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: torch.Tensor,
    qs: torch.Tensor,
    lens: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    workspaces: dict | None = None,
) -> Callable[..., torch.Tensor]:
    """run(config, splits=1): attention over these tensors, planned once per (config, splits) and
    launched through one Launches, as an engine step does for its layers, so that do_bench times the
    kernel and not the host's planning, which can take longer than a small decode kernel
    (docs/gpu.md#measurements-behind-the-code)."""
    from engine.kernels.attention import launch_attention, plan_attention
    from engine.kernels.launch import Launches

    plans: dict = {}

    def run(config: object, splits: int = 1) -> torch.Tensor:
        if (config, splits) not in plans:
            launch = plan_attention(
                q.shape[0],
                H,
                D,
                lens.shape[0],
                q.dtype,
                q_strides=q.stride()[:2],
                out_strides=out.stride()[:2],
                cache_strides=k.stride()[:2],
                table_stride=tables.stride(0),
                num_kv_heads=HKV,
                block_size=BS,
                scale=D**-0.5,
                max_query_len=max_query_len,
                max_seq_len=max_seq_len,
                num_splits=splits,
                workspace=(workspaces or {}).get(splits),
                config=config,
                device=q.device,
            )
            plans[(config, splits)] = launch, Launches()
        launch, launches = plans[(config, splits)]
        return launch_attention(launch, out, q, k, v, tables, qs, lens, launches)

    return run


def decode_cases(paged: Paged, quick: bool, device: str = "cuda") -> Iterator[Case]:
    from engine.kernels.attention import choose_num_splits, workspace_for

    for ctx in (1024, 4096, 16384):
        for batch in (1, 8, 32, 128, 256):
            q = torch.randn(batch, H, D, dtype=DT, device=device)
            out = torch.empty_like(q)
            qs = torch.arange(batch + 1, dtype=torch.int32, device=device)
            lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
            tables = paged.tables(batch, ctx)
            best = choose_num_splits(batch, HKV, ctx)
            workspaces = {
                s: workspace_for(batch, H, D, s, device) for s in {1, 2, 4, 8, 16, 32, best}
            }

            attend = attention_runner(
                q, out, paged.k, paged.v, tables, qs, lens, 1, ctx, workspaces
            )

            def run(
                cfg: object, splits: int | None = None, attend=attend, best=best
            ) -> torch.Tensor:
                return attend(cfg, best if splits is None else splits)

            nbytes = batch * ctx * HKV * D * 2 * DT.itemsize + 2 * q.numel() * DT.itemsize
            shape = f"decode b={batch} ctx={ctx}"
            yield Case(
                "attention",
                shape + f" splits={best}",
                run,
                attention_configs(True, quick),
                nbytes,
                4 * batch * H * ctx * D,
            )
            if not quick:
                for s in sorted({1, 2, 4, 8, 16, 32} - {best}):
                    yield Case(
                        "attention",
                        shape + f" splits={s}",
                        lambda cfg, s=s, run=run: run(cfg, s),
                        [],
                        nbytes,
                        4 * batch * H * ctx * D,
                    )


def causal_flops(cached: int, new: int) -> int:
    """Attention FLOPs of new tokens over `cached` keys and themselves: two matmuls of 2 x D per
    head for each (query, key) pair under the causal mask."""
    return 4 * H * D * (new * cached + new * (new + 1) // 2)


def append_splits(cached: int, new: int) -> int:
    """The KV splits the engine gives one sequence's general grid (its tile's programs,
    choose_append_splits)."""
    from engine.kernels.attention import choose_append_splits, default_config, general_programs

    tile = default_config(new, H // HKV, cached + new)
    return choose_append_splits(general_programs(new, H // HKV, HKV, tile), new, cached + new)


def prefill_cases(paged: Paged, quick: bool, device: str = "cuda") -> Iterator[Case]:
    """Prompts over the prefill tiles; appends over tiles x KV splits (the shape names the default's
    splits)."""
    shapes = [(0, 512), (0, 2048), (0, 8192), (4096, 256), (16384, 256)]
    for cached, new in shapes:
        q = torch.randn(new, H, D, dtype=DT, device=device)
        out = torch.empty_like(q)
        qs = torch.tensor([0, new], dtype=torch.int32, device=device)
        lens = torch.tensor([cached + new], dtype=torch.int32, device=device)
        tables = paged.tables(1, cached + new)

        attend = attention_runner(q, out, paged.k, paged.v, tables, qs, lens, new, cached + new)
        nbytes = (cached + new) * HKV * D * 2 * DT.itemsize + 2 * q.numel() * DT.itemsize
        if cached == 0:
            yield Case(
                "attention",
                f"prefill n={new}",
                attend,
                attention_configs(False, quick),
                nbytes,
                causal_flops(cached, new),
            )
            continue
        splits = append_splits(cached, new)

        def run(cfg: Split | None, attend=attend, splits=splits) -> torch.Tensor:
            return attend(None, splits) if cfg is None else attend(cfg.tile, cfg.splits)

        yield Case(
            "attention",
            f"append over {cached} n={new} splits={splits}",
            run,
            append_configs(quick),
            nbytes,
            causal_flops(cached, new),
        )


def mixed_cases(paged: Paged, quick: bool, device: str = "cuda") -> Iterator[Case]:
    """64 decodes at context 1K beside one 256-token append over 4K cached tokens, attention as the
    Triton backend launches it: sequential (the decode grid, then the general grid) or fused (one
    launch), by the append's KV splits; the default is MIXED_LAUNCH with the engine's splits."""
    from engine.attention.triton_backend import MIXED_LAUNCH
    from engine.kernels.attention import (
        choose_num_splits,
        launch_attention,
        plan_attention,
        plan_mixed_attention,
    )
    from engine.kernels.launch import Launches

    decodes, ctx, cached, new = 64, 1024, 4096, 256
    t, n = decodes + new, decodes
    q = torch.randn(t, H, D, dtype=DT, device=device)
    out = torch.empty_like(q)
    qs = torch.tensor([*range(decodes + 1), t], dtype=torch.int32, device=device)
    lens = torch.tensor([ctx] * decodes + [cached + new], dtype=torch.int32, device=device)
    tables = torch.zeros(decodes + 1, -(-(cached + new) // BS), dtype=torch.int32, device=device)
    tables[:decodes, : ctx // BS] = paged.tables(decodes, ctx)
    tables[decodes] = paged.tables(1, cached + new)[0]
    common = dict(
        q_strides=q.stride()[:2],
        out_strides=out.stride()[:2],
        cache_strides=paged.k.stride()[:2],
        table_stride=tables.stride(0),
        num_kv_heads=HKV,
        block_size=BS,
        scale=D**-0.5,
        device=device,
    )
    decode_splits = choose_num_splits(decodes, HKV, ctx)
    default = Split(None, append_splits(cached, new), MIXED_LAUNCH)
    plans: dict = {}

    def run(cfg: Split | None) -> torch.Tensor:
        cfg = cfg or default
        if cfg not in plans:
            general = dict(
                max_query_len=new, max_seq_len=cached + new, num_splits=cfg.splits, config=cfg.tile
            )
            if cfg.mixed == "fused":
                launches = [
                    (
                        plan_mixed_attention(
                            t,
                            H,
                            D,
                            n + 1,
                            DT,
                            num_decodes=n,
                            decode_tokens=n,
                            decode_splits=decode_splits,
                            **general,
                            **common,
                        ),
                        qs,
                        lens,
                        tables,
                    )
                ]
            else:
                decode = plan_attention(
                    n, H, D, n, DT, max_query_len=1, num_splits=decode_splits, **common
                )
                append = plan_attention(t, H, D, 1, DT, first_token=n, **general, **common)
                launches = [
                    (decode, qs[: n + 1], lens[:n], tables[:n]),
                    (append, qs[n:], lens[n:], tables[n:]),
                ]
            plans[cfg] = launches, Launches()
        launches, relaunch = plans[cfg]
        for launch, starts, seq_lens, seq_tables in launches:
            launch_attention(
                launch, out, q, paged.k, paged.v, seq_tables, starts, seq_lens, relaunch
            )
        return out

    configs = [Split(None, s, m) for m in ("sequential", "fused") for s in (1, 2, 4)]
    nbytes = (
        decodes * ctx + cached + new
    ) * HKV * D * 2 * DT.itemsize + 2 * q.numel() * DT.itemsize
    yield Case(
        "attention",
        f"mixed {decodes} decodes at {ctx} + append over {cached} n={new} "
        f"(decode splits={decode_splits}, splits={default.splits} {default.mixed})",
        run,
        [] if quick else [c for c in configs if c != default],
        nbytes,
        4 * H * D * decodes * ctx + causal_flops(cached, new),
    )


def elementwise_cases(quick: bool, device: str = "cuda") -> Iterator[Case]:
    from engine.kernels import add_rms_norm, apply_rope, rms_norm, silu_and_mul, store_kv

    warps = [] if quick else [1, 2, 4, 8, 16]
    b = DT.itemsize
    cos = torch.randn(65536, D // 2, device=device)
    sin = torch.randn_like(cos)
    for t in (1, 256, 8192):
        x, r = (torch.randn(t, HIDDEN, dtype=DT, device=device) for _ in range(2))
        w = torch.randn(HIDDEN, dtype=DT, device=device)
        yield Case(
            "rms_norm",
            f"t={t}",
            lambda nw, x=x, w=w: rms_norm(x, w, 1e-5, num_warps=nw),
            warps,
            2 * x.numel() * b,
        )
        yield Case(
            "add_rms_norm",
            f"t={t}",
            lambda nw, x=x, r=r, w=w: add_rms_norm(x, r, w, 1e-5, num_warps=nw)[0],
            warps,
            4 * x.numel() * b,
        )
        qkv = torch.randn(t, (H + 2 * HKV) * D, dtype=DT, device=device)
        q, k = qkv[:, : H * D].view(t, H, D), qkv[:, H * D : (H + HKV) * D].view(t, HKV, D)
        v = qkv[:, (H + HKV) * D :].view(t, HKV, D)
        pos = torch.randint(0, 65536, (t,), device=device)
        yield Case(
            "apply_rope",
            f"t={t}",
            lambda nw, q=q, k=k, pos=pos: apply_rope(q, k, pos, cos, sin, num_warps=nw)[0],
            warps,
            2 * (q.numel() + k.numel()) * b + t * D * 4,
        )
        kc = torch.zeros(t * 4, HKV, D, dtype=DT, device=device)
        vc = torch.zeros_like(kc)
        slots = torch.randperm(t * 4, device=device)[:t]

        def store(nw: object, k=k, v=v, kc=kc, vc=vc, slots=slots) -> torch.Tensor:
            store_kv(k, v, kc, vc, slots, num_warps=nw)
            return kc

        yield Case("store_kv", f"t={t}", store, warps, 4 * k.numel() * b)
        gate_up = torch.randn(t, 2 * INTER, dtype=DT, device=device)
        yield Case(
            "silu_and_mul",
            f"t={t}",
            lambda nw, x=gate_up: silu_and_mul(x, num_warps=nw),
            warps,
            3 * t * INTER * b,
        )


QWEN3_MOE = (128, 8, 2048, 768)  # experts, a token's, hidden, an expert's width (Qwen3-30B-A3B)
MOE_TOKENS = (1, 8, 32, 64, 128, 512, 2048, 4096)


def moe_configs(quick: bool) -> list[object]:
    from engine.kernels.moe import MoeConfig

    if quick:
        return []
    tiles = (
        (16, 64, 128, 4, 4),
        (16, 128, 64, 4, 3),
        (32, 64, 64, 4, 4),
        (32, 128, 64, 4, 3),
        (64, 64, 64, 4, 4),
        (64, 128, 64, 4, 3),
        (128, 128, 64, 8, 3),
        (128, 256, 64, 8, 3),
    )
    return [MoeConfig(0, *tile) for tile in tiles]


def moe_cases(quick: bool, device: str = "cuda") -> Iterator[Case]:
    """The fused mixture-of-experts layer at Qwen3-30B-A3B's shapes: its bytes the experts the
    tokens routed to (counted) and the tokens in and out, its FLOPs each token's top-k experts'."""
    from engine.kernels.moe import fused_moe, route

    e, k, h, w = QWEN3_MOE
    w13 = torch.randn(e, 2 * w, h, dtype=DT, device=device) / h**0.5
    w2 = torch.randn(e, h, w, dtype=DT, device=device) / w**0.5
    for t in MOE_TOKENS:
        x = torch.randn(t, h, dtype=DT, device=device)
        if device == "meta":  # listed, not run: no routing to count
            weights = torch.empty(t, k, device=device)
            ids = torch.empty(t, k, dtype=torch.int64, device=device)
            read = min(e, t * k)
        else:
            weights, ids = route(torch.randn(t, e, device=device), k, True)
            read = int(ids.unique().numel())
        yield Case(
            "moe",
            f"t={t} ({read} experts read)",
            lambda config, x=x, weights=weights, ids=ids: fused_moe(
                x, w13, w2, weights, ids, config=config
            ),
            moe_configs(quick),
            read * 3 * h * w * DT.itemsize + 2 * t * h * DT.itemsize,
            2 * t * k * 3 * h * w,
        )


def all_cases(quick: bool, attention: bool = True, device: str = "cuda") -> Iterator[Case]:
    """Every case, attention's first (attention False: none of them, nor their KV cache). Tensors
    are made on device as each case comes (on "meta", none has memory: the cases can be listed
    anywhere)."""
    if attention:
        paged = Paged(256 * 16384, device)
        yield from decode_cases(paged, quick, device)
        yield from prefill_cases(paged, quick, device)
        yield from mixed_cases(paged, quick, device)
    yield from elementwise_cases(quick, device)
    yield from moe_cases(quick, device)


# ---- baselines, report ---------------------------------------------------------------------------


def copy_gbps() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / time_ms(lambda: dst.copy_(src)) / 1e6


def matmul_tflops() -> float:
    n = 8192
    a, b = (torch.randn(n, n, dtype=DT, device="cuda") for _ in range(2))
    c = torch.empty(n, n, dtype=DT, device="cuda")
    return 2 * n**3 / time_ms(lambda: torch.matmul(a, b, out=c)) / 1e9


def markdown(rows: list[Row], copy: float, mm: float) -> str:
    lines = [
        f"copy {copy:,.0f} GB/s, bf16 matmul {mm:,.0f} TFLOP/s",
        "",
        "| kernel | shape | default ms | best ms | best config | GB/s | % copy | TFLOP/s | % "
        "matmul |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.kernel, r.shape), []).append(r)
    for (kernel, shape), group in groups.items():
        ok = [r for r in group if r.ms is not None]
        if not ok:
            lines.append(f"| {kernel} | {shape} | failed: {group[0].note} | | | | | | |")
            continue
        default = next((r for r in ok if r.config == "default"), None)
        best = min(ok, key=lambda r: r.ms)
        tf = f"{best.tflops:.1f} | {100 * best.tflops / mm:.0f}%" if best.tflops else "| "
        lines.append(
            f"| {kernel} | {shape} | {default.ms if default else float('nan'):.4f} | {best.ms:.4f} "
            "| "
            f"{best.config} | {best.gbps:,.0f} | {100 * best.gbps / copy:.0f}% | {tf} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="folder for the JSON of every measurement")
    p.add_argument("--quick", action="store_true", help="time the default configs only (no sweep)")
    p.add_argument(
        "--only",
        nargs="*",
        default=None,
        help="kernels to run: attention, rms_norm, add_rms_norm, apply_rope, store_kv, "
        "silu_and_mul, moe",
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.kernels needs a CUDA GPU; none is visible, nothing to measure.")
        return 0
    torch.manual_seed(0)
    copy, mm = copy_gbps(), matmul_tflops()
    print(
        f"# {torch.cuda.get_device_name()}: copy {copy:,.0f} GB/s, bf16 matmul {mm:,.0f} TFLOP/s",
        flush=True,
    )

    def wanted(name: str) -> bool:
        return args.only is None or name in args.only

    rows: list[Row] = []
    for case in all_cases(args.quick, wanted("attention")):
        if not wanted(case.kernel):
            continue
        start = time.monotonic()
        group = sweep(case)
        rows += group
        ok = [r.ms for r in group if r.ms is not None]
        print(
            f"{case.kernel:13s} {case.shape:40s} best {min(ok) if ok else float('nan'):.4f} ms "
            f"({len(group)} configs, {time.monotonic() - start:.0f} s)",
            flush=True,
        )
    table = markdown(rows, copy, mm)
    print("\n" + table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"kernels-{time.strftime('%Y%m%d-%H%M%S')}.json"
        meta = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": __import__("triton").__version__,
            "copy_GBps": copy,
            "matmul_TFLOPs": mm,
        }
        path.write_text(json.dumps({**meta, "results": [asdict(r) for r in rows]}, indent=1))
        (args.out / path.name.replace(".json", ".md")).write_text(table + "\n")
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
