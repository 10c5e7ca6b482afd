"""The partition profile (`ppd profile partition`): what a share of the device buys each worker.

A share is a number of cores on the CPU and of SMs on a GPU. The profile holds, for one device and
model:
- decode: step time by share x batch x context (the decode worker alone);
- prefill: throughput by share x prompt length (the prefill worker alone);
- interference: decode TPOT at a batch and context while 0, 1 or 4 prefills run beside it (full
  prompts, or append-prefills of new tokens over a cached context), each worker on its share (the
  PPD paper's Figures 2, 6, 7). The share manager (partition/manager.py) reads decode step times
  from it to give decode the smallest share that keeps its step under the inter-token SLO.

File format (JSON), schema "ppd-partition-profile", version 1:
  {"schema": "ppd-partition-profile", "version": 1, "device", "model", "created", "command",
   "unit": "cores" | "sms", "total": cores or SMs of the device (or of the unit's share of the CPU),
   "shares": [share...],                     # the shares measured, ascending
   "decode": [{"share", "batch", "context", "step_ms", "step_p90_ms"}],
   "prefill": [{"share", "prompt", "tokens_per_s"}],
   "interference": [{"decode_share", "prefill_share", "batch", "context", "kind": "full" | "append",
                     "concurrent", "new_tokens", "tpot_ms", "tpot_alone_ms"}],
   "meta": {...}}                             # settings, times, anything the profiler wants to keep
"""

from __future__ import annotations

import json
import math
from bisect import bisect_left
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from profiles import model_name, profile_file, slug, write_json

SCHEMA = "ppd-partition-profile"
VERSION = 1
UNITS = ("cores", "sms")


class ProfileError(ValueError):
    """A partition profile that cannot be used; the message names the file and the problem."""


@dataclass(frozen=True)
class DecodePoint:
    share: int
    batch: int
    context: int
    step_ms: float
    step_p90_ms: float


@dataclass(frozen=True)
class PrefillPoint:
    share: int
    prompt: int
    tokens_per_s: float


@dataclass(frozen=True)
class InterferencePoint:
    decode_share: int
    prefill_share: int
    batch: int
    context: int
    # "full": whole prompts of new_tokens; "append": new_tokens over a cached context of `context`
    kind: str
    concurrent: int  # prefills running beside decode (0: decode alone)
    new_tokens: int
    tpot_ms: float
    tpot_alone_ms: float


