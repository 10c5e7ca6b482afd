"""NVML readings of one GPU while a benchmark measures (`ppd bench interference`), summarized per
time window.

A background thread reads, every SAMPLE_S, what nvidia-ml-py (`pynvml`) gives cheaply:
- sm_clock_mhz: nvmlDeviceGetClockInfo(NVML_CLOCK_SM), the SM clock at that moment;
- mem_busy_pct: nvmlDeviceGetUtilizationRates().memory, the share of the driver's last sample period
  (1/6 s to 1 s by product) in which device memory was read or written: a duty cycle, not a
  throughput;
- gpu_busy_pct: nvmlDeviceGetUtilizationRates().gpu, the share of that period in which some kernel
  ran;
- dram_bw_pct and sm_busy_pct: GPM (GPU performance monitoring, Hopper and later, where
  nvmlGpmQueryDeviceSupport says so): DRAM bandwidth used between two readings as a percentage of
  the theoretical peak (the memory throughput), and the share of SMs busy; absent where the device
  has no GPM;
- power_w: nvmlDeviceGetPowerUsage (on recent GPUs an average over about a second); temp_c: the
  GPU's temperature;
- slowdowns: nvmlDeviceGetCurrentClocksEventReasons, why the clocks sit below their maximum (power
  cap, thermal). A reading that fails is left out of its sample. Without NVML (no nvidia-ml-py, no
  driver: the CPU) the sampler reads nothing and says why, and the benchmark runs on.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

SAMPLE_S = 0.1
METRICS = (
    "sm_clock_mhz",
    "mem_busy_pct",
    "gpu_busy_pct",
    "dram_bw_pct",
    "sm_busy_pct",
    "power_w",
    "temp_c",
)
SLOWDOWNS = {
    0x4: "sw power cap",
    0x8: "hw slowdown",
    0x20: "sw thermal",
    0x40: "hw thermal",
    0x80: "hw power brake",
}  # nvmlClocksEventReason* bits worth naming (idle and app clocks are not)


class GpuSampler:
    """Reads the GPU that gpu names (a CUDA_VISIBLE_DEVICES entry: an index or a UUID) every
    SAMPLE_S until close(); window(spans) summarizes the samples taken inside them. error says
    why nothing is read."""

    def __init__(self, gpu: str, interval_s: float = SAMPLE_S) -> None:
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.error: str | None = None
        self.name = ""
        self.interval_s, self.stop = interval_s, threading.Event()
        self.thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - ImportError, or NVMLError without a driver: either way no NVML
            self.error = f"no NVML: {type(exc).__name__}: {exc}"
            return
        self.nvml = pynvml
        try:
            self.handle = (
                pynvml.nvmlDeviceGetHandleByUUID(gpu)
                if gpu.startswith("GPU-")
                else pynvml.nvmlDeviceGetHandleByIndex(int(gpu))
            )
            name = pynvml.nvmlDeviceGetName(self.handle)
            self.name = name.decode() if isinstance(name, bytes) else name
        except Exception as exc:  # noqa: BLE001
            self.error = f"NVML has no GPU {gpu}: {type(exc).__name__}: {exc}"
            pynvml.nvmlShutdown()
            return
        self.gpm = self._gpm_samples()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _gpm_samples(self) -> list | None:
        """Two GPM sample buffers where the device supports GPM, else None."""
        nvml = self.nvml
        try:
            if not nvml.nvmlGpmQueryDeviceSupport(self.handle).isSupportedDevice:
                return None
            samples = [nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()]
            nvml.nvmlGpmSampleGet(self.handle, samples[0])
            return samples
        except Exception:  # noqa: BLE001 - an older driver or nvidia-ml-py: no GPM
            return None

    def _read(self) -> None:
        nvml, handle = self.nvml, self.handle
        reasons = getattr(
            nvml,
            "nvmlDeviceGetCurrentClocksEventReasons",  # its older name in older nvidia-ml-py
            getattr(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None),
        )
        reads = {
            "sm_clock_mhz": lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
            "power_w": lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000,
            "temp_c": lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
            "slowdowns": lambda: reasons(handle),
        }
        while not self.stop.wait(self.interval_s):
            sample: dict[str, float] = {}
            for key, read in reads.items():
                try:
                    sample[key] = read()
                except Exception:  # noqa: BLE001 - a reading the device does not give
                    continue
            try:
                rates = nvml.nvmlDeviceGetUtilizationRates(handle)
                sample.update(mem_busy_pct=rates.memory, gpu_busy_pct=rates.gpu)
            except Exception:  # noqa: BLE001
                pass
            sample.update(self._gpm_metrics())
            self.samples.append((time.monotonic(), sample))

    def _gpm_metrics(self) -> dict[str, float]:
        """DRAM bandwidth and SM busy (%) between the previous GPM sample and a new one."""
        if self.gpm is None:
            return {}
        nvml = self.nvml
        try:
            nvml.nvmlGpmSampleGet(self.handle, self.gpm[1])
        except Exception:  # noqa: BLE001
            return {}
        earlier, latest = self.gpm
        self.gpm.reverse()  # the latest sample is where the next reading starts
        try:
            ask = nvml.c_nvmlGpmMetricsGet_t()
            ask.version, ask.numMetrics = nvml.NVML_GPM_METRICS_GET_VERSION, 2
            ask.sample1, ask.sample2 = earlier, latest
            ask.metrics[0].metricId = nvml.NVML_GPM_METRIC_DRAM_BW_UTIL
            ask.metrics[1].metricId = nvml.NVML_GPM_METRIC_SM_UTIL
            nvml.nvmlGpmMetricsGet(ask)
        except Exception:  # noqa: BLE001
            return {}
        return {
            key: m.value
            for key, m in zip(("dram_bw_pct", "sm_busy_pct"), ask.metrics[:2])
            if m.nvmlReturn == nvml.NVML_SUCCESS
        }

    def window(self, spans: list[tuple[float, float]]) -> dict[str, Any]:
        """The samples taken inside any of spans ([start, end) in time.monotonic()): their count,
        and per metric its median, min and max; the slowdowns seen, by name."""
        inside = [s for t, s in self.samples if any(a <= t < b for a, b in spans)]
        found: dict[str, Any] = {"samples": len(inside)}
        for key in METRICS:
            values = [s[key] for s in inside if key in s]
            if values:
                found[key] = {
                    "median": statistics.median(values),
                    "min": min(values),
                    "max": max(values),
                }
        bits = 0
        for s in inside:
            bits |= int(s.get("slowdowns", 0))
        found["slowdowns"] = [name for bit, name in SLOWDOWNS.items() if bits & bit]
        return found

    def close(self) -> None:
        """Stop reading and let NVML go (the samples stay)."""
        if self.thread is None:
            return
        self.stop.set()
        self.thread.join()
        self.thread = None
        for sample in self.gpm or ():
            try:
                self.nvml.nvmlGpmSampleFree(sample)
            except Exception:  # noqa: BLE001
                pass
        self.nvml.nvmlShutdown()


def readings(sampler: GpuSampler | None, windows: dict[str, list[tuple[float, float]]]) -> dict:
    """NVML's readings in each window (name -> its spans), or why there are none."""
    if sampler is None:
        return {"error": "no GPU: the server runs on the CPU"}
    if sampler.error:
        return {"error": sampler.error}
    return {
        "device": sampler.name,
        "sample_s": sampler.interval_s,
        "windows": {name: sampler.window(spans) for name, spans in windows.items()},
    }


