"""Batch-aware pieces: batched replay and real envs, BatchTableK, the vLLM table export."""
from __future__ import annotations

import json
import math

import gymnasium as gym
import numpy as np
import pytest
from conftest import repeatable_measurements

from specpilot.bench.batch_table import BatchTableK, policy_to_table, vllm_ranges
from specpilot.bench.export_cli import export_vllm_main
from specpilot.decoding.config import run_cli
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.models import load_draft, load_target
from specpilot.decoding.observation import FEATURES
from specpilot.decoding.policies import StaticK
from specpilot.decoding.prompts import load_prompts
from specpilot.env import ENV_ID, PlainSpeed, ReplayEnv, SpecDecodeEnv, measure_plain_speed
from specpilot.env.oracle import CostModel, Trace

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
    from specpilot.decoding.errors import SpecPilotError

    with pytest.raises(SpecPilotError, match="no batch sizes"):
        ReplayEnv([full_match_trace("a")], CostModel.from_profile(profile), k_max=K_MAX, batch_sizes=[1, 4])


def test_real_env_draws_batches(tiny_model_dirs, monkeypatch):
    from gymnasium.utils.env_checker import check_env

    target = load_target(tiny_model_dirs["target"], "float32", "cpu")
    draft = load_draft("ngram", target)
    prompts = [p for p in load_prompts() if p.question_id.endswith("-00")][:5]
    speed = PlainSpeed([16, 1024], [0.002, 0.003], batch_scale={1: 1.0, 4: 1.5})
    kwargs = dict(target=target, draft=draft, prompts=prompts, k_max=K_MAX, max_new_tokens=8, plain_speed=speed,
                  batch_sizes=[1, 2, 4])
    with repeatable_measurements(monkeypatch, K_MAX) as observer:
        check_env(gym.make(ENV_ID, **kwargs, observer=observer), skip_render_check=True)
    env = SpecDecodeEnv(**kwargs)
    _, info = env.reset(seed=0, options={"batch_size": 3})
    assert info["batch_size"] == 3
    norm = env.credit.unit
    prompt_lens = [r.prompt_len for r in env.state.rows]
    tokens, done, total, seconds = 0, False, 0.0, 0.0
    while not done:
        _, reward, done, _, step_info = env.step(2)
        tokens += step_info["tokens"]
        total += reward
        seconds += step_info["seconds"]
    assert tokens == 3 * 8
    # the return is plain decoding's time of the same rows (8 steps of three rows, each at the batch's cache
    # width before it: the rows are left-padded to the longest prompt) minus the measured time
    assert len(set(prompt_lens)) > 1
    plain = sum(speed.step_seconds(max(prompt_lens) + j, 3) for j in range(8))
    assert env.credit.batch_seconds([8, 8, 8]) == pytest.approx(plain)
    assert total == pytest.approx((plain - seconds) / norm)
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
    # TensorRT-LLM's schedule beside it: k up to the last size that drafts, off above
    assert json.loads((tmp_path / "vllm-trtllm_schedule.json").read_text())["draft_len_schedule"] == {"15": K_MAX}
    # a second policy's export into the same folder keeps the first one's schedule
    other = tmp_path / "vllm_table_static.json"
    assert run_cli(export_vllm_main, ["--policy", "static:0", "--device", "cpu", "--profile", str(profile_path),
                                      "--traces", str(traces_path), "--k-max", str(K_MAX), "--max-batch", "20",
                                      "--episodes", "2", "--out", str(other)]) == 0
    assert json.loads((tmp_path / "trtllm_schedule_static.json").read_text())["draft_len_schedule"] == {}
    assert json.loads((tmp_path / "vllm-trtllm_schedule.json").read_text())["draft_len_schedule"] == {"15": K_MAX}
    code = run_cli(export_vllm_main, ["--policy", "batch-table", "--device", "cpu", "--profile", str(profile_path),
                                      "--traces", str(traces_path), "--k-max", str(K_MAX), "--max-batch", "20",
                                      "--episodes", "2", "--out", str(out), "--context-lens", "64,512"])
    entries = json.loads(out.read_text())["num_speculative_tokens_per_batch_size_and_context"]
    assert all(len(e) == 5 for e in entries) and {(e[2], e[3]) for e in entries} == {(0, 511), (512, 1023)}
    code = run_cli(export_vllm_main, ["--policy", "batch-table", "--device", "cpu", "--profile", str(tmp_path / "none.json")])
    assert code == 2 and "cost profile not found" in capsys.readouterr().err


