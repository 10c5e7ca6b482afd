"""Pure functions of `ppd probe`'s findings: the overlap verdict, the partition verdict, and the
table on stdout.

No GPU and no I/O here, so every branch is tested with synthetic findings.
"""

from __future__ import annotations

from typing import Any

CONCURRENT_RATIO = 1.6  # at or above: the two kernels ran side by side (2.0 is perfect overlap)
TIME_SLICED_RATIO = 1.25  # at or below: one ran while the other waited (1.0 is none)
MAX_START_SKEW = (
    0.25  # launches further apart than this share of the shorter solo run prove nothing
)
PARTITION_SLOWDOWN = (
    2.0  # a 16-SM green context must run a full-GPU matmul at least this much slower to be real
)

# Issue 9's order of preference: two processes with runtime-switchable shares, then fixed MPS
# shares, then one process, then no partition at all.
MODES = ("green_in_mps", "mps_processes", "green_in_process", "time_sliced_only")


def overlap_verdict(sides: list[dict[str, Any]]) -> dict[str, Any]:
    """From two sides' {ok, solo_s, start, end}: ratio = sum of solo times / span, and concurrent,
    time-sliced or inconclusive with a reason."""
    failures = [side.get("error") or "no timings" for side in sides if not side.get("ok")]
    if len(sides) != 2 or failures:
        return _inconclusive(f"a side failed: {'; '.join(failures) or 'need two sides'}")
    solos = [side["solo_s"] for side in sides]
    starts = [side["start"] for side in sides]
    span = max(side["end"] for side in sides) - min(starts)
    skew = max(starts) - min(starts)
    found = {"solo_s": solos, "span_s": span, "start_skew_s": skew}
    if skew > MAX_START_SKEW * min(solos):
        return {**found, **_inconclusive(f"the launches were {skew * 1e3:.0f} ms apart")}
    if span <= 0:
        return {**found, **_inconclusive("no measurable span")}
    ratio = sum(solos) / span
    if ratio >= CONCURRENT_RATIO:
        verdict, reason = "concurrent", "both kernels ran at the same time"
    elif ratio <= TIME_SLICED_RATIO:
        verdict, reason = "time-sliced", "one kernel waited for the other"
    else:
        verdict, reason = "inconclusive", "partial overlap"
    return {
        **found,
        "ratio": round(ratio, 3),
        "verdict": verdict,
        "reason": f"{reason} (ratio {ratio:.2f})",
    }


def _inconclusive(reason: str) -> dict[str, Any]:
    return {"ratio": None, "verdict": "inconclusive", "reason": reason}


def green_is_real(green: dict[str, Any]) -> tuple[bool, str]:
    """Whether a green-context finding shows a real partition that also survives graph capture, and
    why (not)."""
    if not green.get("ok"):
        return False, f"green contexts failed: {_why(green)}"
    matmul, graph = green.get("matmul", {}), green.get("graph", {})
    slowdown = matmul.get("small_slowdown")
    if not slowdown or slowdown < PARTITION_SLOWDOWN:
        return (
            False,
            f"a {matmul.get('small_granted')}-SM green context ran a matmul only {slowdown}x "
            "slower",
        )
    if not (graph.get("matches_eager") and graph.get("keeps_partition")):
        return False, f"a graph captured on a green stream {_graph_problem(graph)}"
    return True, (
        f"{matmul.get('small_granted')} SMs granted, matmul {slowdown:.1f}x slower, "
        f"graph replay {graph.get('slowdown', 0):.1f}x slower and correct, two disjoint groups at "
        "once "
        f"{green.get('pair_overlap', {}).get('ratio')}x faster than in turn"
    )


def _graph_problem(graph: dict[str, Any]) -> str:
    if not graph.get("ok"):
        return f"failed: {_why(graph)}"
    if not graph.get("matches_eager"):
        return f"gave a wrong result (max diff {graph.get('max_abs_diff')})"
    return f"lost the partition (replay only {graph.get('slowdown')}x slower)"


