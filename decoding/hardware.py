"""Hardware counters, sampled in a background thread (never inline in the decode step).

NVML calls serialize in the driver, and even psutil reads /proc: the decode loop only copies the
latest snapshot (`HardwareMonitor.read()`), which costs a few hundred nanoseconds. Every counter has
a neutral value and an availability flag, so a missing counter is never NaN.
"""
from __future__ import annotations

import os
import platform
import re
import threading

import numpy as np

from .errors import SpecPilotError

HW_FEATURES = (
    "hw_is_gpu",
    "hw_gpu_util",
    "hw_gpu_mem_util",
    "hw_sm_clock_ratio",
    "hw_power_ratio",
    "hw_temperature",
    "hw_gpm_available",
    "hw_gpm_dram_bw_util",
    "hw_gpm_sm_occupancy",
    "hw_cpu_available",
    "hw_cpu_util",
    "hw_cpu_freq_ratio",
    "hw_load_per_core",
)
_IDX = {name: i for i, name in enumerate(HW_FEATURES)}

# NVML names -> the device names of --device (lowercase key fragments, checked in order)
KNOWN_GPUS = ("h200", "h100", "h20", "gh200", "b200", "a100", "a10g", "a10", "l40s", "l40", "l4", "a6000", "v100", "t4", "4090", "3090")


def _nvml():
    try:
        import pynvml  # optional at run time: no NVIDIA driver on a CPU machine

        pynvml.nvmlInit()
        return pynvml
    except Exception:
        return None


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def gpu_names() -> list[str]:
    """Names of the NVIDIA GPUs NVML reports (empty without a driver)."""
    nvml = _nvml()
    if nvml is None:
        return []
    names = []
    for i in range(nvml.nvmlDeviceGetCount()):
        name = nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(i))
        names.append(name.decode() if isinstance(name, bytes) else name)
    return names


def device_key(hardware_name: str) -> str:
    """The short device name ('h200', 'a100', ...) for a GPU name as NVML reports it."""
    lower = hardware_name.lower()
    for key in KNOWN_GPUS:
        if re.search(rf"(?<![a-z0-9]){key}(?![0-9])", lower):
            return key
    return re.sub(r"[^a-z0-9]+", "-", lower).strip("-") or "gpu"


def resolve_device(requested: str) -> tuple[str, str]:
    """(device key, hardware name) for --device; 'auto' picks the first GPU, else the CPU.

    A named device that is not present is an error naming what was found.
    """
    requested = requested.strip().lower()
    gpus = gpu_names()
    if requested == "auto":
        return (device_key(gpus[0]), gpus[0]) if gpus else ("cpu", cpu_name())
    if requested == "cpu":
        return "cpu", cpu_name()
    for name in gpus:
        if device_key(name) == requested:
            return requested, name
    found = ", ".join(f"{n} ({device_key(n)})" for n in gpus) if gpus else f"no GPU, CPU {cpu_name()}"
    raise SpecPilotError(f"--device {requested} is not present on this machine; found: {found}")


class _CpuBackend:
    def __init__(self) -> None:
        import psutil  # only the CPU backend needs it

        self.psutil = psutil
        psutil.cpu_percent(interval=None)
        self.cores = os.cpu_count() or 1

    def sample(self, out: np.ndarray) -> None:
        ps = self.psutil
        out[_IDX["hw_cpu_available"]] = 1.0
        out[_IDX["hw_cpu_util"]] = ps.cpu_percent(interval=None) / 100.0
        try:
            freq = ps.cpu_freq()
            out[_IDX["hw_cpu_freq_ratio"]] = freq.current / freq.max if freq and freq.max else 1.0
        except Exception:
            out[_IDX["hw_cpu_freq_ratio"]] = 1.0
        try:
            out[_IDX["hw_load_per_core"]] = os.getloadavg()[0] / self.cores
        except OSError:
            out[_IDX["hw_load_per_core"]] = 0.0