def test_static_policy_in_batched_replay_drafts_the_widest_row():
    traces = [Trace("a", "c", [1, 2], list(range(10)), [4] * 10, [1] * 10, k_max=K_MAX),
              Trace("b", "c", [1, 2], list(range(10)), [0] * 10, [4] * 10, k_max=K_MAX)]
    env = ReplayEnv(traces, CostModel.from_profile(batch_profile()), k_max=K_MAX, noise=0.0, batch_sizes=[1, 2])
    env.reset(options={"trace_indices": [0, 1]})
    env.step(StaticK(3).choose_k(None))
    assert env.last_step.k == 3 and env.last_step.accepted_rows == [1, 0]


def test_plain_layers_seconds_counts_the_shrinking_batch():
    from specpilot.env.episode import plain_layers_seconds

    step = lambda context, rows: {1: 1.0, 2: 1.5, 3: 1.8}[rows]  # noqa: E731
    # rows generating 5, 2 and 2 tokens: 2 steps of three rows, then 3 steps of one row
    assert plain_layers_seconds([3, 3, 3], [5, 2, 2], 1, 5, step) == pytest.approx(2 * 1.8 + 3 * 1.0)
    assert plain_layers_seconds([3], [4], 1, 4, step) == pytest.approx(4.0)
    assert plain_layers_seconds([3, 3], [0, 0], 1, 0, step) == 0.0


def flat_batch_cost() -> CostModel:
    """Plain step: 0.1 s for one row, 0.16 s for two (context-independent); k drafted tokens cost
    0.02 s more per token at any batch size."""
    verify = [[0.1 + 0.02 * k for k in range(K_MAX + 1)]] * 2
    return CostModel([0, 10000], verify, [0.0, 0.0], [1, 2],
                     [verify[0], [0.16 + 0.02 * k for k in range(K_MAX + 1)]], [0.0, 0.0])