def partition_verdict(report: dict[str, Any]) -> dict[str, Any]:
    """Which partition modes look usable, each with a one-line reason, and the preferred one (or
    "cpu"/"none")."""
    if not report.get("gpus"):
        listing = report.get("host", {}).get("torch_devices", {})
        if listing.get("ok") is False and not listing.get(
            "skipped"
        ):  # a GPU host whose devices could not be read
            preferred, reason = "none", f"could not list the CUDA devices: {_why(listing)}"
        else:
            preferred, reason = (
                "cpu",
                "no CUDA device" + (f" ({listing['skipped']})" if listing.get("skipped") else ""),
            )
        return {"preferred": preferred, "modes": {m: _mode(False, reason) for m in MODES}}
    modes = {
        "mps_processes": _mps_processes(report.get("mps", {})),
        "green_in_process": _mode(*green_is_real(report.get("green_contexts", {}))),
        "time_sliced_only": _time_sliced(report.get("ipc", {}), report.get("overlap", {})),
    }
    modes["green_in_mps"] = _green_in_mps(report.get("mps", {}), modes["mps_processes"])
    preferred = next((m for m in MODES if modes[m]["usable"]), "none")
    return {"preferred": preferred, "modes": {m: modes[m] for m in MODES}}


def _mode(usable: bool, reason: str) -> dict[str, Any]:
    return {"usable": usable, "reason": reason}


def _mps_processes(mps: dict[str, Any]) -> dict[str, Any]:
    if mps.get("skipped"):
        return _mode(False, f"MPS not probed: {mps['skipped']}")
    if not mps.get("daemon", {}).get("ok"):
        return _mode(False, f"our MPS daemon did not start: {_why(mps.get('daemon', mps))}")
    if not mps.get("client", {}).get("is_mps_client"):
        return _mode(False, "a client of our daemon did not run as an MPS client")
    under = mps.get("under_mps", {})
    if under.get("ok") is False:
        return _mode(False, f"the checks under our MPS daemon failed: {_why(under)}")
    overlap, ipc = under.get("overlap", {}), under.get("ipc", {})
    if overlap.get("verdict") != "concurrent":
        why = overlap.get("reason") or _why(overlap)
        return _mode(False, f"two MPS clients' kernels: {overlap.get('verdict')} ({why})")
    if not ipc.get("ok"):
        return _mode(False, f"CUDA IPC between MPS clients failed: {_why(ipc)}")
    return _mode(
        True,
        f"two MPS clients overlap (ratio {overlap.get('ratio')}) and share a tensor by CUDA IPC",
    )


def _green_in_mps(mps: dict[str, Any], mps_processes: dict[str, Any]) -> dict[str, Any]:
    if not mps_processes["usable"]:
        return _mode(False, f"needs MPS processes: {mps_processes['reason']}")
    usable, reason = green_is_real(mps.get("under_mps", {}).get("green_contexts", {}))
    return _mode(usable, f"inside an MPS client: {reason}")


def _time_sliced(ipc: dict[str, Any], overlap: dict[str, Any]) -> dict[str, Any]:
    if not ipc.get("ok"):
        return _mode(False, f"CUDA IPC between two processes failed: {_why(ipc)}")
    return _mode(
        True,
        f"two processes share a tensor by CUDA IPC; without MPS their kernels are "
        f"{overlap.get('verdict', 'unmeasured')} (ratio {overlap.get('ratio')})",
    )


def _why(finding: dict[str, Any]) -> str:
    return str(finding.get("error") or finding.get("skipped") or "no details")


# --- the table on stdout --------------------------------------------------------------------------


def render_table(report: dict[str, Any]) -> str:
    """The report as aligned "section facts" lines; a section that cannot be rendered says so
    instead."""
    lines = [f"ppd probe (schema {report.get('schema')})"]
    for title, render in (
        ("host", _host_rows),
        ("cpu", _cpu_rows),
        ("gpus", _gpu_rows),
        ("ipc", _ipc_rows),
        ("overlap", _overlap_rows),
        ("green_contexts", _green_rows),
        ("mps", _mps_rows),
        ("verdict", _verdict_rows),
    ):
        try:
            rows = render(report.get(title))
        except Exception as exc:  # a malformed section must not hide the others
            rows = [(title, f"(cannot render: {type(exc).__name__}: {exc})")]
        lines += [f"{label:<22} {text}" for label, text in rows]
    return "\n".join(lines)


Rows = list[tuple[str, str]]


