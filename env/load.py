"""Background loads a shared machine sees, started and stopped by the project itself.

`background_load("compute")` runs one process of matrix multiplies (one core busy), "memory" one process
copying a 256 MB buffer back and forth (memory bandwidth), "both" the two, "none" nothing. The processes
die with the block that started them, and with the process that started them even when it is killed
with SIGKILL (Linux: PR_SET_PDEATHSIG), so no load outlives a run.
"""
from __future__ import annotations

import contextlib
import ctypes
import signal
import subprocess
import sys

LOADS = ("none", "compute", "memory", "both")

_COMPUTE = "import numpy as np\na = np.random.rand(384, 384)\nwhile True:\n    a = a @ a\n    a /= a.max()\n"
_MEMORY = ("import numpy as np\na = np.ones(32 * 1024 * 1024)\nb = np.empty_like(a)\nwhile True:\n"
           "    np.copyto(b, a)\n    np.copyto(a, b)\n")


def _die_with_parent() -> None:
    """In the child, before exec: get SIGKILL when the parent dies (Linux prctl PR_SET_PDEATHSIG = 1)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass


def start_load(kind: str) -> list[subprocess.Popen]:
    if kind not in LOADS:
        raise ValueError(f"unknown background load '{kind}'; expected one of {', '.join(LOADS)}")
    codes = {"none": [], "compute": [_COMPUTE], "memory": [_MEMORY], "both": [_COMPUTE, _MEMORY]}[kind]
    env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent) for code in codes]


def stop_load(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


@contextlib.contextmanager
def background_load(kind: str):
    """Run the block under a background load; the load stops when the block ends, however it ends."""
    procs = start_load(kind)
    try:
        yield procs
    finally:
        stop_load(procs)
