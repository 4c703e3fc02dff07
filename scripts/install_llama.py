#!/usr/bin/env python
"""Build and install llama-cpp-python for this machine's CPU (see specpilot/decoding/llama_build.py)."""
import subprocess
import sys

from specpilot.decoding.llama_build import pip_command

if __name__ == "__main__":
    if "--print" in sys.argv[1:]:
        print(pip_command()[1]["CMAKE_ARGS"])
        sys.exit(0)
    cmd, env = pip_command()
    print("specpilot: CMAKE_ARGS=" + env["CMAKE_ARGS"], file=sys.stderr)
    sys.exit(subprocess.call(cmd + sys.argv[1:], env=env))
