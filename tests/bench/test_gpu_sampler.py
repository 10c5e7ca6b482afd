"""bench/gpu_sampler: NVML readings summarized per window, against a stand-in of nvidia-ml-py (the
GPU's readings are gpu_check's interference step), and the benchmark going on without NVML."""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import pytest

from bench.gpu_sampler import GpuSampler, readings
from bench.interference import served_gpu


class FakeNvml:
    """The calls of nvidia-ml-py that GpuSampler makes, on one GPU that reports fixed values."""

    NVML_CLOCK_SM, NVML_TEMPERATURE_GPU, NVML_SUCCESS = 1, 0, 0
    NVML_GPM_METRICS_GET_VERSION, NVML_GPM_METRIC_DRAM_BW_UTIL, NVML_GPM_METRIC_SM_UTIL = 1, 10, 2

    def __init__(self, gpm: bool = True, temperature: bool = True) -> None:
        self.gpm, self.temperature = gpm, temperature
        self.calls: list[str] = []
        self.clocks = iter([1980, 1980, 1755])
        self.gpm_taken = 0

    def nvmlInit(self) -> None:
        self.calls.append("init")

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return f"gpu{index}"

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        return uuid

    def nvmlDeviceGetName(self, handle: str) -> bytes:
        return b"NVIDIA H200"

    def nvmlDeviceGetClockInfo(self, handle: str, clock: int) -> int:
        assert clock == self.NVML_CLOCK_SM
        return next(self.clocks, 1755)

    def nvmlDeviceGetPowerUsage(self, handle: str) -> int:
        return 512_000  # mW

    def nvmlDeviceGetTemperature(self, handle: str, sensor: int) -> int:
        if not self.temperature:
            raise RuntimeError("NVMLError_NotSupported")
        return 51

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: str) -> int:
        return 0x4 | 0x1  # the power cap (named) and idle (not named)

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> SimpleNamespace:
        return SimpleNamespace(gpu=97, memory=61)

    def nvmlGpmQueryDeviceSupport(self, handle: str) -> SimpleNamespace:
        return SimpleNamespace(isSupportedDevice=int(self.gpm))

    def nvmlGpmSampleAlloc(self) -> list:
        return []

    def nvmlGpmSampleGet(self, handle: str, sample: list) -> None:
        self.gpm_taken += 1
        sample[:] = [self.gpm_taken]

    def nvmlGpmSampleFree(self, sample: list) -> None:
        self.calls.append("free")

    def c_nvmlGpmMetricsGet_t(self) -> SimpleNamespace:
        return SimpleNamespace(
            metrics=[SimpleNamespace(metricId=0, value=0.0, nvmlReturn=0) for _ in range(4)]
        )

    def nvmlGpmMetricsGet(self, ask: SimpleNamespace) -> None:
        assert ask.version == 1 and ask.numMetrics == 2 and ask.sample1[0] + 1 == ask.sample2[0], (
            "earlier, later"
        )
        values = {self.NVML_GPM_METRIC_DRAM_BW_UTIL: 48.5, self.NVML_GPM_METRIC_SM_UTIL: 88.0}
        for m in ask.metrics[:2]:
            m.value = values[m.metricId]


def sampled(monkeypatch: pytest.MonkeyPatch, nvml: FakeNvml, count: int = 6) -> GpuSampler:
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    sampler = GpuSampler("0", interval_s=0.005)
    while len(sampler.samples) < count:
        time.sleep(0.005)
    sampler.close()
    return sampler


def test_each_window_has_the_median_and_extremes_of_the_readings_taken_in_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nvml = FakeNvml()
    sampler = sampled(monkeypatch, nvml)
    assert sampler.error is None and sampler.name == "NVIDIA H200"
    whole = sampler.window([(0.0, float("inf"))])
    assert whole["samples"] == len(sampler.samples) >= 6
    assert whole["sm_clock_mhz"] == {"median": 1755, "min": 1755, "max": 1980}
    assert whole["power_w"]["median"] == 512.0 and whole["temp_c"]["max"] == 51
    assert whole["mem_busy_pct"]["median"] == 61 and whole["gpu_busy_pct"]["median"] == 97
    assert whole["dram_bw_pct"]["median"] == 48.5 and whole["sm_busy_pct"]["median"] == 88.0
    assert whole["slowdowns"] == ["sw power cap"]
    first, second = sampler.samples[0][0], sampler.samples[1][0]
    early = sampler.window([(first, second)])
    assert early["samples"] == 1 and early["sm_clock_mhz"]["median"] == 1980
    assert (
        sampler.window([(first, second), (second, second + 1e-9)])["samples"] == 2
    )  # several spans: one window
    assert nvml.calls[0] == "init" and nvml.calls[-3:] == ["free", "free", "shutdown"]
    found = readings(sampler, {"beside": [(0.0, float("inf"))]})
    assert found["device"] == "NVIDIA H200" and found["windows"]["beside"] == whole


def test_a_reading_the_device_does_not_give_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    sampler = sampled(monkeypatch, FakeNvml(gpm=False, temperature=False), count=2)
    window = sampler.window([(0.0, float("inf"))])
    assert "temp_c" not in window and "dram_bw_pct" not in window and "sm_busy_pct" not in window
    assert window["sm_clock_mhz"]["max"] == 1980 and window["mem_busy_pct"]["median"] == 61


def test_without_nvml_the_sampler_reads_nothing_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(
        sys.modules, "pynvml", None
    )  # import pynvml raises ImportError, as on this CPU
    sampler = GpuSampler("0")
    sampler.close()
    assert sampler.error.startswith("no NVML: ModuleNotFoundError") and sampler.samples == []
    assert readings(sampler, {"beside": []}) == {"error": sampler.error}
    assert readings(None, {}) == {"error": "no GPU: the server runs on the CPU"}


def test_the_served_gpu_is_the_gpus_index_into_the_visible_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert served_gpu(["--policy", "pd"]) == "0" and served_gpu(["--gpus", "1"]) == "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,GPU-abc")
    assert served_gpu(["--gpus", "0"]) == "3" and served_gpu(["--gpus", "1,0"]) == "GPU-abc"
