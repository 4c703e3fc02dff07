#!/usr/bin/env python
"""Measure a device's cost profile and record acceptance traces; see --help."""
import sys

from specpilot.bench.profile_cli import profile_main
from specpilot.decoding.config import run_cli

if __name__ == "__main__":
    sys.exit(run_cli(profile_main))
