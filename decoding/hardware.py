"""Hardware counters, sampled in a background thread (never inline in the decode step).

NVML calls serialize in the driver, and even psutil reads /proc: the decode loop only copies the
latest snapshot (`HardwareMonitor.read()`), which costs a few hundred nanoseconds. Every counter has
a neutral value and an availability flag, so a missing counter is never NaN.
"""
from __future__ import annotations

import math
import os
import platform
import re
import sys
import threading
import time
from dataclasses import dataclass

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
    "hw_cpu_other_util",
    "hw_cpu_steal",
    "hw_run_queue_per_core",
    "hw_preempt_rate_log",
)
_IDX = {name: i for i, name in enumerate(HW_FEATURES)}
NEUTRAL = {"hw_sm_clock_ratio": 1.0, "hw_cpu_freq_ratio": 1.0}
"""A counter's value where it is not read (every other counter: 0)."""
CO_RUNNING = ("hw_cpu_other_util", "hw_cpu_steal", "hw_run_queue_per_core", "hw_preempt_rate_log")
"""The CPU counters that reveal a co-running load (what other processes, or the hypervisor, take from this one)."""
WINDOW_S = 1.0
"""The co-running counters are rates over about the last second (the kernel counts CPU time in 10 ms ticks)."""
LOAD_READING = "tasks-damped-1s"
"""What `hw_load_per_core` reads, as a profile records it (`load_reading`): runnable + blocked tasks per core damped
with a one-second time constant (`damped_load`). Counters recorded without it read the one-minute load average."""


def neutral_counters() -> np.ndarray:
    """Every counter at its neutral value (what a missing counter reads)."""
    return np.array([NEUTRAL.get(name, 0.0) for name in HW_FEATURES], dtype=np.float32)


def counters_by_name(values, names=None) -> np.ndarray:
    """Recorded counters as this version's vector: `names` (a profile's `hardware_features`) gives their order; without
    it they are HW_FEATURES' first len(values) (a profile from before counters were added). A counter this
    version does not know is dropped; one the record lacks reads neutral."""
    out = neutral_counters()
    names = list(names) if names else list(HW_FEATURES[: len(values)])
    if len(names) != len(values):
        raise SpecPilotError(f"{len(values)} recorded counters for {len(names)} names")
    for name, value in zip(names, values):
        if name in _IDX:
            out[_IDX[name]] = float(value)
    return out

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


def cpu_cores() -> int:
    """The cores this process may run on (the affinity mask where the OS has one, else the CPU count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_key(name: str | None = None, cores: int | None = None) -> str:
    """This CPU's machine key, from its model and core count: 'AMD EPYC' on 2 cores -> 'cpu-amd-epyc-2c'.
    A CPU's profile, rules and policy live under it (the measured plain-step speed is recorded in the profile, and
    the benchmark warns when this machine's differs: `specpilot.bench.replay_check.machine_speed_warning`)."""
    model = re.sub(r"\((r|tm)\)|\b(cpu|processor)\b|@.*$", " ", (name or cpu_name()).lower())
    model = re.sub(r"[^a-z0-9]+", "-", model).strip("-") or "unknown"
    return f"cpu-{model}-{cores or cpu_cores()}c"


def is_cpu_key(key: str) -> bool:
    """'cpu' or a CPU machine key ('cpu-amd-epyc-2c')."""
    return key == "cpu" or key.startswith("cpu-")


def _cuda():
    """torch.cuda when a CUDA device is visible, else None (torch is imported here, not at module load)."""
    import torch

    try:
        return torch.cuda if torch.cuda.is_available() and torch.cuda.device_count() > 0 else None
    except Exception:
        return None


def gpu_names() -> list[str]:
    """Names of the CUDA devices visible to this process (CUDA_VISIBLE_DEVICES applies), in torch order."""
    cuda = _cuda()
    return [cuda.get_device_name(i) for i in range(cuda.device_count())] if cuda is not None else []


def device_key(hardware_name: str) -> str:
    """The short device name ('h200', 'a100', ...) for a GPU name as NVML reports it."""
    lower = hardware_name.lower()
    for key in KNOWN_GPUS:
        if re.search(rf"(?<![a-z0-9]){key}(?![0-9])", lower):
            return key
    return re.sub(r"[^a-z0-9]+", "-", lower).strip("-") or "gpu"


@dataclass(frozen=True)
class Device:
    """One resolved device: what every entry point uses (`resolve`)."""

    key: str
    """The machine key of policies, profiles and rules: 'cpu-amd-epyc-2c' (CPU model and cores), 'h100', 'a100', ..."""
    torch: str
    """The torch device: 'cpu' or 'cuda:N' (N counts the visible devices, as torch does)."""
    name: str
    """The hardware's own name (CPU model, or the GPU's name)."""