@dataclass
class PartitionProfile:
    device: str
    model: str
    unit: str
    total: int
    shares: list[int]
    decode: list[DecodePoint]
    prefill: list[PrefillPoint] = field(default_factory=list)
    interference: list[InterferencePoint] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    _decode: dict[int, dict[tuple[int, int], float]] = field(init=False, repr=False)
    _batches: dict[int, list[int]] = field(init=False, repr=False)
    _contexts: dict[int, list[int]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._decode, self._batches, self._contexts = {}, {}, {}
        for p in self.decode:
            self._decode.setdefault(p.share, {})[(p.batch, p.context)] = p.step_ms
        for share, points in self._decode.items():
            self._batches[share] = sorted({b for b, _ in points})
            self._contexts[share] = sorted({c for _, c in points})

    # ---- lookups (the share manager's, per step: no allocation beyond a few floats) --------------

    def decode_step_ms(self, share: int, batch: int, context: int) -> float | None:
        """Predicted decode step time on `share` at `batch` sequences of mean `context` tokens:
        bilinear in batch and context between measured points, extrapolated linearly past the
        largest (never below the smallest measured time). None when this share was not measured on a
        full batch x context grid."""
        points, batches, contexts = (
            self._decode.get(share),
            self._batches.get(share),
            self._contexts.get(share),
        )
        if not points or len(points) != len(batches) * len(contexts):
            return None
        (b0, b1, tb), (c0, c1, tc) = _bracket(batches, batch), _bracket(contexts, context)
        low = points[(b0, c0)] + tc * (points[(b0, c1)] - points[(b0, c0)])
        high = points[(b1, c0)] + tc * (points[(b1, c1)] - points[(b1, c0)])
        return max(min(points.values()), low + tb * (high - low))

    def min_decode_share(self, batch: int, context: int, slo_ms: float) -> int | None:
        """The smallest measured share whose predicted decode step is within slo_ms (None: none
        is)."""
        for share in self.shares:
            step = self.decode_step_ms(share, batch, context)
            if step is not None and step <= slo_ms:
                return share
        return None

    def prefill_tokens_per_s(self, share: int, prompt: int) -> float | None:
        """Measured prefill throughput on `share` at the nearest measured prompt length (None: share
        not measured)."""
        points = [p for p in self.prefill if p.share == share]
        if not points:
            return None
        return min(
            points, key=lambda p: abs(math.log(max(p.prompt, 1) / max(prompt, 1)))
        ).tokens_per_s

    # ---- file ------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "version": VERSION,
            "device": self.device,
            "model": self.model,
            "unit": self.unit,
            "total": self.total,
            "shares": list(self.shares),
            "decode": [asdict(p) for p in self.decode],
            "prefill": [asdict(p) for p in self.prefill],
            "interference": [asdict(p) for p in self.interference],
            "meta": self.meta,
        }

    def save(self, path: Path) -> Path:
        return write_json(path, self.to_json())

    @classmethod
    def from_json(cls, data: Any, source: str = "profile") -> PartitionProfile:
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise ProfileError(
                f"{source}: not a ppd partition profile (schema {SCHEMA!r}); make one with "
                "ppd profile partition"
            )
        if data.get("version") != VERSION:
            raise ProfileError(
                f"{source}: partition profile version {data.get('version')!r}, this server reads "
                f"{VERSION}; make a new one with ppd profile partition"
            )
        try:
            unit, total, shares = data["unit"], int(data["total"]), [int(s) for s in data["shares"]]
            decode = [
                DecodePoint(
                    int(p["share"]),
                    int(p["batch"]),
                    int(p["context"]),
                    float(p["step_ms"]),
                    float(p["step_p90_ms"]),
                )
                for p in data["decode"]
            ]
            prefill = [
                PrefillPoint(int(p["share"]), int(p["prompt"]), float(p["tokens_per_s"]))
                for p in data.get("prefill", [])
            ]
            interference = [
                InterferencePoint(
                    int(p["decode_share"]),
                    int(p["prefill_share"]),
                    int(p["batch"]),
                    int(p["context"]),
                    str(p["kind"]),
                    int(p["concurrent"]),
                    int(p["new_tokens"]),
                    float(p["tpot_ms"]),
                    float(p["tpot_alone_ms"]),
                )
                for p in data.get("interference", [])
            ]
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(
                f"{source}: malformed partition profile ({type(exc).__name__}: {exc}); make a new "
                "one "
                "with ppd profile partition"
            ) from exc
        if unit not in UNITS:
            raise ProfileError(f"{source}: unit {unit!r} is not one of {', '.join(UNITS)}")
        if not shares or shares != sorted(set(shares)) or shares[0] < 1 or shares[-1] > total:
            raise ProfileError(
                f"{source}: shares {shares} must be distinct, ascending, from 1 to total {total}"
            )
        if any(p.share not in shares for p in decode) or any(p.step_ms <= 0 for p in decode):
            raise ProfileError(
                f"{source}: every decode point needs a listed share and a positive step time"
            )
        return cls(
            str(data.get("device", "")),
            str(data.get("model", "")),
            unit,
            total,
            shares,
            decode,
            prefill,
            interference,
            dict(data.get("meta", {})),
        )

    @classmethod
    def load(cls, path: Path) -> PartitionProfile:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ProfileError(
                f"{path}: cannot read the partition profile ({exc.strerror})"
            ) from exc
        except json.JSONDecodeError as exc:
            raise ProfileError(f"{path}: not JSON ({exc})") from exc
        return cls.from_json(data, str(path))


def profile_path(device: str, model: str, folder: Path | None = None) -> Path:
    """<device>__<model>.json (model: profiles.model_name's) in `folder`; without one, the profile
    the server reads: the user's ($PPD_CACHE_DIR/profiles) before the shipped one
    (profiles.profile_file)."""
    return profile_file(f"{slug(device)}__{slug(model)}.json", folder)


def shipped_profile(device: str, model_folder: str) -> str | None:
    """The partition profile of this device and the model in model_folder, the user's before the
    shipped one, if there is one."""
    path = profile_path(device, model_name(model_folder))
    return str(path) if path.is_file() else None


def _bracket(values: list[int], x: float) -> tuple[int, int, float]:
    """(low, high, t): the measured values around x and x's position between them (t past 1 beyond
    the last, 0 before the first); a single value gives (v, v, 0)."""
    if len(values) == 1:
        return values[0], values[0], 0.0
    i = min(max(bisect_left(values, x), 1), len(values) - 1)
    lo, hi = values[i - 1], values[i]
    return lo, hi, max(0.0, (x - lo) / (hi - lo))
