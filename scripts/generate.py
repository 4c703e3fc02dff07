#!/usr/bin/env python
"""Generate text with speculative decoding; see `python scripts/generate.py --help`."""
import sys

from decoding.cli import generate_main, run_cli

if __name__ == "__main__":
    sys.exit(run_cli(generate_main))