def _host_rows(host: dict[str, Any]) -> Rows:
    rows = [
        (
            "host",
            f"{host.get('hostname')} · {host.get('cpu_count')} CPUs · Python {host.get('python')} "
            "· "
            f"torch {host.get('torch')} (CUDA {host.get('torch_cuda')}) · triton "
            f"{host.get('triton')} · "
            f"cuda-bindings {host.get('cuda_bindings')} · nvidia-ml-py {host.get('nvidia_ml_py')} "
            "· "
            f"CUDA_VISIBLE_DEVICES={host.get('cuda_visible_devices')}",
        )
    ]
    # Why no GPU was listed: reading them failed, or there was nothing to ask.
    for source in ("nvml", "torch_devices"):
        found = host.get(source, {})
        if found and not found.get("ok"):
            rows.append((source, _status(found)))
    return rows


def _cpu_rows(cpu: dict[str, Any]) -> Rows:
    if not cpu.get("ok"):
        return [("cpu", _status(cpu))]
    flags = " · ".join(
        f"{name} {'yes' if cpu.get('flags', {}).get(flag) else 'no'}"
        for flag, name in (
            ("avx2", "AVX2"),
            ("avx512f", "AVX-512F"),
            ("avx512_bf16", "AVX512-BF16"),
            ("amx_bf16", "AMX-BF16"),
        )
    )
    dtypes, kernels = cpu.get("dtype_auto", {}), cpu.get("kernels", {})
    built = (
        f"{kernels.get('build')} build ({' '.join(kernels.get('compile_flags', []))})"
        if kernels.get("library")
        else f"our kernels did not build ({kernels.get('error')}): PyTorch's"
    )
    amx = kernels.get("amx_linear_rows")
    linears = (
        f"bfloat16 linears of up to {amx} rows on AMX (cpu_amx.c)" if amx else "no AMX linears"
    )
    return [
        (
            "cpu",
            f"{cpu.get('model')} · {cpu.get('cpu_count')} CPUs ({cpu.get('affinity_cpus')} usable)",
        ),
        (
            "cpu (extensions)",
            f"{flags} · native bfloat16: {'yes' if cpu.get('native_bf16') else 'no'} · "
            f"PPD_CPU_ISA={cpu.get('ppd_cpu_isa')}",
        ),
        (
            "cpu (serve dtype)",
            f"--dtype auto: the demo in {dtypes.get('demo')}, a bfloat16 checkpoint in "
            f"{dtypes.get('bfloat16_checkpoint')}",
        ),
        ("cpu (serve kernels)", f"{built} · attention: {kernels.get('attention')} · {linears}"),
        (
            "cpu (serve bfloat16)",
            f"weights packed as {kernels.get('bfloat16_weights_packed_as')} for oneDNN · "
            f"prefill attention: {kernels.get('bfloat16_prefill_attention')}",
        ),
    ]


def _gpu_rows(gpus: list[dict[str, Any]]) -> Rows:
    if not gpus:
        return [("gpus", "none")]
    return [
        (
            f"gpu {g.get('index')}",
            f"{g.get('name')} · {g.get('sm_count')} SMs · cc {g.get('compute_capability')} · "
            f"{_mib(g.get('memory_total_bytes'))} total, {_mib(g.get('memory_used_bytes'))} used · "
            f"driver {g.get('driver_version')} (CUDA {g.get('cuda_driver_version')}) · MIG "
            f"{g.get('mig_mode')} · "
            f"compute mode {g.get('compute_mode')} · {g.get('uuid')}",
        )
        for g in gpus
    ]


def _ipc_rows(ipc: dict[str, Any], label: str = "ipc") -> Rows:
    if not ipc.get("ok"):
        return [(label, _status(ipc))]
    return [
        (
            label,
            f"ok · {_mib(ipc.get('bytes'))} · export {_s(ipc.get('export_s'))}, open "
            f"{_s(ipc.get('open_s'))}, "
            f"verify {_s(ipc.get('verify_a_s'))} / {_s(ipc.get('verify_b_s'))} · importer +"
            f"{_mib(ipc.get('importer_allocated_delta_bytes'))} allocated, +"
            f"{_mib(ipc.get('importer_free_delta_bytes'))} device memory, NVML "
            f"{_mib(ipc.get('importer_nvml_used_bytes'))} · "
            f"mapped, not copied: {ipc.get('mapped_not_copied')}",
        )
    ]


