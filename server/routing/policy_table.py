"""The PPD policy's offline table: turn-2+ latency by route, measured per workload cell (`ppd
profile policy`).

A cell is (context class, shape class, load class) of an append-prefill:
- context: tokens of the conversation already cached when the turn arrives;
- shape: new input tokens over requested output tokens (a paste with a short answer has a high
  ratio);
- load: requests in flight on the unit when it arrives. Each axis is cut at the geometric midpoints
  between the values profiled, so a request maps to the nearest profiled point. For each cell and
  route ("prefill": on the prefill worker; "decode": inline on the decode worker) the table keeps
  the turn-2+ TTFT and TPOT medians and 90th percentiles, the prefill worker's mean queue delay
  during the run, and the sample count. The raw run summaries are kept too, so that other weights
  need no new measurement: x* is recomputed from the stored latencies for any (w_ttft, w_tpot).

File format (JSON), schema "ppd-policy-table", version 1:
  {"schema": "ppd-policy-table", "version": 1, "device", "model", "created", "command",
   "settings": {block_size, max_num_batched_tokens, ...},
   "grid": {"contexts": [tokens...], "shapes": [[new_input, output]...], "loads": [in-flight...]},
   "weights": {"w_ttft", "w_tpot"},                        # those x_star was computed for
   "cells": [{"context": i, "shape": j, "load": k, "x_star": 0|1|null,
              "routes": {"prefill"|"decode": {"ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms",
                                                "tpot_p90_ms", "queue_delay_ms", "n"}}}],
   "raw": {"<context>x<new>x<out>@<load>:<route>": run summary}}
"""

from __future__ import annotations

import json
import math
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from profiles import profile_file, slug, write_json

SCHEMA = "ppd-policy-table"
VERSION = 1
ROUTES = ("prefill", "decode")
STAT_KEYS = ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms", "queue_delay_ms", "n")


class TableError(ValueError):
    """A policy table that cannot be used; the message names the file and the problem."""


@dataclass
class RouteStats:
    ttft_p50_ms: float
    ttft_p90_ms: float
    tpot_p50_ms: float
    tpot_p90_ms: float
    queue_delay_ms: float = 0.0
    n: int = 0


@dataclass
class Cell:
    routes: dict[str, RouteStats]
    x_star: int | None = None  # 1: decode, 0: prefill, None: a route was not measured

    def objective(self, route: str, w_ttft: float, w_tpot: float) -> float:
        s = self.routes[route]
        return w_ttft * s.ttft_p50_ms + w_tpot * s.tpot_p50_ms


