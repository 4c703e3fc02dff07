"""Every bad input a user can give the commands is one `error:` line and exit code 2, never a traceback;
inputs beyond what a profile covers are one `warning:` line. `python tests/test_bad_inputs.py DIR` prints
the table of the issue's closing note (each case, its message, its exit code)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from specpilot.agents.defer import defer_main
from specpilot.agents.export import write_policy
from specpilot.agents.train_cli import train_main
from specpilot.bench.benchmark_cli import benchmark_main
from specpilot.bench.profile_cli import profile_main
from specpilot.bench.tune_cli import tune_main
from specpilot.decoding.config import run_cli
from specpilot.decoding.generate_cli import generate_main
from specpilot.decoding.observation import FEATURES
from specpilot.decoding.paths import pair_name
from conftest import CPU_KEY

MAINS = {"benchmark": benchmark_main, "generate": generate_main, "train": train_main, "profile": profile_main,
         "tune": tune_main, "defer": defer_main}


def make_files(root: Path, target: str) -> dict[str, str]:
    """A prompt file, a cost profile, traces, tuned rules and a learned policy, each good, plus bad copies."""
    root.mkdir(parents=True, exist_ok=True)
    files = {}
    prompts = [{"question_id": f"q{i}", "category": "c", "split": "test", "turns": [f"one two three one two {i}"]}
               for i in range(2)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    (root / "latin1.jsonl").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    row = [0.010, 0.016, 0.018, 0.019, 0.020]
    profile = {"context_lens": [32, 256], "verify_s": [row, row], "draft_s_per_token": [0.0, 0.0], "device": "cpu",
               "batch_sizes": [1, 2], "batch_verify_s": [row, [2 * x for x in row]], "batch_draft_s_per_token": [0.0, 0.0]}
    (root / "profile.json").write_text(json.dumps(profile))
    (root / "profile_broken.json").write_text(json.dumps(profile)[:40])
    (root / "profile_keys.json").write_text(json.dumps({"device": "cpu"}))
    trace = {"question_id": "q0", "category": "c", "prompt_ids": [1, 2, 3], "output_ids": [4, 5, 6, 7],
             "matches": [1, 0, 2, 0], "available": [2, 1, 2, 0], "match_lens": [1, 1, 2, 0], "k_max": 4}
    meta = {"draft": "ngram:3", "max_new_tokens": 64, "splits": {"q0": "test"}}
    (root / "traces.json").write_text(json.dumps({"meta": meta, "traces": [trace]}))
    (root / "traces_fields.json").write_text(json.dumps({"meta": meta, "traces": [{**trace, "colour": "red"}]}))
    (root / "traces_lengths.json").write_text(json.dumps({"meta": meta, "traces": [{**trace, "matches": [1]}]}))
    (root / "traces_broken.json").write_text("{\"meta\": ")
    (root / "rules.json").write_text("not json")
    policy = root / "policy"
    layers = [(np.zeros((4, len(FEATURES))), np.zeros(4)), (np.zeros((5, 4)), np.arange(5.0))]
    norm = {"mean": [0.0] * len(FEATURES), "var": [1.0] * len(FEATURES), "epsilon": 1e-8, "clip": 10.0}
    write_policy(policy, layers, norm, "tanh", 4, "cpu", "test", 0, {"draft": "ngram:3"})
    incomplete = root / "policy_keys"
    incomplete.mkdir(exist_ok=True)
    meta_json = json.loads((policy / "policy.json").read_text())
    del meta_json["layers"]
    (incomplete / "policy.json").write_text(json.dumps(meta_json))
    bad_defer = root / "policy_defer"
    write_policy(bad_defer, layers, norm, "tanh", 4, "cpu", "test", 0, {"draft": "ngram:3", "defer": {"2": "warp:9"}})
    run_dir = root / "train" / CPU_KEY / pair_name("ngram:3", target) / "run"  # policies belong to a (target, draft) pair
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "plain_speed.json").write_text("{\"context_lens\": [32], \"seconds\": ")
    for p in root.rglob("*"):
        files[p.name if p.is_file() else p.name + "/"] = str(p)
    files["root"] = str(root)
    return files


def cases(f: dict[str, str], target: str) -> list[tuple[str, list[str], str]]:
    """(command, argv, the message the error must hold)."""
    bench = ["--target", target, "--draft", "ngram", "--no-progress", "--out", f["root"] + "/runs"]
    replay = bench + ["--replay", "--prompts", f["prompts.jsonl"], "--split", "test", "--policies", "static:2"]
    return [
        ("benchmark", bench + ["--prompts", f["latin1.jsonl"]], "is not UTF-8 text"),
        ("benchmark", bench + ["--prompts", f["prompts.jsonl"], "--split", "test", "--repeats", "0"], "--repeats must be >= 1"),
        ("benchmark", bench + ["--prompts", f["prompts.jsonl"], "--split", "test", "--background-load", "none,gpu"],
         "--background-load takes distinct ones of none, compute, memory, both"),
        ("benchmark", bench + ["--prompts", f["prompts.jsonl"], "--split", "test", "--background-load", "compute",
                               "--replay"], "--background-load times the real loop"),
        ("benchmark", bench + ["--prompts", f["prompts.jsonl"], "--split", "test", "--cost-jitter", "0.1"],
         "without --replay"),
        ("benchmark", bench + ["--prompts", f["prompts.jsonl"], "--split", "test", "--policies", "oracle",
                               "--batch-sizes", "1,2"], "per sequence"),
        ("benchmark", replay + ["--profile", f["profile.json"], "--traces", f["traces_broken.json"]], "corrupt trace file"),
        ("benchmark", replay + ["--profile", f["profile.json"], "--traces", f["traces_fields.json"]], "unexpected keyword argument 'colour'"),
        ("benchmark", replay + ["--profile", f["profile.json"], "--traces", f["traces_lengths.json"]], "differ in length"),
        ("benchmark", replay + ["--profile", f["profile_broken.json"], "--traces", f["traces.json"]], "corrupt cost profile"),
        ("benchmark", replay + ["--profile", f["profile_keys.json"], "--traces", f["traces.json"]], "missing context_lens"),
        ("benchmark", replay + ["--profile", f["profile.json"], "--traces", f["traces.json"], "--policies", "best-rule",
                                "--rules", f["rules.json"]], "corrupt tuned rules"),
        ("benchmark", replay + ["--profile", f["profile.json"], "--traces", f["traces.json"], "--policies",
                                "learned:" + f["policy/"], "--k-max", "6"], "conflicts with the learned policy's k_max 4"),
        ("benchmark", replay + ["--profile", f["profile.json"], "--traces", f["traces.json"], "--policies",
                                "learned:" + f["policy_keys/"]], "lacks the keys ['layers']"),
        ("benchmark", replay + ["--profile", f["profile.json"], "--traces", f["traces.json"], "--policies",
                                "learned:" + f["policy_defer/"]], "defer entry '2': unknown policy 'warp:9'"),
        ("defer", ["--device", "cpu", "--policy", f["policy/"] + "policy.json", "--margin", "-0.1"], "--margin is >= 0"),
        ("defer", ["--device", "cpu", "--policy", f["root"] + "/nowhere/policy.json"], "policy file not found"),
        ("generate", ["--target", target, "--prompt-file", f["latin1.txt"]], "is not UTF-8 text"),
        ("generate", ["--target", target, "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        ("generate", ["--target", target, "--prompt", "x", "--policy", "learned:" + f["policy/"], "--k-max", "8"],
         "conflicts with the learned policy's k_max 4"),
        ("train", ["--device", "cpu", "--target", target, "--draft", "ngram", "--out", f["root"] + "/train", "--resume",
                   "--no-track", "--env", "real"], "corrupt plain-speed file"),
        ("train", ["--device", "cpu", "--target", target, "--timesteps", "-5", "--out", f["root"] + "/t2", "--no-track",
                   "--env", "real"], "--timesteps is >= 0"),
        ("train", ["--device", "cpu", "--target", target, "--replay-timesteps", "10", "--out", f["root"] + "/t3",
                   "--no-track", "--env", "real"], "needs a replay phase"),
        ("profile", ["--device", "cpu", "--target", target, "--draft", "ngram", "--context-lens", "100000",
                     "--out", f["root"] + "/p", "--no-progress", "--no-traces"], "leaves no room"),
        ("profile", ["--device", "cpu", "--target", target, "--repeats", "0", "--out", f["root"] + "/p"], "--repeats must be >= 1"),
        ("tune", ["--device", "cpu", "--draft", "ngram:3", "--profile", f["profile_broken.json"], "--traces", f["traces.json"],
                  "--out", f["root"] + "/r.json", "--no-progress"], "corrupt cost profile"),
    ]


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_model_dirs):
    return make_files(tmp_path_factory.mktemp("bad"), tiny_model_dirs["target"])


def test_every_bad_input_is_one_error_line_and_exit_2(files, tiny_model_dirs, capsys, monkeypatch):
    monkeypatch.chdir(files["root"])
    failures = []
    for command, argv, message in cases(files, tiny_model_dirs["target"]):
        code = run_cli(MAINS[command], argv)
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        if code != 2 or len(lines) != 1 or message not in lines[0] or "Traceback" in err:
            failures.append((command, message, code, err[-300:]))
    assert not failures, failures


def test_inputs_beyond_the_profile_are_one_warning(files, tiny_model_dirs, capsys, monkeypatch):
    monkeypatch.chdir(files["root"])
    argv = ["--target", tiny_model_dirs["target"], "--draft", "ngram", "--no-progress", "--out", files["root"] + "/runs",
            "--replay", "--prompts", files["prompts.jsonl"], "--split", "test", "--policies", "static:2",
            "--profile", files["profile.json"], "--traces", files["traces.json"], "--batch-sizes", "1,4", "--k-max", "4"]
    assert run_cli(benchmark_main, argv) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: batch sizes [4] lie above the profiled [1, 2] (costed as B=2)"]


if __name__ == "__main__":  # the table for the closing note
    import contextlib
    import io
    import sys

    from conftest import save_tiny_model

    root = Path(sys.argv[1])
    target = str(save_tiny_model(root / "target", seed=0))
    f = make_files(root / "files", target)
    print("| command | bad input (flags) | exit | message |\n|---|---|---|---|")
    for command, argv, _ in cases(f, target):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = run_cli(MAINS[command], argv)
        common = {"--target", "--draft", "--out", "--device", "--no-progress", "--no-track", "--env", "--no-traces"}
        kept, skip = [], False
        for a in argv:
            if skip:
                skip = False
                continue
            if a in common:
                skip = a not in ("--no-progress", "--no-track", "--no-traces")
                continue
            kept.append(a.replace(str(root) + "/files/", "").replace(str(root), "DIR"))
        shown = " ".join(kept)
        line = next((x for x in err.getvalue().splitlines() if x.startswith("error:")), err.getvalue().strip()[-120:])
        print(f"| {command} | `{shown}` | {code} | {line.replace(str(root) + '/files/', '').replace(str(root), 'DIR')[:170]} |")