def test_batched_replay_credits_the_batch_time_not_the_tokens():
    """Row a accepts every draft, row b none: b decides when the batch ends, so speculating saves only
    what running b alone at the end saves, though the batch emits twice the tokens per step. The return
    is exactly (plain batch time - policy time) / plain step time, and the episode's speedup is plain
    batch time / policy time."""
    n = 12
    traces = [Trace("a", "c", [1, 2], list(range(n)), [K_MAX] * n, [K_MAX] * n, k_max=K_MAX),
              Trace("b", "c", [1, 2], list(range(n)), [0] * n, [K_MAX] * n, k_max=K_MAX)]
    cost = flat_batch_cost()
    plain = n * 0.16  # plain decoding: n steps of both rows
    for k, expected_seconds in [(0, plain), (2, n * (0.16 + 0.04))]:
        env = ReplayEnv(traces, cost, k_max=K_MAX, noise=0.0, batch_sizes=[2])
        env.reset(options={"trace_indices": [0, 1]})
        done, total, seconds = False, 0.0, 0.0
        while not done:
            _, r, done, _, info = env.step(k)
            total += r
            seconds += info["seconds"]
        if k:  # row a finished after n/3 steps; row b then ran alone, at one row's cost (k capped at its end)
            expected_seconds = (n // 3) * (0.16 + 0.04) + (n - n // 3 - 2) * (0.1 + 0.04) + 0.12 + 0.1
        assert seconds == pytest.approx(expected_seconds)
        assert total == pytest.approx((plain - seconds) / 0.16)
        assert info["spec_episode"]["speedup"] == pytest.approx(plain / seconds)
    assert plain / seconds == pytest.approx(1.032, abs=1e-3)
    # per-token accounting (tokens x a plain step's seconds per row at the live batch size) said 12%
    per_token = (n // 3) * (3 + 1) * 0.16 / 2 + (n - n // 3) * 0.1
    assert per_token / seconds == pytest.approx(1.118, abs=1e-3)


def test_batch_observation_sees_the_row_behind():
    traces = [Trace("a", "c", [1, 2], list(range(10)), [K_MAX] * 10, [K_MAX] * 10, k_max=K_MAX),
              Trace("b", "c", [1, 2], list(range(10)), [0] * 10, [0] * 10, k_max=K_MAX)]
    env = ReplayEnv(traces, flat_batch_cost(), k_max=K_MAX, noise=0.0, batch_sizes=[2])
    obs, _ = env.reset(options={"trace_indices": [0, 1]})
    behind, spread = FEATURES.index("behind_available_frac"), FEATURES.index("remaining_spread")
    assert obs[spread] == 0.0 and obs[behind] == pytest.approx(0.5)  # both rows equally far: the mean
    obs, *_ = env.step(2)  # row a takes 3 tokens, row b 1: b is behind and can draft nothing
    assert obs[behind] == 0.0 and obs[spread] == pytest.approx(1 / 10)


def test_replay_row_budget_is_max_new_tokens_not_its_trace_end():
    """The real loop does not know where a row will end (EOS): its remaining tokens count to the budget.
    The replay must not leak the trace's end into the observation; the row still stops there."""
    trace = Trace("a", "c", [1, 2], list(range(6)), [0] * 6, [0] * 6, k_max=K_MAX)  # ended (EOS) after 6 tokens
    env = ReplayEnv([trace], flat_batch_cost(), k_max=K_MAX, noise=0.0, max_new_tokens=10)
    env.reset(options={"trace_indices": [0]})
    obs, *_ = env.step(0)
    assert obs[FEATURES.index("remaining_frac")] == pytest.approx(9 / 10)
    steps, done = 1, False
    while not done:
        _, _, done, _, info = env.step(0)
        steps += 1
    assert steps == 6 and env.state.generated == trace.output_ids
    assert info["spec_episode"]["speedup"] == pytest.approx(1.0)  # plain decoding of the 6 tokens it did generate


def test_replay_speed_jitter_moves_cost_features_not_rewards():
    traces = [Trace(f"t{i}", "c", [1, 2], list(range(12)), [1] * 12, [2] * 12, k_max=K_MAX) for i in range(2)]
    verify_ms = FEATURES.index("verify_ms_per_token_log")
    runs = []
    for jitter in (1.0, 1.5):
        env = ReplayEnv(traces, flat_batch_cost(), k_max=K_MAX, noise=0.0, batch_sizes=[2], speed_jitter=jitter)
        seen, rewards = [], []
        for episode in range(6):
            env.reset(seed=episode, options={"trace_indices": [0, 1]})
            obs, r, *_ = env.step(2)
            seen.append(obs[verify_ms])
            rewards.append(r)
        runs.append((seen, rewards))
    (plain_ms, plain_r), (jitter_ms, jitter_r) = runs
    assert len(set(np.round(plain_ms, 6))) == 1 and len(set(np.round(jitter_ms, 6))) == 6
    np.testing.assert_allclose(jitter_r, plain_r, rtol=1e-9)
    with pytest.raises(SpecPilotError, match="speed_jitter"):
        ReplayEnv(traces, flat_batch_cost(), k_max=K_MAX, speed_jitter=0.5)


def test_paired_speedup_per_repeat_and_its_interval():
    """The machine is twice as slow in the second repeat; within each repeat the policy takes 0.8x plain's
    time, so its paired speedup is 1.25 in both and the interval collapses on it. A repeat where only
    plain decoding ran slow shows as that repeat's ratio and widens the interval."""
    from specpilot.bench.benchmark import BatchRun, summarize_batches

    def run(policy, repeat, seconds):
        return BatchRun(policy, 2, 0, ["a", "b"], repeat, 20, seconds, 10, 0, 0, 0.0, [0] * 10, [[1], [2]])

    runs = [run("none", 0, 1.0), run("fast", 0, 0.8), run("none", 1, 2.0), run("fast", 1, 1.6)]
    cell = summarize_batches(runs)["table"]["2"]["fast"]
    assert cell["speedup_per_repeat"] == pytest.approx([1.25, 1.25])
    assert cell["speedup_paired"] == pytest.approx(1.25)
    assert cell["speedup_paired_interval"] == pytest.approx([1.25, 1.25])
    runs += [run("none", 2, 3.0), run("fast", 2, 1.2)]  # a repeat where plain decoding was hit by noise
    cell = summarize_batches(runs)["table"]["2"]["fast"]
    assert cell["speedup_per_repeat"] == pytest.approx([1.25, 1.25, 2.5])
    assert cell["speedup_paired"] == pytest.approx((1.25 * 1.25 * 2.5) ** (1 / 3))
    low, high = cell["speedup_paired_interval"]
    assert low < 1.25 and high > 2.0
    assert summarize_batches(runs)["table"]["2"]["none"]["speedup_paired"] == pytest.approx(1.0)


def test_replay_prices_a_batch_at_the_real_loops_cache_width(tiny_pair):
    """Rows of different lengths are left-padded to the longest, and every step keeps max(accepted) + 1
    slots of each row: the real loop's cache grows that way, the replay's `width` follows the same rule from
    the same start, and the replay prices each step there, not at the rows' mean context. (Step by step the
    two accept differently at times: the real batch pads a row's short proposal with its last token, which
    a random tiny model sometimes accepts and the traces count as rejected.)"""
    from conftest import tiny_target
    from specpilot.decoding.drafters import NgramDrafter
    from specpilot.decoding.loop import speculative_step, start
    from specpilot.env.oracle import record_trace

    target = tiny_target(tiny_pair[0])
    prompts = [[5, 9, 13, 2, 7, 5, 9, 13, 2, 7, 5, 9], [3, 4, 3, 4, 3] + list(range(20, 60)) + [3, 4]]
    ks = [3, 2, 4, 1, 4, 0, 3, 4, 4, 2, 4, 4]
    state = start(target, NgramDrafter(2), prompts, 30)
    assert state.cache.get_seq_length() + 1 == max(map(len, prompts))
    grew = []
    for k in ks:
        before = state.cache.get_seq_length()
        step = speculative_step(state, k)
        assert state.cache.get_seq_length() - before == max(step.accepted_rows) + 1
        grew.append(max(step.accepted_rows) + 1)
    assert max(grew) > 1  # drafts were kept
    traces = [record_trace(target, NgramDrafter(2), p, 30, K_MAX, f"p{i}", "c") for i, p in enumerate(prompts)]
    env = ReplayEnv(traces, CostModel.from_profile(batch_profile()), k_max=K_MAX, noise=0.0, batch_sizes=[2])
    env.reset(options={"trace_indices": [0, 1]})
    asked = []
    env.cost.step_costs = lambda context, batch: (asked.append((context, batch)) or (np.full(K_MAX + 1, 0.1), 0.0))
    width = max(map(len, prompts))
    assert width != sum(map(len, prompts)) / 2
    for k in ks:
        n = len(asked)
        env.step(k)
        assert asked[n] == (width, 2)  # the step's own cost (the plain credit asks after it)
        width += max(env.last_step.accepted_rows) + 1
        assert env.state.width == width
    assert width > max(map(len, prompts)) + len(ks)


def test_plain_speed_prices_a_batch_from_its_measured_grid(tiny_model_dirs, tmp_path):
    """With batch sizes, the measured plain speed holds a batch x context grid: a batch's plain step is that
    grid's cell (interpolated in context and log batch), not one row's cost times a factor measured at one
    context; the grid survives save and load."""
    speed = PlainSpeed([16, 1024], [0.002, 0.003], batch_scale={1: 1.0, 4: 1.5},
                       grid={"batch_sizes": [1, 4], "context_lens": [16, 1024], "seconds": [[0.002, 0.003], [0.003, 0.009]]})
    assert speed.step_seconds(1024, 4) == pytest.approx(0.009)  # one factor would say 0.0045
    assert speed.step_seconds(520, 4) == pytest.approx(0.006)
    assert speed.step_seconds(520, 2) == pytest.approx(0.5 * (0.0025 + 0.006))  # halfway in log b
    assert speed.step_seconds(1024, 1) == pytest.approx(0.003)
    speed.save(tmp_path / "plain.json")
    assert PlainSpeed.load(tmp_path / "plain.json").step_seconds(1024, 4) == pytest.approx(0.009)
    no_grid = PlainSpeed([16, 1024], [0.002, 0.003], batch_scale={1: 1.0, 4: 1.5})
    assert no_grid.step_seconds(1024, 4) == pytest.approx(0.0045)  # older files: the factor
    target = load_target(tiny_model_dirs["target"], "float32", "cpu")
    measured = measure_plain_speed(target, list(range(3, 40)), context_lens=(16, 96), repeats=2, batch_sizes=(1, 2))
    assert measured.grid["batch_sizes"] == [1, 2] and measured.grid["context_lens"] == [16, 96]
    assert measured.step_seconds(96, 2) == pytest.approx(measured.grid["seconds"][1][1])
    assert all(s > 0 for row in measured.grid["seconds"] for s in row)


def test_the_paired_interval_uses_students_t_and_covers_95_percent():
    """The interval is exp(mean log +- t(n-1) standard errors): checked against scipy's quantiles, by hand on
    three ratios, and by coverage: of 4,000 sets of three log-normal per-repeat ratios around a known speedup,
    about 95% of the intervals hold it. The earlier +- 2 standard errors held it only ~82% of the time with three
    repeats (shown alongside), so the test fails on that formula."""
    import math
    import random
    import statistics

    from specpilot.bench.benchmark import paired_ratio, t975

    scipy_stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 3, 4, 7, 12, 30):
        assert t975(df) == pytest.approx(scipy_stats.t.ppf(0.975, df), abs=1e-3)
    assert t975(31) == 1.96
    with pytest.raises(ValueError):
        t975(0)
    ratios = [1.0, 1.1, 1.2]
    logs = [math.log(r) for r in ratios]
    half = 4.303 * statistics.stdev(logs) / math.sqrt(3)
    mean, (low, high) = paired_ratio(ratios)
    assert (low, high) == pytest.approx((mean * math.exp(-half), mean * math.exp(half)))
    assert paired_ratio([1.3]) == (pytest.approx(1.3), None)

    rng, truth, hits, hits_2se = random.Random(0), 1.05, 0, 0
    for _ in range(4000):
        sample = [truth * math.exp(rng.gauss(0, 0.05)) for _ in range(3)]
        _, (low, high) = paired_ratio(sample)
        hits += low <= truth <= high
        logs = [math.log(r) for r in sample]
        se = statistics.stdev(logs) / math.sqrt(3)
        hits_2se += math.exp(statistics.fmean(logs) - 2 * se) <= truth <= math.exp(statistics.fmean(logs) + 2 * se)
    assert 0.935 < hits / 4000 < 0.965
    assert hits_2se / 4000 < 0.86


def test_paired_cli_re_reads_a_committed_reports_ratios(tmp_path, capsys):
    """A report's JSON keeps per-repeat ratios, not runs: paired_cli recomputes the interval from them (over the
    report's --versus policy, or any two policies' speedups over plain in the same repeats divided), writes nothing
    beside the report, and names the policies it cannot compare."""
    import json

    from specpilot.bench.benchmark import paired_ratio
    from specpilot.bench.paired_cli import paired_main
    from specpilot.decoding.config import run_cli

    summary = {"table": {"1": {"learned": {"speedup_per_repeat": [1.2, 1.3, 1.25]},
                               "static:3": {"speedup_per_repeat": [1.1, 1.3, 1.0]},
                               "none": {"speedup_per_repeat": [1.0, 1.0, 1.0]}}},
               "versus": {"policy": "best-rule", "cells": {"learned": {"B=1": {"per_repeat": [1.01, 0.99, 1.03]}}}}}
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"meta": {}, "summary": summary}))
    assert run_cli(paired_main, ["--results", str(path), "--policy", "learned", "--versus", "best-rule"]) == 0
    mean, (low, high) = paired_ratio([1.01, 0.99, 1.03])
    assert f"B=1                          {mean:.3f} [{low:.3f}, {high:.3f}]" in capsys.readouterr().out
    assert run_cli(paired_main, ["--results", str(path), "--policy", "learned", "--versus", "none"]) == 0
    mean, (low, high) = paired_ratio([1.2, 1.3, 1.25])
    assert f"{mean:.3f} [{low:.3f}, {high:.3f}]" in capsys.readouterr().out
    assert run_cli(paired_main, ["--results", str(path), "--policy", "learned", "--versus", "static:3"]) == 0
    mean, (low, high) = paired_ratio([1.2 / 1.1, 1.0, 1.25])
    assert f"{mean:.3f} [{low:.3f}, {high:.3f}]" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"meta": {}, "summary": {"versus": {"policy": "best-rule", "cells": {
        "learned": {"B=1": {"per_repeat": [1.05]}}}}}}))
    assert run_cli(paired_main, ["--results", f"{path},{other}", "--policy", "learned", "--versus", "best-rule"]) == 0
    mean, (low, high) = paired_ratio([1.01, 0.99, 1.03, 1.05])  # the repeats of both reports pooled
    assert f"{mean:.3f} [{low:.3f}, {high:.3f}]" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.json", "report.json"]
    assert run_cli(paired_main, ["--results", str(path), "--policy", "learned", "--versus", "static:5"]) == 2
    assert "'learned' and 'static:5'" in capsys.readouterr().err


