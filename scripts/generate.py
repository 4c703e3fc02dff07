#!/usr/bin/env python
"""Generate text with speculative decoding; see `python scripts/generate.py --help`."""
import sys

from specpilot.decoding.config import run_cli
from specpilot.decoding.generate_cli import generate_main

if __name__ == "__main__":
    sys.exit(run_cli(generate_main))
