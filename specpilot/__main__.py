"""`specpilot COMMAND ...` (or `python -m specpilot COMMAND ...`): the commands of scripts/, for an installed package.

Each command is the same main function its script in scripts/ runs; `specpilot COMMAND --help` lists its flags.
"""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "generate": ("specpilot.decoding.generate_cli", "generate_main", "generate text with speculative decoding"),
    "train": ("specpilot.agents.train_cli", "train_main", "train, export and evaluate a policy for this device"),
    "benchmark": ("specpilot.bench.benchmark_cli", "benchmark_main", "every policy side by side, paired"),
    "profile": ("specpilot.bench.profile_cli", "profile_main", "measure this device's cost profile and traces"),
    "tune": ("specpilot.bench.tune_cli", "tune_main", "tune the engines' rules on the train split"),
    "export-vllm": ("specpilot.bench.export_cli", "export_vllm_main", "a policy as vLLM's / TensorRT-LLM's tables"),
    "distill": ("specpilot.distill.distill_cli", "main", "train the draft head for a target"),
    "transformers-report": ("specpilot.bench.transformers_cli", "transformers_main",
                            "speculative decoding inside transformers' generate, measured"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    return "usage: specpilot COMMAND [--help | flags]\n" + "\n".join(
        f"  {name:<{width}}  {what}" for name, (_, _, what) in COMMANDS.items())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] not in COMMANDS:
        print(f"error: unknown command '{argv[0]}'\n{usage()}", file=sys.stderr)
        return 2
    module, function, _ = COMMANDS[argv[0]]
    from specpilot.decoding.config import run_cli

    return run_cli(getattr(importlib.import_module(module), function), argv[1:])


if __name__ == "__main__":
    sys.exit(main())