def test_paired_cli_splits_one_row_runs_by_category(tmp_path, capsys):
    """--by-category: each category's ratio comes from its own prompts' runs only, beside the overall cell; a
    report's summary (no runs) is refused in one line."""
    import json

    from specpilot.bench.paired_cli import paired_main
    from specpilot.decoding.config import run_cli

    def run(policy, repeat, category, seconds):
        return {"policy": policy, "batch_size": 1, "repeat": repeat, "category": category, "new_tokens": 10,
                "seconds": seconds}

    runs = [run(p, r, c, s) for r in range(2) for p, c, s in (
        ("learned", "qa", 1.0), ("best-rule", "qa", 2.0), ("learned", "rag", 2.0), ("best-rule", "rag", 1.0))]
    path = tmp_path / "batch_results.json"
    path.write_text(json.dumps({"meta": {}, "runs": runs}))
    assert run_cli(paired_main, ["--results", str(path), "--policy", "learned", "--versus", "best-rule", "--by-category"]) == 0
    out = capsys.readouterr().out
    assert "B=1 qa" in out and "2.000 [2.000, 2.000]" in out  # half the time on qa
    assert "B=1 rag" in out and "0.500 [0.500, 0.500]" in out
    assert "B=1                          1.000" in out  # 3 s each overall
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"meta": {}, "summary": {"table": {}}}))
    assert run_cli(paired_main, ["--results", str(report), "--by-category"]) == 2
    assert "needs the runs" in capsys.readouterr().err


