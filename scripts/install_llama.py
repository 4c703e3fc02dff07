#!/usr/bin/env python
"""Build and install llama-cpp-python for this machine's CPU (see specpilot/decoding/llama_build.py)."""
import argparse
import subprocess
import sys

from specpilot.decoding.llama_build import LLAMA_CPP_PYTHON, pip_command

if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=f"Build {LLAMA_CPP_PYTHON} from source for this CPU (no native detection, no AMX, no llamafile "
                    "sgemm or repacked weights: a verify rounds as one-token decodes do). Other arguments go to pip.")
    parser.add_argument("--print", action="store_true", help="print the CMAKE_ARGS and exit")
    args, pip_args = parser.parse_known_args()
    cmd, env = pip_command()
    if args.print:
        print(env["CMAKE_ARGS"])
        sys.exit(0)
    print("specpilot: CMAKE_ARGS=" + env["CMAKE_ARGS"], file=sys.stderr)
    sys.exit(subprocess.call(cmd + pip_args, env=env))
