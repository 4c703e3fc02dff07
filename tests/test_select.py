"""The phase a training run exports is picked on held-out train prompts (agents/select.py), and the counters-pinned
ablation (`learned-idle-counters`) decides as the policy would on an idle machine."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import COMMITTED_CPU_KEY, CPU_KEY, stretch_traces

from specpilot.agents.export import write_policy
from specpilot.agents.select import held_out, selection_scores
from specpilot.decoding.hardware import HW_FEATURES
from specpilot.decoding.learned import LearnedK
from specpilot.decoding.observation import FEATURES
from specpilot.decoding.policy_spec import parse_policy
from specpilot.env.oracle import CostModel
from specpilot.env.replay_env import MachineCondition

K = 4
NORM = {"mean": [0.0] * len(FEATURES), "var": [1.0] * len(FEATURES), "epsilon": 1e-8, "clip": 10.0}


def mlp_policy(folder, bias: list[float], weights: dict[str, list[float]] | None = None, device: str = CPU_KEY):
    """A one-layer policy: logits = W x + bias, W's column of feature f = weights[f] (all others 0)."""
    w = np.zeros((K + 1, len(FEATURES)))
    for name, column in (weights or {}).items():
        w[:, FEATURES.index(name)] = column
    return write_policy(folder, [(w, np.asarray(bias, dtype=float))], NORM, "tanh", K, device, "test", 0,
                        {"draft": "ngram:3"})


def test_the_held_out_prompts_are_a_fixed_share_of_the_ids():
    ids = [f"q{i}" for i in range(2000)]
    chosen = held_out(ids, 0.2)
    assert chosen == held_out(list(reversed(ids)), 0.2)  # by id, not by position
    assert 0.17 < len(chosen) / len(ids) < 0.23
    assert held_out(ids, 0.0) == set() and held_out(ids, 0.1) < chosen  # a smaller share holds out a subset
    with pytest.raises(ValueError):
        held_out(ids, 1.0)


def test_selection_ranks_the_faster_policy_first_under_every_condition(tmp_path):
    """Two conditions where drafting 4 tokens pays (verify of any k costs 1.8 plain steps; half the positions accept
    every draft): k = 4 everywhere beats k = 0 (exactly 1.0x) in every cell, and the score is their geometric mean."""
    traces = stretch_traces(K, 8, 36)
    slow = CostModel([0, 10000], [[0.1] + [0.18] * K] * 2, [0.0, 0.0])
    fast = CostModel([0, 10000], [[0.2] + [0.24] * K] * 2, [0.0, 0.0])
    conditions = [MachineCondition("none", slow, np.zeros(len(HW_FEATURES), np.float32)),
                  MachineCondition("compute", fast, np.ones(len(HW_FEATURES), np.float32))]
    candidates = {"warm-start": mlp_policy(tmp_path / "a", [5.0, 0, 0, 0, 0]),
                  "replay": mlp_policy(tmp_path / "b", [0, 0, 0, 0, 5.0])}
    scores = selection_scores(candidates, traces, conditions, K, [1], 36, CPU_KEY, "ngram:3")
    assert set(scores["replay"]["cells"]) == {"none B=1", "compute B=1"}
    assert all(v == pytest.approx(1.0) for v in scores["warm-start"]["cells"].values())
    assert all(v > 1.05 for v in scores["replay"]["cells"].values())
    cells = list(scores["replay"]["cells"].values())
    assert scores["replay"]["score"] == pytest.approx(float(np.exp(np.mean(np.log(cells)))))
    # the cheaper verify (1.2 plain steps) pays more
    assert scores["replay"]["cells"]["compute B=1"] > scores["replay"]["cells"]["none B=1"]


def test_pinned_counters_decide_as_on_an_idle_machine(tmp_path):
    """A policy that drafts 4 when other processes take the CPU and nothing otherwise: with its counters pinned to
    idle ones it drafts nothing under that load; the other inputs still reach it."""
    path = mlp_policy(tmp_path / "p", [0.1, 0, 0, 0, 0], {"hw_cpu_other_util": [0, 0, 0, 0, 4.0],
                                                          "accept_rate_ema": [0, 0, 2.0, 0, 0]})
    policy, pinned = LearnedK.load(path), LearnedK.load(path).pin_counters(np.zeros(len(HW_FEATURES)))
    busy = np.zeros(len(FEATURES), dtype=np.float32)
    busy[FEATURES.index("hw_cpu_other_util")] = 0.9
    assert policy.choose_k(busy) == 4 and pinned.choose_k(busy) == 0
    assert int(np.argmax(pinned.logits(busy))) == 0 and int(np.argmax(policy.logits(busy))) == 4
    busy[FEATURES.index("accept_rate_ema")] = 3.0
    assert pinned.choose_k(busy) == 2
    assert busy[FEATURES.index("hw_cpu_other_util")] == pytest.approx(0.9)  # the caller's observation untouched


def test_the_idle_counters_spelling_pins_to_the_device_profile(tmp_path):
    """`learned-idle-counters:PATH` reads the counters of its device's cost profile (the committed CPU's)."""
    path = mlp_policy(tmp_path / "p", [0.1, 0, 0, 0, 0], {"hw_cpu_other_util": [0, 0, 0, 0, 4.0]}, COMMITTED_CPU_KEY)
    ablation = parse_policy(f"learned-idle-counters:{path}", K, device=COMMITTED_CPU_KEY, draft="ngram:3")
    assert ablation.name == "learned-idle-counters"
    busy = np.zeros(len(FEATURES), dtype=np.float32)
    busy[FEATURES.index("hw_cpu_other_util")] = 0.9
    assert ablation.choose_k(busy) == 0 and parse_policy(f"learned:{path}", K, device=COMMITTED_CPU_KEY).choose_k(busy) == 4