def test_a_report_keeps_its_runs_timings_and_paired_cli_re_reads_them(tmp_path, capsys):
    """write_report keeps each run's timing and counts (not its token ids) in REPORT.json; paired_cli splits them
    by category from there and writes nothing beside the report."""
    import json

    from specpilot.bench.paired_cli import paired_main
    from specpilot.bench.report import write_report
    from specpilot.decoding.config import run_cli

    runs = [{"policy": p, "batch_size": 1, "batch_index": 0, "question_ids": ["q"], "repeat": r, "category": "qa",
             "new_tokens": 10, "seconds": s * (1 + r), "steps": 10, "token_ids": [[1] * 10], "ks": [0] * 10}
            for r in range(2) for p, s in (("learned", 1.0), ("best-rule", 1.25))]
    (tmp_path / "plot.png").write_bytes(b"png")
    report = write_report(tmp_path / "r" / "page.md", tmp_path / "plot.png", {}, {}, lambda png: f"![]({png})", runs)
    kept = json.loads(report.with_suffix(".json").read_text())["runs"]
    assert len(kept) == 4 and all("token_ids" not in run and "ks" not in run for run in kept)
    assert run_cli(paired_main, ["--results", str(report.with_suffix(".json")), "--by-category"]) == 0
    assert "B=1 qa                       1.250 [1.250, 1.250]" in capsys.readouterr().out
    assert sorted(x.name for x in report.parent.iterdir()) == ["page.json", "page.md", "page.png"]


