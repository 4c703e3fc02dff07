#!/usr/bin/env python
"""Compare k policies on SIMULATED GPU cost profiles under machine conditions (power cap, co-tenant); see --help."""
import sys

from specpilot.bench.conditions_cli import conditions_main
from specpilot.decoding.config import run_cli

if __name__ == "__main__":
    sys.exit(run_cli(conditions_main))
