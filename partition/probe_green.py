"""Green contexts: SM partitions inside one process, made through the driver API (cuda-bindings),
with torch running the work on their streams.

green_context_check runs in a child (a driver fault there must not take the probe down). It reads
the device's SM resource (cuDeviceGetDevResource) and splits it twice with
cuDevSmResourceSplitByCount: a 16-SM group, and 64 SMs plus the rest as a disjoint pair. For each
group: cuDevResourceGenerateDesc, cuGreenCtxCreate, cuGreenCtxStreamCreate, and the granted SM count
read back with cuGreenCtxGetDevResource; torch gets the stream as a torch.cuda.ExternalStream. Then,
in bf16 at 4096³: a matmul on the 16-SM stream vs an ordinary stream (a real partition is several
times slower); the 64/rest pair run side by side vs one after the other, and the SMs their kernels
really ran on (%smid, probe_kernels.sm_ids: disjoint on the device, not only in the driver's
numbers); a CUDA graph captured on the 16-SM stream, checked against an eager result and timed
against a graph captured on an ordinary stream (the partition must survive capture), then replayed
on the ordinary stream (does the partition live in the graph or in the stream?). No green context is
ever made current, so torch's primary context stays current (checked at the end with
cuCtxGetCurrent). Everything made here is destroyed (cuStreamDestroy, cuGreenCtxDestroy).
"""

from __future__ import annotations

import inspect
import time
from typing import Any

from partition.child import Finding, error_text, guarded
from partition.driver import cuda_driver, driver_call, mps_enabled
from partition.green import GreenStreams
from partition.probe_report import PARTITION_SLOWDOWN

SMALL_SMS = 16
PAIR_SMS = 64
ROUNDING_REQUESTS = (
    1,
    8,
    12,
    16,
    20,
    24,
    64,
    100,
    120,
)  # what the driver grants for each (Hopper: multiples of 8)
MATMUL_N = 4096
PROGRAMS_PER_SM = (
    8  # sm_ids programs per SM of the device: enough that every SM a stream may use gets some
)
GRAPH_TOLERANCE = (
    0.02  # of the largest |value|: bf16 rounding differences pass, a wrong or stale result does not
)


def green_context_check(device: int, quick: bool) -> Finding:
    """Runs in a child. Facts on torch's green-context API, then the driver-API partitions and what
    they do."""
    import torch

    torch.cuda.set_device(device)
    torch.zeros(
        1, device=device
    )  # the primary context exists and is current before any driver call
    found: Finding = {"torch_api": torch_green_api(), "mps_enabled": mps_enabled(device)}
    try:
        drv = cuda_driver()
    except ImportError as exc:
        return {**found, "ok": False, "error": f"cuda-bindings unavailable: {error_text(exc)}"}
    primary = driver_call(drv, "cuCtxGetCurrent")
    greens = None
    try:
        greens = GreenStreams(drv, device)
        found.update(_measure(greens, device, iters=10 if quick else 50))
    except Exception as exc:
        found.update(ok=False, error=error_text(exc))
    finally:
        found["cleanup_errors"] = greens.destroy() if greens else []
        found["context_restored"] = int(driver_call(drv, "cuCtxGetCurrent")) == int(primary)
    if found.get("ok") and not found["context_restored"]:
        found.update(ok=False, error="torch's primary context is no longer current")
    return found


def torch_green_api() -> dict[str, Any]:
    """What this torch offers: GreenContext.create's signature, whether .Stream exists, the public
    names."""
    try:
        from torch.cuda.green_contexts import GreenContext
    except Exception as exc:
        return {"present": False, "error": error_text(exc)}
    return {
        "present": True,
        "create_signature": _signature(GreenContext.create),
        "has_stream": hasattr(GreenContext, "Stream"),
        "public": sorted(name for name in dir(GreenContext) if not name.startswith("_")),
    }


