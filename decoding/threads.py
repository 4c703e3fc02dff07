"""Torch's CPU threads, following the cores other processes leave free.

Beside one busy core, two-thread plain decoding on a 2-core Intel Xeon took 757-915 ms a token instead of 43 ms:
OpenMP's barriers wait for the thread that shares its core with the other process, a whole time slice per parallel
region. Following the free cores it took 67-70 ms (`python -m specpilot.bench.threads`; reports/README.md, "A second
machine").
`ThreadGovernor.apply()`, called before every target pass of the loop, reads the share of the machine's CPU time
other processes took (the hardware monitor's `hw_cpu_other_util`, polled in its own thread, rates over about a
second) and sets torch's thread count to the cores they leave free: one array read when nothing changes. The
tokens do not depend on it here (tests/test_threads.py; the benchmark's `same tokens`).
"""
from __future__ import annotations

import torch

from .hardware import HW_FEATURES, cpu_cores, shared_monitor

_OTHER = HW_FEATURES.index("hw_cpu_other_util")
INITIAL_THREADS = torch.get_num_threads()
"""Torch's thread count when the process started (before any governor lowered it): the most a governor sets."""
THREAD_MODES = ("auto", "fixed")
"""--threads: auto (follow the free cores) | fixed (torch's own count throughout)."""


class ThreadGovernor:
    """Sets torch's CPU threads to the cores other processes leave free, read off the hardware monitor."""

    def __init__(self, monitor=None, cores: int | None = None, most: int | None = None, set_threads=None,
                 threads: int | None = None):
        self.cores = cores or cpu_cores()
        self.most = most or INITIAL_THREADS
        self._monitor = monitor
        self._set = set_threads or torch.set_num_threads
        """What sets the count: torch's, or another engine's (decoding/llama_cpp.py: llama.cpp's context threads)."""
        self.threads = threads or torch.get_num_threads()
        self.changes = 0
        """Times the count was changed (each a `set_threads` call)."""

    def threads_for(self, other_share: float) -> int:
        """Threads for a machine of which other processes take `other_share` of the CPU time: the cores they keep
        busy (rounded) taken away, at least one, at most `most`."""
        busy = int(max(0.0, other_share) * self.cores + 0.5)
        return max(1, min(self.most, self.cores - busy))

    def apply(self) -> int:
        """Set the count for the machine as the monitor last read it (a call only when it changes); returns it."""
        if self._monitor is None:
            self._monitor = shared_monitor("cpu")
        n = self.threads_for(float(self._monitor.read()[_OTHER]))
        if n != self.threads:
            self._set(n)
            self.threads, self.changes = n, self.changes + 1
        return n

    def restore(self) -> None:
        """Back to the most threads (e.g. when the governor is taken off a model)."""
        if self.threads != self.most:
            self._set(self.most)
            self.threads = self.most
