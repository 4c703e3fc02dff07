"""The package a user installs: a wheel with one top-level name whose committed artifacts are package data.

Built from this checkout, installed without dependencies into a fresh venv that sees this environment's packages
(torch, transformers, ...: also when the suite itself runs inside a venv) but not this checkout, then run from an
unrelated directory with an empty user folder:
`--policy learned` and `--draft default` must find the shipped policy and head inside the installed package."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.embedded


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    base = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(base / "dist"),
                    str(ROOT)], check=True, capture_output=True, text=True)
    wheel = next((base / "dist").glob("specpilot-*.whl"))
    subprocess.run([sys.executable, "-m", "venv", str(base / "venv")], check=True)
    python = base / "venv" / "bin" / "python"
    see_these_packages(python)
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "-q", "--disable-pip-version-check", str(wheel)],
                   check=True, capture_output=True, text=True)
    elsewhere = base / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(SPECPILOT_HOME=str(base / "home"), WANDB_MODE="disabled", HF_HUB_OFFLINE="1")
    return wheel, base / "venv", elsewhere, env


def see_these_packages(python: Path) -> None:
    """Let the venv of `python` import the packages this interpreter imports (torch, transformers, ...; whether it runs
    inside a venv or not), after its own: a .pth file listing this interpreter's site-packages folders. Their own .pth
    files (an editable install of this checkout among them) are not run, so the checkout stays unseen."""
    own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True).stdout.strip()
    folders = [p for p in dict.fromkeys(sys.path) if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]
    assert folders, sys.path
    (Path(own) / "outer-packages.pth").write_text("".join(f"{p}\n" for p in folders))


def run(venv: Path, cwd: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv / "bin" / "specpilot"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def test_the_wheel_has_one_top_level_name_and_ships_the_artifacts(installed):
    wheel = installed[0]
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"specpilot"}, tops
    for shipped in ("specpilot/policies/cpu-amd-epyc-2c/ngram-3/policy.json", "specpilot/drafts/smollm2-135m-head/draft_head.json",
                    "specpilot/profiles/traces-ngram-3.json", "specpilot/decoding/data/prompts.jsonl",
                    "specpilot/agents/hyperparams.yaml", "specpilot/decoding/hub/custom_generate/generate.py"):
        assert shipped in names, shipped
    meta = json.loads(zipfile.ZipFile(wheel).read("specpilot/policies/cpu-amd-epyc-2c/ngram-3/policy.json"))
    assert meta["weights"] in {Path(n).name for n in names}


def test_learned_policy_and_default_draft_run_from_an_unrelated_directory(installed):
    _, venv, elsewhere, env = installed
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import specpilot.decoding as d; print(d.__file__)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert str(venv) in where and str(ROOT) not in where  # the installed copy, not this checkout
    prompt = ["--prompt", "def add(a, b):\n    return a + b\n\ndef add(a, b):", "--max-new-tokens", "12", "--json"]
    learned = run(venv, elsewhere, env, "generate", *prompt, "--policy", "learned", "--draft", "ngram")
    assert learned.returncode == 0, learned.stderr
    out = json.loads(learned.stdout.strip().splitlines()[-1])
    assert out["policy"] == "learned" and str(venv) in out["policy_file"]
    plain = run(venv, elsewhere, env, "generate", *prompt, "--policy", "none")
    assert plain.returncode == 0, plain.stderr
    assert out["token_ids"] == json.loads(plain.stdout.strip().splitlines()[-1])["token_ids"]
    head = run(venv, elsewhere, env, "generate", *prompt, "--policy", "static:2", "--draft", "default")
    assert head.returncode == 0, head.stderr
    assert json.loads(head.stdout.strip().splitlines()[-1])["token_ids"] == out["token_ids"]
    assert not list(elsewhere.iterdir())  # nothing written into the user's working directory


def test_a_missing_command_is_a_one_line_error(installed):
    _, venv, elsewhere, env = installed
    bad = run(venv, elsewhere, env, "nonsense")
    assert bad.returncode == 2 and bad.stderr.startswith("error: unknown command 'nonsense'")
    assert "generate" in run(venv, elsewhere, env, "--help").stdout