def test_batch_choice_takes_the_best_phase_at_each_batch_size():
    """Per batch size the geometric mean over the conditions decides; a tie goes to the later phase."""
    from specpilot.agents.select import batch_choice

    scores = {"warm-start": {"cells": {"none B=1": 1.30, "compute B=1": 1.20, "none B=2": 1.10, "compute B=2": 1.10}},
              "replay": {"cells": {"none B=1": 1.40, "compute B=1": 1.12, "none B=2": 1.12, "compute B=2": 1.09}},
              "real": {"cells": {"none B=1": 1.30, "compute B=1": 1.20, "none B=2": 1.00, "compute B=2": 1.00}}}
    # B=1: warm-start and real tie (1.249), replay 1.254; B=2: replay 1.1050 > warm-start 1.1000
    assert batch_choice(scores, ["warm-start", "replay", "real"]) == {1: "replay", 2: "replay"}
    scores["replay"]["cells"]["none B=1"] = 1.30  # now replay 1.2075 at B=1: warm-start and real tie, the later wins
    assert batch_choice(scores, ["warm-start", "replay", "real"]) == {1: "real", 2: "replay"}


def two_batch_conditions():
    """Drafting 4 pays at one row (verify 1.8 plain steps, half the positions accept all) and loses at two (a verify of
    k >= 1 costs 5 plain steps there)."""
    cost = CostModel([0, 10000], [[0.1] + [0.18] * K] * 2, [0.0, 0.0], batch_sizes=[1, 2],
                     batch_verify_s=[[0.1] + [0.18] * K, [0.1] + [0.5] * K])
    return [MachineCondition("none", cost, np.zeros(len(HW_FEATURES), np.float32))]


def test_the_exported_policy_holds_the_winning_phase_of_each_batch_size(tmp_path):
    """The warm start drafts nothing, the replay phase always 4: the selection exports replay's network at one row and
    the warm start's from two rows up, checked decision by decision; the file says which phase decides where."""
    import json
    from types import SimpleNamespace

    from specpilot.agents.train_select import select_phase

    conditions = two_batch_conditions()
    found = {"warm-start": mlp_policy(tmp_path / "a", [5.0, 0, 0, 0, 0]),
             "replay": mlp_policy(tmp_path / "b", [0, 0, 0, 0, 5.0])}
    run = SimpleNamespace(replay=SimpleNamespace(conditions=conditions, holdout=stretch_traces(K, 8, 36)), k_max=K,
                          batch_sizes=[1, 2], budget=36, device_key=CPU_KEY, draft=SimpleNamespace(name="ngram:3"),
                          hardware_name="test")
    path, how = select_phase(run, found, tmp_path / "out", {"draft": "ngram:3"})
    meta = json.loads(path.read_text())
    assert meta["selection"]["by_batch"] == {"1": "replay", "2": "warm-start"} and "replay (B >= 1)" in how
    assert meta["by_batch"]["1"] == {"phase": "replay"} and meta["by_batch"]["2"]["phase"] == "warm-start"
    policy = LearnedK.load(path)
    obs = np.zeros(len(FEATURES), dtype=np.float32)
    for batch, k in [(1, 4), (2, 0), (3, 0), (16, 0)]:
        obs[FEATURES.index("batch_size_log")] = np.log(batch)
        assert policy.choose_k(obs) == k, batch
    assert policy.calls == 4  # the networks' decisions are the policy's
    rows = np.zeros((2, len(FEATURES)))
    rows[1, FEATURES.index("batch_size_log")] = np.log(2)
    assert list(np.argmax(policy.logits(rows), axis=-1)) == [4, 0]
    # both phases lose or win alike everywhere: one network, no by_batch entry
    same = select_phase(run, {"warm-start": found["warm-start"]}, tmp_path / "one", {"draft": "ngram:3"})[0]
    assert "by_batch" not in json.loads(same.read_text())


def test_a_broken_by_batch_entry_is_a_one_line_error(tmp_path):
    import json

    from specpilot.decoding.errors import SpecPilotError

    w = np.zeros((K + 1, len(FEATURES)))
    path = write_policy(tmp_path / "p", [(w, np.zeros(K + 1))], NORM, "tanh", K, CPU_KEY, "test", 0, {"draft": "ngram:3"},
                        by_batch={1: ("real", None, None), 4: ("replay", [(w, np.ones(K + 1))], NORM)})
    assert LearnedK.load(path).by_batch[1] is None
    meta = json.loads(path.read_text())
    meta["by_batch"]["4"]["layers"] = ["b4.layer7"]
    path.write_text(json.dumps(meta))
    with pytest.raises(SpecPilotError, match=r"by_batch entry '4': the weights lack \['b4.layer7.weight'"):
        LearnedK.load(path)
    meta["by_batch"] = {"0": {"phase": "x"}}
    path.write_text(json.dumps(meta))
    with pytest.raises(SpecPilotError, match="by_batch entry '0' is not"):
        LearnedK.load(path)
