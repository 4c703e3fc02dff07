#!/usr/bin/env python
"""Measure a device's cost profile and record acceptance traces; see --help."""
import sys

from decoding.cli import profile_main, run_cli

if __name__ == "__main__":
    sys.exit(run_cli(profile_main))
