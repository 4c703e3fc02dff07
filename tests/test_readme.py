"""The README's code blocks: every command's flags are the script's (default suite), the Python program and the
short commands run as written (`-m slow`), and the two documents stay within their sizes."""
from __future__ import annotations

import dataclasses
import importlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from specpilot.decoding.config import parse_config

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FINDINGS = ROOT / "reports" / "README.md"
SIZES = {README: 12_000, FINDINGS: 40_000}
"""The README is a user's guide, the findings one page by topic: each at most this many characters."""
RUN_AS_WRITTEN = {"generate.py", "train_policy.py --device cpu --quick"}
"""The README commands the slow suite runs as written (seconds to a minute). The others take 15-25 minutes or a GPU
(training, profiling, benchmarking on the real loop) and are checked here by their flags; .ci/run runs the quick
start's install and test commands in a clean venv."""


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def commands() -> list[list[str]]:
    """Every command of the README's bash blocks (continuation lines joined, `a && b` split), as argv lists."""
    found = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("#")[0].split("&&"):
                if part.strip():
                    found.append(shlex.split(part))
    return found


def config_of(script: str):
    """The config dataclass of a script: the first `...Config` class of the module its `main` comes from."""
    source = (ROOT / "scripts" / script).read_text()
    module = re.search(r"^from (specpilot\.\S+) import \w+$", source.replace("from specpilot.decoding.config import run_cli", ""),
                       flags=re.M).group(1)
    mod = importlib.import_module(module)
    return next(v for k, v in vars(mod).items() if k.endswith("Config") and dataclasses.is_dataclass(v)
                and v.__module__ == module)


def test_the_readme_and_the_findings_stay_within_their_sizes():
    sizes = {p.name if p == README else "reports/README.md": len(p.read_text()) for p in SIZES}
    assert all(n <= SIZES[p] for p, n in zip(SIZES, sizes.values())), sizes


def test_every_readme_command_is_one_the_project_accepts():
    """Each `python scripts/X.py ...` parses with X's own flags; pip installs pin the torch .ci/run installs and
    name extras pyproject declares; nothing else is a command the README may not show."""
    pinned = re.search(r"torch==[\d.]+", (ROOT / ".ci" / "run").read_text()).group(0)
    extras = set(re.findall(r"^(\w+) = \[", (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1]
                            .split("\n[")[0], flags=re.M))
    seen = set()
    for argv in commands():
        if argv[:2] == ["pip", "install"]:
            for spec in argv[2:]:
                if spec.startswith("torch"):
                    assert spec == pinned, (spec, pinned)
                elif "[" in spec:
                    assert set(spec.split("[")[1].rstrip("]").split(",")) <= extras, spec
            seen.add("pip")
        elif argv[:3] == ["python", "-m", "pytest"]:
            seen.add("pytest")
        elif argv[:2] == ["python", "scripts/install_llama.py"]:  # pip's own flags only (it builds llama-cpp-python)
            assert all(a.startswith("-") for a in argv[2:]), argv
            seen.add("install_llama.py")
        elif argv[0] == "python" and argv[1].startswith("scripts/"):
            script = argv[1].removeprefix("scripts/")
            parse_config(config_of(script), argv[2:])  # an unknown flag or a bad value: SystemExit
            seen.add(script)
        else:
            pytest.fail(f"README command not checked: {' '.join(argv)}")
    assert {"pip", "pytest", "generate.py", "train_policy.py", "benchmark.py"} <= seen, seen


def test_every_python_block_compiles():
    assert blocks("python")
    for number, block in enumerate(blocks("python")):
        compile(block, f"README python block {number}", "exec")


def test_a_broken_command_would_be_caught():
    """The flag check has the power to fail: a flag generate.py does not have exits."""
    with pytest.raises(SystemExit):
        parse_config(config_of("generate.py"), ["--prompt", "x", "--no-such-flag"])


@pytest.mark.slow
@pytest.mark.embedded
@pytest.mark.parametrize("number", range(len(blocks("python"))))
def test_the_python_blocks_run_as_written(number, tmp_path):
    """From an unrelated folder, as a user would paste it: it runs and prints the generated text."""
    (tmp_path / "example.py").write_text(blocks("python")[number])
    done = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip(), "the program printed nothing"


@pytest.mark.slow
@pytest.mark.embedded
def test_the_short_commands_run_as_written(tmp_path):
    ran = []
    for argv in commands():
        line = " ".join(argv[1:])
        if argv[0] == "python" and any(line.startswith("scripts/" + c) for c in RUN_AS_WRITTEN):
            env = {**os.environ, "SPECPILOT_HOME": str(tmp_path / "home")}
            done = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=900,
                                  env=env)
            assert done.returncode == 0, (line, done.stderr[-2000:])
            ran.append(argv[1])
    assert sorted(set(ran)) == ["scripts/generate.py", "scripts/train_policy.py"], ran
