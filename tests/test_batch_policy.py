"""Batch-aware pieces: batched replay and real envs, BatchTableK, the vLLM table export."""
from __future__ import annotations

import json
import math

import gymnasium as gym
import numpy as np
import pytest

from decoding.batch_table import BatchTableK, policy_to_table, vllm_ranges
from decoding.cli import export_vllm_main, run_cli
from decoding.models import load_draft, load_target
from decoding.observation import FEATURES
from decoding.oracle import CostModel, Trace
from decoding.policies import StaticK
from decoding.prompts import load_prompts
from env import ENV_ID, PlainSpeed, ReplayEnv, SpecDecodeEnv

K_MAX = 4


def batch_profile():
    """One row: verify cost flat in k. Sixteen rows: every drafted token costs two plain steps' worth
    more per row, so speculation cannot pay at batch 16 while it always pays at batch 1."""
    flat = [0.1] * (K_MAX + 1)
    return {
        "context_lens": [64, 1024], "k": list(range(K_MAX + 1)), "verify_s": [flat, flat],
        "draft_s_per_token": [0.0, 0.0], "hardware": None,
        "batch_sizes": [1, 4, 16], "batch_context_len": 64,
        "batch_verify_s": [flat, [0.2 + 0.05 * k for k in range(K_MAX + 1)], [0.4 * (1 + 2 * k) for k in range(K_MAX + 1)]],
        "batch_draft_s_per_token": [0.0, 0.0, 0.0],
    }


def full_match_trace(qid: str, n: int = 20) -> Trace:
    return Trace(qid, "c", list(range(5)), list(range(100, 100 + n)), [K_MAX] * n, [K_MAX] * n, k_max=K_MAX)


def test_batch_table_picks_goodput_argmax_per_batch_size():
    table = BatchTableK.from_profile(batch_profile(), [full_match_trace("a")], K_MAX)
    # every draft is accepted: batch 1 (flat cost) drafts the most; batch 16 (2x cost per token) drafts none;
    # batch 4: goodput (k+1) / (0.2 + 0.05 k) grows with k
    assert table.table == {1: K_MAX, 4: K_MAX, 16: 0}
    obs = np.zeros(len(FEATURES), dtype=np.float32)
    for batch, k in [(1, K_MAX), (3, K_MAX), (4, K_MAX), (15, K_MAX), (16, 0), (40, 0)]:
        obs[FEATURES.index("batch_size_log")] = math.log(batch)
        assert table.choose_k(obs) == k


def test_vllm_ranges_merge_equal_neighbours():
    assert vllm_ranges({1: 5, 2: 5, 3: 3, 4: 3, 5: 0}, 5) == [[1, 2, 5], [3, 4, 3], [5, 5, 0]]
    assert vllm_ranges({1: 2}, 1) == [[1, 1, 2]]


def test_policy_to_table_recovers_a_batch_table():
    profile = batch_profile()
    traces = [full_match_trace(f"t{i}") for i in range(4)]
    table = BatchTableK.from_profile(profile, traces, K_MAX)
    chosen, counts = policy_to_table(table, traces, CostModel.from_profile(profile), K_MAX, 16, episodes=2)
    assert chosen == {b: table.k_for(b) for b in range(1, 17)}
    assert all(sum(c.values()) > 0 for c in counts.values())


def test_replay_env_batches(tmp_path):
    from gymnasium.utils.env_checker import check_env

    rng = np.random.default_rng(0)
    traces = []
    for i in range(6):
        n = int(rng.integers(8, 20))
        traces.append(Trace(f"t{i}", "c", list(range(3 + i)), list(range(200, 200 + n)),
                            rng.integers(0, K_MAX + 1, n).tolist(), rng.integers(0, K_MAX + 1, n).tolist(), k_max=K_MAX))
    cost = CostModel.from_profile(batch_profile())
    check_env(ReplayEnv(traces, cost, k_max=K_MAX, batch_sizes=[1, 2, 4]), skip_render_check=True)
    env = ReplayEnv(traces, cost, k_max=K_MAX, noise=0.0, batch_sizes=[1, 2, 4])
    obs, info = env.reset(options={"trace_indices": [0, 3, 5]})
    assert info["batch_size"] == 3 and obs[FEATURES.index("batch_size_log")] == pytest.approx(math.log(3))
    done = False
    while not done:
        rows = env.state.active_rows
        before = [(r.length - r.prompt_len, r.trace) for r in rows]
        obs, reward, done, _, step_info = env.step(3)
        step = env.last_step
        expected = [min(min(3, t.available[i]), t.matches[i]) for i, t in before]
        assert step.accepted_rows == expected
        assert step_info["batch_size"] == len(before) and np.isfinite(reward)
    assert [r.generated for r in env.state.rows] == [traces[i].output_ids for i in (0, 3, 5)]
    sizes = {env.reset(seed=s)[1]["batch_size"] for s in range(20)}
    assert sizes == {1, 2, 4}