@dataclass
class PolicyTable:
    contexts: list[int]
    shapes: list[tuple[int, int]]
    loads: list[int]
    cells: dict[tuple[int, int, int], Cell]
    w_ttft: float = 1.0
    w_tpot: float = 10.0
    device: str = ""
    model: str = ""
    meta: dict[str, Any] = field(default_factory=dict)  # created, command, settings
    raw: dict[str, Any] = field(default_factory=dict)
    # Cut points between profiled values (geometric midpoints), for bisect at decision time.
    context_edges: list[float] = field(init=False)
    ratio_edges: list[float] = field(init=False)
    load_edges: list[float] = field(init=False)
    ratio_order: list[int] = field(init=False)  # shape indices sorted by ratio

    def __post_init__(self) -> None:
        self.context_edges = _midpoints(self.contexts)
        ratios = [n_in / max(n_out, 1) for n_in, n_out in self.shapes]
        self.ratio_order = sorted(range(len(ratios)), key=ratios.__getitem__)
        self.ratio_edges = _midpoints([ratios[i] for i in self.ratio_order])
        self.load_edges = _midpoints(self.loads)

    # ---- decision-time lookup --------------------------------------------------------------------

    def key(self, cached: int, new: int, output: int, load: int) -> tuple[int, int, int]:
        """The cell of an append of `new` tokens over `cached`, asking for `output` tokens, at
        `load` in flight."""
        shape = self.ratio_order[bisect_right(self.ratio_edges, new / max(output, 1))]
        return bisect_right(self.context_edges, cached), shape, bisect_right(self.load_edges, load)

    def x_star(self, key: tuple[int, int, int], w_ttft: float, w_tpot: float) -> int | None:
        """1 when the decode route has the lower weighted objective in this cell, 0 when prefill
        has; None unknown."""
        cell = self.cells.get(key)
        if cell is None or any(r not in cell.routes for r in ROUTES):
            return None
        return int(
            cell.objective("decode", w_ttft, w_tpot) < cell.objective("prefill", w_ttft, w_tpot)
        )

    def with_weights(self, w_ttft: float, w_tpot: float) -> PolicyTable:
        """The same measurements with x* recomputed for other weights (no new measurement)."""
        for key, cell in self.cells.items():
            cell.x_star = self.x_star(key, w_ttft, w_tpot)
        self.w_ttft, self.w_tpot = w_ttft, w_tpot
        return self

    # ---- building one from measured runs ---------------------------------------------------------

    @classmethod
    def from_runs(
        cls,
        contexts: list[int],
        shapes: list[tuple[int, int]],
        loads: list[int],
        raw: dict[str, Any],
        w_ttft: float,
        w_tpot: float,
        device: str = "",
        model: str = "",
        meta: dict[str, Any] | None = None,
    ) -> PolicyTable:
        """The table of the grid contexts x shapes x loads from raw run summaries (keyed by run_key,
        as in the file's "raw"), x* decided for (w_ttft, w_tpot). A run that measured nothing (n
        == 0) counts as unmeasured, and a cell with no measured route is left out."""
        cells = {}
        for i, context in enumerate(contexts):
            for j, shape in enumerate(shapes):
                for k, load in enumerate(loads):
                    routes = {}
                    for route in ROUTES:
                        run = raw.get(run_key(context, shape, load, route))
                        if run and run["n"] > 0:
                            routes[route] = RouteStats(
                                run["ttft_p50_ms"],
                                run["ttft_p90_ms"],
                                run["tpot_p50_ms"] or 0.0,
                                run["tpot_p90_ms"] or 0.0,
                                run["queue_delay_ms"],
                                run["n"],
                            )
                    if routes:
                        cells[(i, j, k)] = Cell(routes)
        table = cls(
            list(contexts),
            list(shapes),
            list(loads),
            cells,
            device=device,
            model=model,
            meta=meta or {},
            raw=raw,
        )
        return table.with_weights(w_ttft, w_tpot)

    # ---- file ------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        cells = [
            {
                "context": k[0],
                "shape": k[1],
                "load": k[2],
                "x_star": c.x_star,
                "routes": {r: vars(s).copy() for r, s in c.routes.items()},
            }
            for k, c in sorted(self.cells.items())
        ]
        return {
            "schema": SCHEMA,
            "version": VERSION,
            "device": self.device,
            "model": self.model,
            **self.meta,
            "grid": {
                "contexts": self.contexts,
                "shapes": [list(s) for s in self.shapes],
                "loads": self.loads,
            },
            "weights": {"w_ttft": self.w_ttft, "w_tpot": self.w_tpot},
            "cells": cells,
            "raw": self.raw,
        }

    def save(self, path: str | Path) -> None:
        """Write atomically (a temporary file, then a rename): an interrupted write never leaves
        half a table."""
        write_json(Path(path), self.to_json())

    @classmethod
    def from_json(cls, data: Any, source: str = "table") -> PolicyTable:
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise TableError(
                f"{source}: not a ppd policy table (schema {SCHEMA!r}); make one with ppd profile "
                "policy"
            )
        if data.get("version") != VERSION:
            raise TableError(
                f"{source}: policy table version {data.get('version')!r}, this server reads "
                f"{VERSION}; "
                "re-run ppd profile policy"
            )
        try:
            grid = data["grid"]
            contexts = [int(c) for c in grid["contexts"]]
            shapes = [(int(a), int(b)) for a, b in grid["shapes"]]
            loads = [int(x) for x in grid["loads"]]
            cells = {}
            for c in data["cells"]:
                key = (int(c["context"]), int(c["shape"]), int(c["load"]))
                if not (
                    0 <= key[0] < len(contexts)
                    and 0 <= key[1] < len(shapes)
                    and 0 <= key[2] < len(loads)
                ):
                    raise TableError(f"{source}: cell {key} outside the grid")
                routes = {
                    r: RouteStats(**{k: s[k] for k in STAT_KEYS if k in s})
                    for r, s in c["routes"].items()
                    if r in ROUTES
                }
                cells[key] = Cell(routes, c.get("x_star"))
            weights = data.get("weights", {})
            meta = {k: data[k] for k in ("created", "command", "settings") if k in data}
            if not contexts or not shapes or not loads:
                raise TableError(f"{source}: empty grid")
            return cls(
                contexts,
                shapes,
                loads,
                cells,
                float(weights.get("w_ttft", 1.0)),
                float(weights.get("w_tpot", 10.0)),
                str(data.get("device", "")),
                str(data.get("model", "")),
                meta,
                data.get("raw", {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, TableError):
                raise
            raise TableError(
                f"{source}: malformed policy table ({type(exc).__name__}: {exc})"
            ) from exc

    @classmethod
    def load(cls, path: str | Path) -> PolicyTable:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise TableError(f"cannot read the policy table {path}: {exc}") from exc
        return cls.from_json(data, str(path))


def run_key(context: int, shape: tuple[int, int], load: int, route: str) -> str:
    """The key of one measured run (a cell of the grid on one route) in the table's "raw"
    summaries."""
    return f"{context}x{shape[0]}x{shape[1]}@{load}:{route}"


def table_path(device: str, model: str, folder: Path | None = None) -> Path:
    """<device>__<model>__policy.json (model: profiles.model_name's) in `folder`; without one, the
    table the server reads: the user's ($PPD_CACHE_DIR/profiles) before the shipped one
    (profiles.profile_file)."""
    return profile_file(f"{slug(device)}__{slug(model)}__policy.json", folder)


def _midpoints(values: list[int] | list[float]) -> list[float]:
    ordered = sorted(values)
    return [math.sqrt(max(a, 1e-9) * max(b, 1e-9)) for a, b in zip(ordered, ordered[1:])]
