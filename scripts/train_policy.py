#!/usr/bin/env python
"""Train, export and evaluate a draft-length policy for this device; see --help."""
import sys

from specpilot.agents.train_cli import train_main
from specpilot.decoding.config import run_cli

if __name__ == "__main__":
    sys.exit(run_cli(train_main))
