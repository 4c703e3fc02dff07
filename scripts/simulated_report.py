#!/usr/bin/env python
"""Compare k policies on SIMULATED GPU cost profiles over batch size x context length; see --help."""
import sys

from specpilot.bench.simulated_cli import simulated_main
from specpilot.decoding.config import run_cli

if __name__ == "__main__":
    sys.exit(run_cli(simulated_main))
