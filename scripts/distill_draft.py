#!/usr/bin/env python
"""Distil the default draft head for a target; see `python scripts/distill_draft.py --help`."""
import sys

from decoding.cli import distill_main, run_cli

if __name__ == "__main__":
    sys.exit(run_cli(distill_main))
