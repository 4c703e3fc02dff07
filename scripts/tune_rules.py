#!/usr/bin/env python
"""Tune the serving engines' k rules on the train split for a device and draft; see --help."""
import sys

from specpilot.bench.tune_cli import tune_main
from specpilot.decoding.config import run_cli

if __name__ == "__main__":
    sys.exit(run_cli(tune_main))