def _measure(greens: GreenStreams, device: int, iters: int) -> Finding:
    import torch

    whole = greens.whole_device()
    total = int(whole.sm.smCount)
    rounding = {
        str(sms): _granted_by_split(greens, whole, sms) for sms in ROUNDING_REQUESTS if sms <= total
    }
    small, _ = greens.split(whole, SMALL_SMS)
    pair_a, pair_b = greens.split(whole, PAIR_SMS)
    requested = {"small": SMALL_SMS, "pair_a": PAIR_SMS, "pair_b": f"the rest of {total}"}
    made = {
        "small": greens.create(small),
        "pair_a": greens.create(pair_a),
        "pair_b": greens.create(pair_b),
    }
    streams = {name: stream for name, (stream, _) in made.items()}
    groups = {
        name: {"requested": requested[name], "granted": granted}
        for name, (_, granted) in made.items()
    }

    torch.manual_seed(0)
    a, b = (torch.randn(MATMUL_N, MATMUL_N, device=device, dtype=torch.bfloat16) for _ in range(2))
    ordinary = torch.cuda.Stream(device=device)  # the full GPU, for comparison
    matmul = guarded(_matmul_times, streams, ordinary, a, b, iters)
    matmul["small_granted"] = groups["small"]["granted"]
    steps = {
        "matmul": matmul,
        "pair_overlap": guarded(_pair_overlap, streams["pair_a"], streams["pair_b"], a, b, iters),
        "graph": guarded(_graph_check, streams["small"], ordinary, a, b, iters),
    }
    errors = [f"{name}: {step['error']}" for name, step in steps.items() if not step.get("ok")]
    # A finding beside the verdict's: it needs a Triton kernel with inline PTX, not green contexts
    # alone.
    steps["pair_sm_ids"] = guarded(_pair_sm_ids, streams["pair_a"], streams["pair_b"], total)
    return {
        "ok": not errors,
        "error": "; ".join(errors) or None,
        "device_sm_count": total,
        "split_rounding": rounding,
        "groups": groups,
        **steps,
    }


def _granted_by_split(greens: GreenStreams, whole: Any, sms: int) -> int | str:
    try:
        return int(greens.split(whole, sms)[0].sm.smCount)
    except Exception as exc:
        return error_text(exc)


def _matmul_times(streams: dict[str, Any], ordinary: Any, a: Any, b: Any, iters: int) -> Finding:
    _time_matmul(ordinary, a, b, iters)  # discarded: an idle GPU's clocks ramp up during it
    full_s = _time_matmul(ordinary, a, b, iters)
    group_s = {name: _time_matmul(stream, a, b, iters) for name, stream in streams.items()}
    return {
        "n": MATMUL_N,
        "iters": iters,
        "full_s": full_s,
        "group_s": group_s,
        "slowdowns": {name: round(s / full_s, 2) for name, s in group_s.items()},
        "small_slowdown": round(group_s["small"] / full_s, 2),
    }


def _time_matmul(stream: Any, a: Any, b: Any, iters: int) -> float:
    import torch

    out = torch.empty_like(a)
    _enqueue_matmuls(stream, a, b, out, 1)  # warm-up: cuBLAS sets up its workspace for this stream
    stream.synchronize()
    start = time.perf_counter()
    _enqueue_matmuls(stream, a, b, out, iters)
    stream.synchronize()
    return (time.perf_counter() - start) / iters


def _enqueue_matmuls(stream: Any, a: Any, b: Any, out: Any, count: int) -> None:
    import torch

    with torch.cuda.stream(stream):
        for _ in range(count):
            torch.matmul(a, b, out=out)