def test_replay_env_refuses_batches_without_a_batch_profile():
    profile = batch_profile()
    for key in ("batch_sizes", "batch_verify_s", "batch_draft_s_per_token"):
        profile.pop(key)
    from decoding.errors import SpecPilotError

    with pytest.raises(SpecPilotError, match="no batch sizes"):
        ReplayEnv([full_match_trace("a")], CostModel.from_profile(profile), k_max=K_MAX, batch_sizes=[1, 4])


def test_real_env_draws_batches(tiny_model_dirs):
    from gymnasium.utils.env_checker import check_env

    target = load_target(tiny_model_dirs["target"], "float32", "cpu")
    draft = load_draft("ngram", target)
    prompts = [p for p in load_prompts() if p.question_id.endswith("-00")][:5]
    speed = PlainSpeed([16, 1024], [0.002, 0.003], batch_scale={1: 1.0, 4: 1.5})
    kwargs = dict(target=target, draft=draft, prompts=prompts, k_max=K_MAX, max_new_tokens=8, plain_speed=speed,
                  batch_sizes=[1, 2, 4])
    check_env(gym.make(ENV_ID, **kwargs), skip_render_check=True)
    env = SpecDecodeEnv(**kwargs)
    _, info = env.reset(seed=0, options={"batch_size": 3})
    assert info["batch_size"] == 3
    tokens, done = 0, False
    while not done:
        _, reward, done, _, step_info = env.step(2)
        tokens += step_info["tokens"]
        assert np.isfinite(reward)
    assert tokens == 3 * 8
    assert {env.reset(seed=s)[1]["batch_size"] for s in range(12)} == {1, 2, 4}


def test_export_vllm_table_cli(tmp_path, capsys):
    profile_path = tmp_path / "profile.json"
    profile_path.write_text(json.dumps(batch_profile()))
    traces_path = tmp_path / "traces.json"
    traces_path.write_text(json.dumps({"meta": {"draft": "ngram:3", "target": "t", "splits": {}},
                                       "traces": [full_match_trace(f"t{i}").__dict__ for i in range(3)]}))
    out = tmp_path / "vllm.json"
    code = run_cli(export_vllm_main, ["--policy", "batch-table", "--device", "cpu", "--profile", str(profile_path),
                                      "--traces", str(traces_path), "--k-max", str(K_MAX), "--max-batch", "20",
                                      "--episodes", "2", "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    ranges = result["num_speculative_tokens_per_batch_size"]
    assert ranges == [[1, 15, K_MAX], [16, 20, 0]]
    assert result["num_speculative_tokens"] == K_MAX
    # the ranges tile 1..max_batch with ints
    assert ranges[0][0] == 1 and ranges[-1][1] == 20
    assert all(a[1] + 1 == b[0] for a, b in zip(ranges, ranges[1:]))
    code = run_cli(export_vllm_main, ["--policy", "batch-table", "--device", "cpu", "--profile", str(tmp_path / "none.json")])
    assert code == 2 and "no cost profile" in capsys.readouterr().err


def test_static_policy_in_batched_replay_drafts_the_widest_row():
    traces = [Trace("a", "c", [1, 2], list(range(10)), [4] * 10, [1] * 10, k_max=K_MAX),
              Trace("b", "c", [1, 2], list(range(10)), [0] * 10, [4] * 10, k_max=K_MAX)]
    env = ReplayEnv(traces, CostModel.from_profile(batch_profile()), k_max=K_MAX, noise=0.0, batch_sizes=[1, 2])
    env.reset(options={"trace_indices": [0, 1]})
    env.step(StaticK(3).choose_k(None))
    assert env.last_step.k == 3 and env.last_step.accepted_rows == [1, 0]
