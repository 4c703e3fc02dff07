#!/usr/bin/env python
"""Distil the default draft head for a target; see `python scripts/distill_draft.py --help`."""
import sys

from specpilot.decoding.config import run_cli
from specpilot.distill.distill_cli import main

if __name__ == "__main__":
    sys.exit(run_cli(main))