def resolve(requested: str) -> Device:
    """The one device resolver of every command: 'auto' (the first visible GPU, else the CPU), 'cpu',
    'cuda', 'cuda:N', or a device key such as 'h100' (the first visible GPU of that kind). Visible means
    as torch sees them, so CUDA_VISIBLE_DEVICES applies; NVML is never needed to resolve a device."""
    requested = str(requested).strip().lower()
    if is_cpu_key(requested):
        here = cpu_key()
        if requested not in ("cpu", here):
            raise SpecPilotError(f"--device {requested} is not this machine: its CPU is {here} ({cpu_name()}, "
                                 f"{cpu_cores()} cores); pass --device cpu")
        return Device(here, "cpu", cpu_name())
    names = gpu_names()
    if requested == "auto":
        return Device(device_key(names[0]), "cuda:0", names[0]) if names else Device(cpu_key(), "cpu", cpu_name())
    if requested == "cuda" or requested.startswith("cuda:"):
        index = requested.partition(":")[2] or "0"
        if not names:
            raise SpecPilotError(f"--device {requested}: CUDA is not available on this machine (CPU {cpu_name()})")
        if not index.isdigit() or int(index) >= len(names):
            raise SpecPilotError(f"--device {requested}: {len(names)} CUDA device(s) visible (cuda:0..cuda:{len(names) - 1})")
        i = int(index)
        return Device(device_key(names[i]), f"cuda:{i}", names[i])
    for i, name in enumerate(names):
        if device_key(name) == requested:
            return Device(requested, f"cuda:{i}", name)
    found = ", ".join(f"cuda:{i} {n} ({device_key(n)})" for i, n in enumerate(names)) if names else f"no GPU, CPU {cpu_name()}"
    raise SpecPilotError(f"--device {requested} is not present on this machine; found: {found}")


def artifact_key(requested: str) -> str:
    """The machine key whose artifacts (profile, rules, policy) a replay-only command reads: 'cpu' and 'auto' mean
    this machine's (`resolve`); any other key (say 'a100' on a CPU machine, or another CPU's key) is taken as given."""
    requested = str(requested).strip().lower()
    return resolve(requested).key if requested in ("cpu", "auto") else requested


def resolve_device(requested: str) -> tuple[str, str]:
    """(device key, hardware name) of `resolve(requested)`."""
    device = resolve(requested)
    return device.key, device.name


def nvml_handle(nvml, torch_device: str):
    """The NVML handle of a torch CUDA device, matched by PCI bus id (then UUID): NVML counts physical
    GPUs, torch the visible ones, so under CUDA_VISIBLE_DEVICES=3 torch's cuda:0 is NVML's GPU 3."""
    index = int(str(torch_device).partition(":")[2] or 0)
    props = _cuda().get_device_properties(index)
    errors = []
    try:
        bus_id = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
        return nvml.nvmlDeviceGetHandleByPciBusId(bus_id.encode())
    except Exception as exc:  # NVML raises its own error classes
        errors.append(f"PCI bus id: {type(exc).__name__}")
    try:
        uuid = str(props.uuid)
        return nvml.nvmlDeviceGetHandleByUUID((uuid if uuid.startswith("GPU-") else "GPU-" + uuid).encode())
    except Exception as exc:
        errors.append(f"UUID: {type(exc).__name__}")
    raise RuntimeError(f"no NVML device matches {torch_device} ({'; '.join(errors)})")


def _proc_stat() -> tuple[list[int], int, int] | None:
    """(the first line's CPU jiffies, procs_running, procs_blocked) of /proc/stat; None where there is none (not
    Linux)."""
    try:
        with open("/proc/stat") as f:
            text = f.read()
    except OSError:
        return None
    lines = text.split("\n")
    running = next((int(line.split()[1]) for line in lines if line.startswith("procs_running")), 0)
    blocked = next((int(line.split()[1]) for line in lines if line.startswith("procs_blocked")), 0)
    return [int(x) for x in lines[0].split()[1:9]], running, blocked


def damped_load(load: float | None, tasks: float, dt: float, tau: float = WINDOW_S) -> float:
    """The kernel's load average (runnable + uninterruptible tasks, exponentially damped) with a time constant of
    `tau` seconds instead of its one minute: after a step in the tasks it has moved 1 - 1/e of the way in `tau`
    seconds, whatever the polling interval `dt`. The first reading (`load` None) is the tasks themselves."""
    if load is None:
        return float(tasks)
    return float(tasks) + (load - float(tasks)) * math.exp(-max(dt, 0.0) / tau)


def _own_preemptions() -> int:
    """Involuntary context switches of this process's threads so far (Linux; 0 elsewhere)."""
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/status") as f:
                for line in f:
                    if line.startswith("nonvoluntary_ctxt_switches"):
                        total += int(line.split()[1])
                        break
        except OSError:
            pass  # a thread that ended
    return total