def _pair_overlap(stream_a: Any, stream_b: Any, a: Any, b: Any, iters: int) -> Finding:
    """Two disjoint groups, one after the other vs side by side: ratio ~2 when they really run at
    once."""
    import torch

    outs = (torch.empty_like(a), torch.empty_like(a))
    pairs = ((stream_a, outs[0]), (stream_b, outs[1]))
    for stream, out in pairs:
        _enqueue_matmuls(stream, a, b, out, 1)
        stream.synchronize()
    start = time.perf_counter()
    for stream, out in pairs:
        _enqueue_matmuls(stream, a, b, out, iters)
        stream.synchronize()
    sequential_s = time.perf_counter() - start
    start = time.perf_counter()
    for stream, out in pairs:
        _enqueue_matmuls(stream, a, b, out, iters)
    for stream, _ in pairs:
        stream.synchronize()
    parallel_s = time.perf_counter() - start
    return {
        "sequential_s": sequential_s,
        "parallel_s": parallel_s,
        "ratio": round(sequential_s / parallel_s, 2),
    }


def _pair_sm_ids(stream_a: Any, stream_b: Any, total: int) -> Finding:
    """The SMs each group's programs ran on, launched on both streams at once: how many, and how
    many in common."""
    import torch

    from partition.probe_kernels import sm_ids

    ran = []
    for stream in (stream_a, stream_b):
        with torch.cuda.stream(stream):
            ran.append(sm_ids(PROGRAMS_PER_SM * total))
    stream_a.synchronize()
    stream_b.synchronize()
    a, b = (set(ids.tolist()) for ids in ran)
    return {
        "pair_a_sms": len(a),
        "pair_b_sms": len(b),
        "common_sms": len(a & b),
        "disjoint": not a & b,
    }


def _graph_check(green: Any, ordinary: Any, a: Any, b: Any, iters: int) -> Finding:
    import torch

    reference = (a @ b).float()
    torch.cuda.synchronize()
    green_graph, green_out = _capture(green, a, b)
    full_graph, _ = _capture(ordinary, a, b)
    green_s = _time_replays(green_graph, green, iters)  # the first replay also produces green_out
    full_s = _time_replays(full_graph, ordinary, iters)
    diff = (green_out.float() - reference).abs().max().item()
    scale = reference.abs().max().item()
    found = {
        "max_abs_diff": diff,
        "reference_max_abs": scale,
        "matches_eager": diff <= GRAPH_TOLERANCE * scale,
        "green_replay_s": green_s,
        "full_replay_s": full_s,
        "slowdown": round(green_s / full_s, 2),
        "keeps_partition": green_s / full_s >= PARTITION_SLOWDOWN,
    }
    # Last, as the riskiest call: a graph captured on the green stream, launched on an ordinary one.
    found["replayed_on_ordinary_stream"] = guarded(
        _replay_elsewhere, green_graph, ordinary, full_s, iters
    )
    return found


def _capture(stream: Any, a: Any, b: Any) -> tuple[Any, Any]:
    import torch

    with torch.cuda.stream(stream):
        torch.matmul(
            a, b
        )  # warm-up on this stream outside the capture (cuBLAS workspace, lazy init)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = torch.matmul(a, b)
    return graph, out


def _time_replays(graph: Any, stream: Any, iters: int) -> float:
    import torch

    with torch.cuda.stream(stream):
        graph.replay()
    stream.synchronize()
    start = time.perf_counter()
    with torch.cuda.stream(stream):
        for _ in range(iters):
            graph.replay()
    stream.synchronize()
    return (time.perf_counter() - start) / iters


def _replay_elsewhere(graph: Any, ordinary: Any, full_s: float, iters: int) -> Finding:
    replay_s = _time_replays(graph, ordinary, iters)
    slowdown = replay_s / full_s
    return {
        "replay_s": replay_s,
        "slowdown": round(slowdown, 2),
        "partition_in_graph": slowdown >= PARTITION_SLOWDOWN,
    }


def _signature(fn: Any) -> str:
    try:
        return str(inspect.signature(fn))
    except (
        TypeError,
        ValueError,
    ):  # a pybind11 function: its docstring's first line is the signature
        return (getattr(fn, "__doc__", None) or "?").strip().splitlines()[0]