def _overlap_rows(overlap: dict[str, Any], label: str = "overlap (no MPS)") -> Rows:
    if not overlap.get("ok") and overlap.get("ratio") is None:
        return [(label, _status(overlap))]
    sleep = overlap.get("sleep", {})
    return [
        (
            label,
            f"{overlap.get('verdict')}: {overlap.get('spin', {}).get('reason')} · "
            f"sleep kernel: {sleep.get('verdict')} (ratio {sleep.get('ratio')})",
        )
    ]


def _green_rows(green: dict[str, Any], label: str = "green") -> Rows:
    api = green.get("torch_api", {})
    rows = (
        [
            (
                f"{label} (torch)",
                f"present {api.get('present')} · create{api.get('create_signature')} · "
                f".Stream {api.get('has_stream')}",
            )
        ]
        if api
        else []
    )
    if not green.get("ok"):
        return rows + [(label, _status(green))]
    real, reason = green_is_real(green)
    groups = green.get("groups", {})
    granted = ", ".join(
        f"{name} {g.get('requested')}->{g.get('granted')}" for name, g in groups.items()
    )
    pair = green.get("pair_sm_ids", {})
    ran = (
        ""
        if not pair
        else (
            f"pair ran on {pair.get('pair_a_sms')} + {pair.get('pair_b_sms')} SMs, "
            f"{pair.get('common_sms')} in common · "
            if pair.get("ok")
            else f"pair's SMs: {_status(pair)} · "
        )
    )
    return rows + [
        (label, f"{'real' if real else 'NOT real'}: {reason}"),
        (
            f"{label} (groups)",
            f"of {green.get('device_sm_count')} SMs: {granted} · {ran}"
            f"split rounding {green.get('split_rounding')}",
        ),
        (
            f"{label} (cleanup)",
            f"torch's context restored {green.get('context_restored')} · "
            f"errors {green.get('cleanup_errors')}",
        ),
    ]


def _mps_rows(mps: dict[str, Any]) -> Rows:
    if mps.get("skipped"):
        return [("mps", f"skipped: {mps['skipped']}")]
    existing = mps.get("existing", {})
    rows = [
        (
            "mps",
            f"{_status(mps)} · control binary {mps.get('control_binary')} · a daemon already "
            "running: "
            f"{existing.get('running')} · static partitions offered: "
            f"{mps.get('static_partitioning', {}).get('offered')}",
        ),
        (
            "mps (our daemon)",
            _status(mps.get("daemon", {})) + f" · stopped: {mps.get('stop', {}).get('stopped')}",
        ),
    ]
    client, half = mps.get("client", {}), mps.get("thread_percentage_50", {})
    if client:
        rows.append(
            (
                "mps (client)",
                f"{_status(client)} · is an MPS client: {client.get('is_mps_client')} · "
                f"SMs {client.get('sm_count')}, with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50: "
                f"{half.get('sm_count')}",
            )
        )
    under = mps.get("under_mps", {})
    if under.get("skipped"):
        rows.append(("mps (workloads)", f"skipped: {under['skipped']}"))
    elif under:
        rows += _ipc_rows(under.get("ipc", {}), "mps ipc") + _overlap_rows(
            under.get("overlap", {}), "mps overlap"
        )
        rows += _green_rows(under.get("green_contexts", {}), "mps green")
    return rows


def _verdict_rows(verdict: dict[str, Any]) -> Rows:
    rows = [("verdict", f"preferred: {verdict.get('preferred')}")]
    if verdict.get("preferred") == "cpu":  # no GPU: its partition modes are in the JSON, not here
        return rows
    for mode, found in verdict.get("modes", {}).items():
        rows.append(
            (f"  {mode}", f"{'yes' if found.get('usable') else 'no '}  {found.get('reason')}")
        )
    return rows


def _status(finding: dict[str, Any]) -> str:
    if finding.get("skipped"):
        return f"skipped: {finding['skipped']}"
    return "ok" if finding.get("ok") else f"FAILED: {finding.get('error')}"


def _mib(nbytes: Any) -> str:
    return f"{nbytes / 2**20:.0f} MiB" if isinstance(nbytes, (int, float)) else str(nbytes)


def _s(seconds: Any) -> str:
    return f"{seconds:.3f} s" if isinstance(seconds, (int, float)) else str(seconds)