class _NvmlBackend:
    def __init__(self, nvml, index: int) -> None:
        self.nvml = nvml
        self.handle = nvml.nvmlDeviceGetHandleByIndex(index)
        self.max_clock = max(1, nvml.nvmlDeviceGetMaxClockInfo(self.handle, nvml.NVML_CLOCK_SM))
        try:
            self.power_limit = nvml.nvmlDeviceGetEnforcedPowerLimit(self.handle)
        except Exception:
            self.power_limit = 0
        self.gpm = self._gpm_setup()

    def _gpm_setup(self):
        """Hopper and newer: GPM metrics (DRAM bandwidth, SM occupancy) from two samples."""
        nvml = self.nvml
        try:
            support = nvml.nvmlGpmQueryDeviceSupport(self.handle)
            if not support.isSupportedDevice:
                return None
            samples = [nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()]
            nvml.nvmlGpmSampleGet(self.handle, samples[0])
            return samples
        except Exception:
            return None

    def _gpm_read(self) -> tuple[float, float] | None:
        nvml = self.nvml
        try:
            previous, current = self.gpm
            nvml.nvmlGpmSampleGet(self.handle, current)
            metrics = nvml.c_nvmlGpmMetricsGet_t()
            metrics.version = nvml.NVML_GPM_METRICS_GET_VERSION
            metrics.numMetrics = 2
            metrics.sample1 = previous
            metrics.sample2 = current
            metrics.metrics[0].metricId = nvml.NVML_GPM_METRIC_DRAM_BW_UTIL
            metrics.metrics[1].metricId = nvml.NVML_GPM_METRIC_SM_OCCUPANCY
            nvml.nvmlGpmMetricsGet(metrics)
            self.gpm = [current, previous]
            return metrics.metrics[0].value / 100.0, metrics.metrics[1].value / 100.0
        except Exception:
            self.gpm = None
            return None

    def sample(self, out: np.ndarray) -> None:
        nvml, h = self.nvml, self.handle
        out[_IDX["hw_is_gpu"]] = 1.0
        try:
            util = nvml.nvmlDeviceGetUtilizationRates(h)
            out[_IDX["hw_gpu_util"]] = util.gpu / 100.0
            out[_IDX["hw_gpu_mem_util"]] = util.memory / 100.0
        except Exception:
            pass
        try:
            out[_IDX["hw_sm_clock_ratio"]] = nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM) / self.max_clock
        except Exception:
            out[_IDX["hw_sm_clock_ratio"]] = 1.0
        if self.power_limit:
            try:
                out[_IDX["hw_power_ratio"]] = nvml.nvmlDeviceGetPowerUsage(h) / self.power_limit
            except Exception:
                pass
        try:
            out[_IDX["hw_temperature"]] = nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU) / 100.0
        except Exception:
            pass
        if self.gpm is not None:
            values = self._gpm_read()
            if values is not None:
                out[_IDX["hw_gpm_available"]] = 1.0
                out[_IDX["hw_gpm_dram_bw_util"]], out[_IDX["hw_gpm_sm_occupancy"]] = values


class HardwareMonitor:
    """Samples the counters of one device every `interval_s` in a daemon thread."""

    names = HW_FEATURES

    def __init__(self, device: str = "cpu", interval_s: float = 0.1):
        self.interval_s = interval_s
        self._latest = np.zeros(len(HW_FEATURES), dtype=np.float32)
        self._latest[_IDX["hw_sm_clock_ratio"]] = 1.0
        self._latest[_IDX["hw_cpu_freq_ratio"]] = 1.0
        self._backends = [_CpuBackend()]
        self.hardware_name = cpu_name()
        if str(device).startswith("cuda"):
            nvml = _nvml()
            if nvml is not None:
                index = int(str(device).partition(":")[2] or 0)
                self._backends.append(_NvmlBackend(nvml, index))
                name = nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(index))
                self.hardware_name = name.decode() if isinstance(name, bytes) else name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.samples = 0
        self._poll()

    def _poll(self) -> None:
        values = self._latest.copy()
        for backend in self._backends:
            backend.sample(values)
        self._latest = values  # one reference swap: readers never see a half-written vector
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._poll()

    def start(self) -> "HardwareMonitor":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="specpilot-hw-monitor", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None

    def read(self) -> np.ndarray:
        return self._latest

    def __enter__(self) -> "HardwareMonitor":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


_MONITORS: dict[str, HardwareMonitor] = {}


def shared_monitor(device: str = "cpu") -> HardwareMonitor:
    """The process-wide, started monitor of a device (one polling thread per device)."""
    key = str(device)
    if key not in _MONITORS:
        _MONITORS[key] = HardwareMonitor(key).start()
    return _MONITORS[key]


def device_of(torch_device: str) -> tuple[str, str]:
    """(device key, hardware name) of a torch device string ('cpu', 'cuda', 'cuda:1')."""
    torch_device = str(torch_device)
    if not torch_device.startswith("cuda"):
        return "cpu", cpu_name()
    names = gpu_names()
    index = int(torch_device.partition(":")[2] or 0)
    if index >= len(names):
        raise SpecPilotError(f"torch device {torch_device} has no NVML entry (found {len(names)} GPUs)")
    return device_key(names[index]), names[index]


def torch_device_of(device: str) -> str:
    """The torch device for a device name: a device key ('cpu', 'h100', ...), 'auto', or a torch
    device string ('cuda', 'cuda:1') passed through. A key that is not present is an error."""
    device = str(device).strip().lower()
    if device.startswith("cuda"):
        return device
    key, _ = resolve_device(device)
    if key == "cpu":
        return "cpu"
    index = next(i for i, name in enumerate(gpu_names()) if device_key(name) == key)
    return f"cuda:{index}"
