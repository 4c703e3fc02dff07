"""How llama-cpp-python is built for this machine: the CPU's own instruction sets, named one by one.

`GGML_NATIVE=ON` (llama.cpp's default) builds for whatever the compiler detects, and on a KVM Xeon that
advertises AMX it segfaulted in `llama_decode`; so the flags below come from /proc/cpuinfo, AMX stays off,
and two kernels are left out so that a verify of k+1 tokens rounds as k+1 one-token steps do:
llamafile's sgemm (`GGML_LLAMAFILE`, batched tiles) and the repacked weight layouts (`GGML_CPU_REPACK`,
used for some batch shapes only). `python scripts/install_llama.py` runs pip with them.
"""
from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
# cpuinfo flag -> ggml's cmake option
X86_FLAGS = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C",
             "avx512f": "GGML_AVX512", "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16",
             "avx512vbmi": "GGML_AVX512_VBMI", "avx_vnni": "GGML_AVX_VNNI", "bmi2": "GGML_BMI2"}
ALWAYS = ["-DGGML_NATIVE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_BF16=OFF",
          "-DGGML_LLAMAFILE=OFF", "-DGGML_CPU_REPACK=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TESTS=OFF",
          "-DLLAVA_BUILD=OFF"]


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The instruction-set flags of the first CPU in /proc/cpuinfo (empty where there is none)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    for line in cpuinfo.splitlines():
        if line.startswith("flags") and ":" in line:
            return set(line.split(":", 1)[1].split())
    return set()


def cmake_args(flags: set[str] | None = None, machine: str | None = None) -> str:
    """CMAKE_ARGS for this machine: on x86-64 every SIMD option named by whether the CPU has it; elsewhere
    (arm64) ggml's own detection for the architecture, which has no AMX to trip on."""
    machine = (machine or platform.machine()).lower()
    if machine not in ("x86_64", "amd64"):
        return " ".join(a for a in ALWAYS if not a.startswith("-DGGML_NATIVE") and "AMX" not in a)
    flags = cpu_flags() if flags is None else flags
    simd = [f"-D{option}={'ON' if name in flags else 'OFF'}" for name, option in X86_FLAGS.items()]
    return " ".join(ALWAYS + simd)


def pip_command(python: str = sys.executable) -> tuple[list[str], dict[str, str]]:
    """The pip command that builds llama-cpp-python from source for this machine, and its environment."""
    env = {**os.environ, "CMAKE_ARGS": cmake_args(), "FORCE_CMAKE": "1"}
    return [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-binary", "llama-cpp-python",
            LLAMA_CPP_PYTHON], env