class _CpuBackend:
    """psutil's utilisation and frequency, the load per core damped over about a second (Linux; elsewhere the
    one-minute load average), and (Linux) what a co-running load takes: the share of the
    machine's CPU time other processes used (/proc/stat's busy time less this process's own), the hypervisor's steal,
    the run queue per core, and how often this process's threads were preempted, each over about the last second."""

    def __init__(self) -> None:
        import psutil  # only the CPU backend needs it

        self.psutil = psutil
        psutil.cpu_percent(interval=None)
        self.cores = os.cpu_count() or 1
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.history: list[tuple[float, list[int], float, int]] = []
        self.running: list[int] = []
        self.load: float | None = None
        """Runnable + blocked tasks, damped over about the last second (`damped_load`): `hw_load_per_core` x cores."""

    def _co_running(self, out: np.ndarray) -> None:
        stat = _proc_stat()
        if stat is None:
            return
        jiffies, running, blocked = stat
        now = (time.monotonic(), jiffies, time.process_time(), _own_preemptions())
        self.load = damped_load(self.load, running + blocked, now[0] - self.history[-1][0] if self.history else 0.0)
        out[_IDX["hw_load_per_core"]] = self.load / self.cores
        self.history.append(now)
        self.running = (self.running + [running])[-10:]
        while len(self.history) > 2 and now[0] - self.history[1][0] >= WINDOW_S:
            del self.history[0]
        out[_IDX["hw_run_queue_per_core"]] = sum(self.running) / len(self.running) / self.cores
        (t0, j0, own0, pre0), (t1, j1, own1, pre1) = self.history[0], now
        delta = [b - a for a, b in zip(j0, j1)]
        total = sum(delta)
        if total <= 0 or t1 <= t0:
            return
        busy = total - delta[3] - delta[4]  # less idle and iowait
        out[_IDX["hw_cpu_other_util"]] = min(1.0, max(0.0, (busy / self.tick - (own1 - own0)) / (total / self.tick)))
        out[_IDX["hw_cpu_steal"]] = delta[7] / total if len(delta) > 7 else 0.0
        out[_IDX["hw_preempt_rate_log"]] = float(np.log1p(max(0, pre1 - pre0) / (t1 - t0) / 100.0))

    def sample(self, out: np.ndarray) -> None:
        ps = self.psutil
        out[_IDX["hw_cpu_available"]] = 1.0
        self._co_running(out)
        out[_IDX["hw_cpu_util"]] = ps.cpu_percent(interval=None) / 100.0
        try:
            freq = ps.cpu_freq()
            out[_IDX["hw_cpu_freq_ratio"]] = freq.current / freq.max if freq and freq.max else 1.0
        except Exception:
            out[_IDX["hw_cpu_freq_ratio"]] = 1.0
        if self.load is None:  # no /proc/stat (not Linux): the kernel's one-minute load average
            try:
                out[_IDX["hw_load_per_core"]] = os.getloadavg()[0] / self.cores
            except OSError:
                out[_IDX["hw_load_per_core"]] = 0.0


class _NvmlBackend:
    def __init__(self, nvml, handle) -> None:
        self.nvml = nvml
        self.handle = handle
        try:
            self.max_clock = max(1, nvml.nvmlDeviceGetMaxClockInfo(self.handle, nvml.NVML_CLOCK_SM))
        except Exception:
            self.max_clock = 0  # no ratio to report: the clock counter keeps its neutral 1.0
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
            if self.max_clock:
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
        self._latest = neutral_counters()
        self._backends = [_CpuBackend()]
        self.hardware_name = cpu_name()
        if str(device).startswith("cuda"):
            self.hardware_name = resolve(device).name
            nvml = _nvml()
            try:
                if nvml is None:
                    raise RuntimeError("NVML did not initialise: no driver library, or pynvml missing")
                self._backends.append(_NvmlBackend(nvml, nvml_handle(nvml, device)))
            except Exception as exc:  # counters unavailable: their flags stay 0, decoding goes on
                _warn_once(f"warning: no GPU counters for {device} ({exc}); hw_is_gpu and the GPU counters read 0")
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


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        print(message, file=sys.stderr)


_MONITORS: dict[str, HardwareMonitor] = {}


def shared_monitor(device: str = "cpu") -> HardwareMonitor:
    """The process-wide, started monitor of a device (one polling thread per device)."""
    key = str(device)
    if key not in _MONITORS:
        _MONITORS[key] = HardwareMonitor(key).start()
    return _MONITORS[key]


def device_of(torch_device: str) -> tuple[str, str]:
    """(device key, hardware name) of a torch device string ('cpu', 'cuda', 'cuda:1')."""
    return resolve_device(str(torch_device))


def torch_device_of(device: str) -> str:
    """The torch device for --device (see `resolve`)."""
    return resolve(device).torch
