#!/usr/bin/env python
"""Speculative decoding inside transformers' generate, measured; see --help."""
import sys

from specpilot.bench.transformers_cli import transformers_main
from specpilot.decoding.config import run_cli

if __name__ == "__main__":
    sys.exit(run_cli(transformers_main))
