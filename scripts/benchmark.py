#!/usr/bin/env python
"""Benchmark length policies side by side; see `python scripts/benchmark.py --help`."""
import sys

from specpilot.bench.benchmark_cli import benchmark_main
from specpilot.decoding.config import run_cli

if __name__ == "__main__":
    sys.exit(run_cli(benchmark_main))