def test_a_batch_replay_reports_its_drafts_confidences_as_the_real_loop_does():
    """A model draft's confidences and entropies at B > 1 are, per drafted depth, the mean over the rows (as
    `HeadDrafter.propose_batch` reports them), each row's taken at its own position; at one row, the row's own. (The
    replay used to report none at B > 1, so `draft_confidence_*` kept the last one-row value.)"""
    def trace(qid, scale):
        n = 6
        return Trace(qid, "c", list(range(5)), list(range(100, 100 + n)), [1] * n, [K_MAX] * n, k_max=K_MAX,
                     confidences=[[scale * (0.9 - 0.1 * d) - 0.01 * i for d in range(K_MAX)] for i in range(n)],
                     entropies=[[scale * (0.5 + 0.2 * d) + 0.01 * i for d in range(K_MAX)] for i in range(n)])

    traces = [trace("a", 1.0), trace("b", 0.5)]
    env = ReplayEnv(traces, CostModel.from_profile(batch_profile()), k_max=K_MAX, noise=0.0, batch_sizes=[1, 4])
    env.reset(seed=0, options={"trace_indices": [0, 1]})
    env.step(3)  # both rows at position 0: one drafted token accepted each, so both move to position 2
    first = env.last_step
    assert first.confidences == pytest.approx([0.75 * (0.9 - 0.1 * d) for d in range(3)])
    assert first.entropies == pytest.approx([0.75 * (0.5 + 0.2 * d) for d in range(3)])
    env.step(2)
    assert env.last_step.confidences == pytest.approx([0.75 * (0.9 - 0.1 * d) - 0.02 for d in range(2)])
    obs = env.observer.build(env.state)
    assert obs[FEATURES.index("draft_confidence_min")] == pytest.approx(0.75 * 0.8 - 0.02)
    env.reset(seed=0, options={"trace_indices": [1]})
    env.step(2)
    assert env.last_step.confidences == pytest.approx([0.5 * (0.9 - 0.1 * d) for d in range(2)])