def markdown(read: dict[str, dict]) -> list[str]:
    """A table of readings (name -> what readings() gave), a row per name and window, and why a name
    has none."""
    if not read:
        return []
    lines = [
        "",
        "## The GPU in each window (NVML)",
        "",
        f"Read every {SAMPLE_S} s by a thread of the benchmark (`bench/gpu_sampler.py`). SM clock: "
        "the clock at each "
        "reading. Memory busy: the share of time device memory was read or written (NVML's "
        "utilization, a duty "
        "cycle). DRAM bandwidth: the bandwidth used as a share of the peak, and SMs busy (GPM, "
        "where the GPU "
        "has it). Windows: the long prompts alone, decode alone, and the long prompts beside "
        "decode.",
        "",
    ]
    errors = {name: g["error"] for name, g in read.items() if "error" in g}
    if len(errors) < len(read):
        lines += [
            "| config | window | samples | SM clock MHz, median (min) | memory busy %, median | "
            "DRAM bandwidth "
            "% of peak, median (max) | SMs busy %, median | power W, median (max) | temperature C, "
            "max "
            "| slowdowns |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
    for name, g in read.items():
        for window, w in g.get("windows", {}).items():
            lines.append(
                f"| {name} | {window} | {w['samples']} | {_stat(w, 'sm_clock_mhz', 'min')} | "
                f"{_stat(w, 'mem_busy_pct')} | {_stat(w, 'dram_bw_pct', 'max', 1)} | "
                f"{_stat(w, 'sm_busy_pct', digits=1)} | {_stat(w, 'power_w', 'max')} | "
                f"{_stat(w, 'temp_c', first='max')} | {', '.join(w['slowdowns']) or '-'} |"
            )
    for why in sorted(set(errors.values())):
        if lines[-1]:
            lines.append("")
        lines.append(
            f"No readings for {', '.join(n for n, e in errors.items() if e == why)}: {why}."
        )
    return lines


def _stat(
    window: dict, key: str, second: str | None = None, digits: int = 0, first: str = "median"
) -> str:
    """A metric of a window's summary: its first statistic, and the second in brackets; - where it
    was not read."""
    if key not in window:
        return "-"
    text = f"{window[key][first]:.{digits}f}"
    return text + (f" ({window[key][second]:.{digits}f})" if second else "")
