#!/usr/bin/env python
"""Export a length policy as vLLM's per-batch-size k table; see `python scripts/export_vllm_table.py --help`."""
import sys

from specpilot.bench.export_cli import export_vllm_main
from specpilot.decoding.config import run_cli

if __name__ == "__main__":
    sys.exit(run_cli(export_vllm_main))
