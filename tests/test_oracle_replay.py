"""The oracle DP, the replay env and their agreement with the real loop."""
from __future__ import annotations

import itertools
import random
import re
import zlib

import gymnasium as gym
import numpy as np
import pytest
import torch
from conftest import stretch_traces, tiny_target

from specpilot.decoding.drafters import ModelDrafter, NgramDrafter
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.loop import generate
from specpilot.decoding.policies import NoSpeculation, StaticK
from specpilot.decoding.sampling import Sampling
from specpilot.env import REPLAY_ENV_ID, PlainSpeed, ReplayEnv, SpecDecodeEnv
from specpilot.env.oracle import CostModel, OracleK, Trace, oracle_schedule, record_trace


def hand_cost(k_max=4):
    # verify cost nearly flat in k with a bump at k = 1..2 (like the fp32 CPU curve), draft 5 ms/token
    verify = [[0.070, 0.125, 0.150, 0.130, 0.140], [0.080, 0.135, 0.160, 0.140, 0.150]]
    return CostModel([64, 1024], [row[: k_max + 1] for row in verify], [0.005, 0.006])


def random_trace(rng, n, k_max=4):
    matches = [rng.randint(0, k_max) for _ in range(n)]
    available = [rng.choice([k_max, k_max, rng.randint(0, k_max)]) for _ in range(n)]
    return Trace("t", "c", list(range(10)), list(range(n)), matches, available, k_max=k_max)


def brute_force_schedule(trace: Trace, cost: CostModel, k_max: int) -> float:
    """The cheapest of every k sequence, each simulated step by step (no recurrence shared with the DP):
    (k_max + 1) ** n sequences of n choices (a run that ends early ignores the rest), tiny traces only."""
    n, n_prompt = len(trace.output_ids), len(trace.prompt_ids)
    best = float("inf")
    for ks in itertools.product(range(k_max + 1), repeat=n):
        total, i = 0.0, 0
        for k in ks:
            if i >= n:
                break
            drafted = min(k, trace.available[i], n - i - 1)
            total += cost.step_costs(n_prompt + i)[0][drafted]
            i += min(drafted, trace.matches[i]) + 1
        best = min(best, total)
    return best


@pytest.mark.parametrize("seed", range(8))
def test_oracle_dp_equals_brute_force(seed):
    rng = random.Random(seed)
    trace = random_trace(rng, 7)
    cost = hand_cost()
    best, path = oracle_schedule(trace, cost, 3)
    assert best == pytest.approx(brute_force_schedule(trace, cost, 3))
    # the returned path really costs `best`
    total, i = 0.0, 0
    for k in path:
        drafted = min(k, trace.available[i])
        total += cost.step_costs(10 + i)[0][drafted]
        i += min(drafted, trace.matches[i]) + 1
    assert i == 7 and total == pytest.approx(best)


def test_oracle_never_worse_than_any_static_k():
    rng = random.Random(0)
    cost = hand_cost()
    for _ in range(20):
        trace = random_trace(rng, 30)
        best, _ = oracle_schedule(trace, cost, 4)
        for k in range(5):
            total, i = 0.0, 0
            while i < 30:
                kk = min(k, 30 - i - 1)
                drafted = min(kk, trace.available[i])
                total += cost.step_costs(10 + i)[0][drafted]
                i += min(drafted, trace.matches[i]) + 1
            assert best <= total + 1e-12


@pytest.fixture(scope="module")
def recorded(tiny_pair):
    target_model, draft_model = tiny_pair
    target = tiny_target(target_model)
    draft = ModelDrafter(draft_model, "perturbed", target_model.config.vocab_size)
    prompt = [5, 9, 13, 2, 7, 5, 9]
    trace = record_trace(target, draft, prompt, 30, 4, "p0", "test")
    return target, draft, trace


def test_trace_is_the_plain_output(recorded):
    target, _, trace = recorded
    assert trace.output_ids == generate(target, None, NoSpeculation(), trace.prompt_ids, 30).token_ids
    assert 0 < sum(trace.matches) < 4 * len(trace.matches)


@pytest.mark.parametrize("kind", ["model", "ngram"])
def test_replay_env_matches_real_env(recorded, kind):
    target, draft, trace = recorded
    from specpilot.decoding.observation import FEATURES
    from specpilot.decoding.prompts import Prompt

    if kind == "ngram":
        draft = NgramDrafter(2)
        trace = record_trace(target, draft, [5, 9, 13, 2, 7, 5, 9, 13, 2, 7, 5, 9], 30, 4, "p0", "test")
        assert sum(trace.available) > 0

    real = SpecDecodeEnv(target, draft, [Prompt("p0", "test", "unused")], k_max=4, max_new_tokens=30,
                         plain_speed=PlainSpeed([1, 100], [0.001, 0.001]), encoded=[trace.prompt_ids])
    replay = ReplayEnv([trace], hand_cost(), k_max=4, noise=0.0)
    assert trace.ngram_n == (2 if kind == "ngram" else 0)
    obs_real, _ = real.reset(seed=0)
    obs_replay, _ = replay.reset(seed=0)
    same = [FEATURES.index(f) for f in ("ngram_match_len", "draft_available_frac", "accept_rate_ema", "last_k_frac",
                                         "context_len_log", "remaining_frac", "repetition_rate", "ngram_suffix_log",
                                         "ngram_occurrences_log", "ngram_agreement")]
    seen = []
    rng = np.random.default_rng(4)
    done = False
    while not done:
        np.testing.assert_allclose(obs_real[same], obs_replay[same], rtol=1e-5)
        seen.append(obs_real[same[-3:]])
        action = int(rng.integers(0, 5))
        obs_real, _, done, _, info_real = real.step(action)
        obs_replay, _, done_replay, _, info_replay = replay.step(action)
        assert (info_real["k"], info_real["accepted"], info_real["tokens"]) == \
               (info_replay["k"], info_replay["accepted"], info_replay["tokens"])
        assert done == done_replay
    assert replay.state.generated == real.state.generated == trace.output_ids
    if kind == "ngram":  # the match statistics varied along the way (the comparison above was not of zeros)
        assert len({tuple(np.round(v, 4)) for v in seen}) > 2


def test_replay_env_checkers(recorded):
    from gymnasium.utils.env_checker import check_env
    from stable_baselines3.common.env_checker import check_env as sb3_check_env

    _, _, trace = recorded
    check_env(gym.make(REPLAY_ENV_ID, traces=[trace], cost=hand_cost(), k_max=4), skip_render_check=True)
    sb3_check_env(ReplayEnv([trace], hand_cost(), k_max=4), warn=True)


def test_oracle_policy_replays_its_schedule(recorded):
    target, draft, trace = recorded
    cost = hand_cost()
    oracle = OracleK([trace], cost, 4)
    oracle.prepare("p0")
    result = generate(target, draft, oracle, trace.prompt_ids, 30)
    assert result.token_ids == trace.output_ids
    best, path = oracle_schedule(trace, cost, 4)
    assert [s.k_requested for s in result.steps] == path


def test_ngram_trace_available_counts():
    trace_draft = NgramDrafter(2)
    import torch

    context = torch.tensor([1, 2, 3, 4, 1, 2])
    tokens, n = trace_draft.lookup(context, 4)
    assert tokens.tolist() == [3, 4, 1, 2] and n == 2
    tokens, n = trace_draft.lookup(torch.tensor([1, 2, 3]), 4)
    assert tokens.tolist() == [] and n == 0


def test_saved_reward_return_is_time_saved(recorded):
    """With reward 'saved', an episode's return is exactly (plain time - policy time) / plain step time."""
    _, _, trace = recorded
    cost = CostModel([0, 10000], [[0.1, 0.15, 0.16, 0.17, 0.18]] * 2, [0.0, 0.0])  # flat in context
    for reward in ("saved", "speedup"):
        env = ReplayEnv([trace], cost, k_max=4, noise=0.0, reward=reward)
        env.reset(seed=0)
        done, total, seconds = False, 0.0, 0.0
        while not done:
            _, r, done, _, info = env.step(4)
            total += r
            seconds += info["seconds"]
        n = len(trace.output_ids)
        if reward == "saved":
            assert total == pytest.approx((0.1 * n - seconds) / 0.1)
        else:
            assert total > 0


def test_replay_evaluate_reproduces_the_oracle(recorded):
    """Through the noise-free replay env the oracle policy costs exactly the DP's minimum, and no
    other policy beats it."""
    from specpilot.env.replay_env import replay_evaluate

    _, _, trace = recorded
    cost = hand_cost()
    policies = {"none": NoSpeculation(), "static:2": StaticK(2), "static:4": StaticK(4), "oracle": OracleK([trace], cost, 4)}
    results = replay_evaluate(policies, [trace], cost, 4)
    plain = sum(cost.step_costs(len(trace.prompt_ids) + i)[0][0] for i in range(len(trace.output_ids)))
    assert results["oracle"]["speedup"] == pytest.approx(plain / oracle_schedule(trace, cost, 4)[0])
    assert results["none"]["speedup"] == pytest.approx(1.0)
    assert all(r["fraction_of_oracle"] <= 1.0 + 1e-9 for r in results.values())


def test_replay_check_sees_what_the_real_loop_sees(recorded):
    """Policies that ignore timing and hardware choose the same k on the real loop and on its replay;
    a policy reading a feature the replay fakes is caught, and the feature is named."""
    from specpilot.bench.replay_check import replay_check
    from specpilot.decoding.hardware import HW_FEATURES
    from specpilot.decoding.observation import FEATURES
    from specpilot.decoding.policies import HeuristicK, LengthPolicy

    target, draft, trace = recorded
    for policy in (StaticK(3), HeuristicK(4)):
        result = replay_check(target, draft, policy, [trace.prompt_ids], [trace], hand_cost(), 1, 30, 4)
        assert result["real_k"] == result["replay_k"] and result["k_distance"] == 0.0
        assert sum(result["real_k"]) > 5

    class ReadsHardware(LengthPolicy):
        k_max = 4

        def choose_k(self, obs):
            return 3 if obs[FEATURES.index("hw_cpu_available")] > 5 else 1

    fake = np.full(len(HW_FEATURES), 7.0, dtype=np.float32)  # the replay's recorded counters: out of any real range
    result = replay_check(target, draft, ReadsHardware(), [trace.prompt_ids], [trace], hand_cost(), 1, 30, 4, fake)
    assert result["k_distance"] == 1.0 and result["replay_k"][3] == sum(result["replay_k"])
    real_mean, replay_mean, shift = result["features"]["hw_cpu_available"]
    assert real_mean <= 1.0 and replay_mean == pytest.approx(7.0) and shift < -1.0


def test_cost_jitter_reprices_each_k_per_episode_and_keeps_the_reward_exact():
    """With cost_jitter, a step drafting k >= 1 costs the profile's price times that episode's factor for k (the
    same factor on every step of the episode, another one next episode), a plain step its profile price; the
    return stays the time saved against plain decoding, so the jitter moves costs, not the reward's meaning."""

    trace = random_trace(random.Random(3), 30)
    cost = hand_cost()
    env = ReplayEnv([trace], cost, k_max=4, noise=0.0, cost_jitter=0.1)
    shapes = []
    for episode in range(3):
        env.reset(seed=episode)
        shapes.append(env.shape.copy())
        assert env.shape[0] == 1.0
        done, total, seconds, i = False, 0.0, 0.0, 0
        while not done:
            k = [0, 1, 2, 3, 4][i % 5]
            _, r, done, _, info = env.step(k)
            profile = cost.step_costs(env.last_step.context_len)[0][info["k"]]
            assert info["seconds"] == pytest.approx(profile * shapes[-1][info["k"]])
            total, seconds, i = total + r, seconds + info["seconds"], i + 1
        plain = sum(cost.step_costs(len(trace.prompt_ids) + j)[0][0] for j in range(len(trace.output_ids)))
        assert env.episode.plain_seconds == pytest.approx(plain)
        # (the prompt is 10 tokens: every step is priced below the profile's first context, flat)
        assert total == pytest.approx((plain - seconds) / cost.step_costs(len(trace.prompt_ids))[0][0])
    assert not np.allclose(shapes[0], shapes[1]) and np.all(np.abs(np.log(shapes[0][1:])) < 0.6)
    off = ReplayEnv([trace], cost, k_max=4, noise=0.0)
    off.reset(seed=0)
    assert np.all(off.shape == 1.0)
    with pytest.raises(SpecPilotError, match="cost_jitter"):
        ReplayEnv([trace], cost, k_max=4, cost_jitter=-0.1)


def test_replay_evaluate_prices_each_k_by_a_given_cost_shape():
    """replay_evaluate(shape=...): every step drafting k' tokens costs the profile's price times shape[k'] (a
    brute-force walk of the trace), plain decoding keeps its price; cost_shape draws such factors, 1 at k = 0."""
    from specpilot.env.replay_env import cost_shape, replay_evaluate

    trace, cost = random_trace(random.Random(5), 40), hand_cost()
    shape = np.array([1.0, 1.5, 0.7, 2.0, 1.1])

    def brute(k: int, factors) -> float:
        n, i, seconds = len(trace.output_ids), 0, 0.0
        while i < n:
            drafted = min(k, n - i - 1, trace.available[i])
            seconds += cost.step_costs(len(trace.prompt_ids) + i)[0][drafted] * factors[drafted]
            i += min(drafted, trace.matches[i]) + 1
        return seconds

    plain = brute(0, np.ones(5))
    for k in (1, 2, 3, 4):
        got = replay_evaluate({"s": StaticK(k)}, [trace], cost, 4, shape=shape)["s"]["speedup"]
        assert got == pytest.approx(plain / brute(k, shape))
        assert replay_evaluate({"s": StaticK(k)}, [trace], cost, 4)["s"]["speedup"] == pytest.approx(plain / brute(k, np.ones(5)))
    draws = [cost_shape(np.random.default_rng(s), 4, 0.1) for s in range(3)]
    assert all(d[0] == 1.0 and len(d) == 5 for d in draws) and not np.allclose(draws[0], draws[1])
    with pytest.raises(SpecPilotError, match="one factor per k"):
        replay_evaluate({"s": StaticK(1)}, [trace], cost, 4, shape=np.ones(3))


def test_hindsight_q_is_the_oracle_and_prices_what_the_replay_env_steps():
    """Q*(i, k): its minimum at position 0 is the oracle's total (and the brute force's); taking k at i and then the
    oracle's choices, stepped in the replay env, costs exactly Q*(i, k) from there; with a budget shorter than the
    trace the row ends at the budget."""
    from specpilot.env.oracle import hindsight_q, truncate

    rng = random.Random(7)
    cost = hand_cost()
    for _ in range(3):
        trace = random_trace(rng, 7)
        q = hindsight_q(trace, cost, 4)
        assert q.shape == (7, 5)
        assert q[0].min() == pytest.approx(oracle_schedule(trace, cost, 4)[0])
        assert q[0].min() == pytest.approx(brute_force_schedule(trace, cost, 4))
    trace = random_trace(rng, 30)
    q = hindsight_q(trace, cost, 4)
    env = ReplayEnv([trace], cost, k_max=4, noise=0.0)
    for start_k in range(5):
        env.reset(options={"trace_index": 0})
        done, seconds, first = False, 0.0, True
        while not done:
            i = env.state.rows[0].length - env.state.rows[0].prompt_len
            k = start_k if first else int(np.argmin(q[i]))
            _, _, done, _, info = env.step(k)
            seconds, first = seconds + info["seconds"], False
        assert seconds == pytest.approx(q[0, start_k])
    short = hindsight_q(trace, cost, 4, budget=12)
    assert short.shape == (12, 5) and short[0].min() == pytest.approx(oracle_schedule(truncate(trace, 12), cost, 4)[0])


def replay_steps(trace: Trace, k: int) -> int:
    """Steps static:k takes on a trace: from i it drafts min(k, a(i), n - i - 1) and keeps min(that, m(i)) + 1."""
    i, steps, n = 0, 0, len(trace.output_ids)
    while i < n:
        drafted = min(k, trace.available[i], n - i - 1)
        i += min(drafted, trace.matches[i]) + 1
        steps += 1
    return steps


def mean_gap(a: list[int], b: list[int]) -> float:
    """(mean a - mean b) in standard errors of the difference."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    return float((a.mean() - b.mean()) / np.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b)))


def test_sampled_traces_replay_speculative_sampling(tiny_pair, monkeypatch):
    """With prompt lookup, speculative sampling is a function of one sampled continuation (env/oracle.py): the
    steps static:3 takes in the real loop, over many seeds, have the mean of its replay on sampled traces. A
    verifier that keeps a drafted token only when it is the target's argmax (a greedy check left in the
    sampling path) is caught by the same statistic."""
    import specpilot.decoding.loop as loop

    target = tiny_target(tiny_pair[0])
    draft = NgramDrafter(2)
    prompt = [5, 9, 13, 2, 7, 5, 9, 13, 2, 7, 5, 9, 13, 2]
    sampling, n, runs = Sampling(temperature=0.3), 16, 150
    traces = [record_trace(target, draft, prompt, n, 4, sampling=sampling, seed=10_000 + s) for s in range(runs)]
    assert len({tuple(t.output_ids) for t in traces}) > 10  # the continuations do differ
    assert traces[0].output_ids == generate(target, None, NoSpeculation(), prompt, n, sampling, seed=10_000).token_ids
    replayed = [replay_steps(t, 3) for t in traces]
    real = [len(generate(target, draft, StaticK(3), prompt, n, sampling, seed=s).steps) for s in range(runs)]
    assert abs(mean_gap(real, replayed)) < 3.5, (np.mean(real), np.mean(replayed))

    def argmax_only(tokens, draft_probs, target_probs, generator):
        top = target_probs.argmax(-1)
        keep = int((tokens == top[: len(tokens)]).int().cumprod(0).sum()) if len(tokens) else 0
        return keep, torch.cat([tokens[:keep], top[keep].reshape(1)])

    monkeypatch.setattr(loop, "verify_sampling", argmax_only)
    broken = [len(generate(target, draft, StaticK(3), prompt, n, sampling, seed=s).steps) for s in range(runs)]
    assert abs(mean_gap(broken, replayed)) > 5, (np.mean(broken), np.mean(replayed))


def test_sampled_trace_needs_a_deterministic_draft(tiny_pair):
    target, draft_model = tiny_pair
    draft = ModelDrafter(draft_model, "perturbed", target.config.vocab_size)
    with pytest.raises(SpecPilotError, match="prompt-lookup"):
        record_trace(tiny_target(target), draft, [5, 9, 13], 4, 4, sampling=Sampling(temperature=1.0))


def test_profile_records_sampled_traces_beside_the_greedy_ones(tiny_model_dirs, tmp_path):
    """`profile_device --temperature T` writes traces-PAIR-tT.json (its meta: temperature and seed), each trace the
    seeded sampled continuation; the greedy traces stay untouched; a model draft is refused."""
    import json

    from specpilot.bench.profile_cli import profile_main
    from specpilot.decoding.config import run_cli
    from specpilot.decoding.models import load_target
    from specpilot.decoding.paths import pair_name

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": f"q{i}", "category": "c", "split": "train",
                                           "turns": [text]}) + "\n" for i, text in enumerate(["abcabcabc", "hello hello"])))
    args = ["--device", "cpu", "--target", tiny_model_dirs["target"], "--draft", "ngram:2", "--k-max", "4",
            "--prompts", str(prompts), "--max-new-tokens", "10", "--no-costs", "--no-progress", "--out", str(tmp_path)]
    assert profile_main(args) == 0
    assert profile_main(args + ["--temperature", "1.5", "--trace-seed", "3"]) == 0
    pair = pair_name("ngram:2", tiny_model_dirs["target"])  # traces belong to a (target, draft) pair
    greedy = json.loads((tmp_path / f"traces-{pair}.json").read_text())
    sampled = json.loads((tmp_path / f"traces-{pair}-t1.5.json").read_text())
    assert "temperature" not in greedy["meta"] and (sampled["meta"]["temperature"], sampled["meta"]["seed"]) == (1.5, 3)
    target = load_target(tiny_model_dirs["target"], "float32", "cpu")
    for t in sampled["traces"]:
        seed = 3 + zlib.crc32(t["question_id"].encode())
        assert t["output_ids"] == generate(target, None, NoSpeculation(), t["prompt_ids"], 10, Sampling(1.5), seed).token_ids
    assert [t["output_ids"] for t in sampled["traces"]] != [t["output_ids"] for t in greedy["traces"]]
    assert run_cli(profile_main, args[:4] + ["--draft", tiny_model_dirs["draft"]] + args[6:] + ["--temperature", "1"]) == 2


def test_step_cost_check_prices_each_real_step_and_names_the_k_the_profile_underprices():
    """Real seconds twice the profile's price on plain steps and three times on k = 2 steps, at several
    context lengths: relative to the plain steps k = 2 runs 1.5x its price, and the whole run's factor is
    the brute-force sum's."""
    from specpilot.bench.replay_check import step_cost_check
    from specpilot.decoding.loop import StepResult

    cost = hand_cost()
    plan = [(0, 64, 2.0), (2, 64, 3.0), (0, 900, 2.0), (2, 900, 3.0), (2, 300, 3.0), (1, 500, 2.0)]
    steps, priced = [], []
    for k, context, factor in plan:
        price = cost.step_costs(context)[0][k]
        steps.append(StepResult(k=k, k_requested=k, accepted=0, new_tokens=[1], draft_s=0.25 * price * factor,
                                verify_s=0.75 * price * factor, context_len=context))
        priced.append(price)
    result = step_cost_check(steps, cost)
    assert result["scale"] == pytest.approx(2.0)
    assert [result["by_k"][k][0] for k in (0, 1, 2)] == [2, 1, 3]
    assert [result["by_k"][k][3] for k in (0, 1, 2)] == pytest.approx([1.0, 1.0, 1.5])
    real = sum(p * f for p, (_, _, f) in zip(priced, plan))
    assert result["real_over_priced"] == pytest.approx(real / sum(priced) / 2.0)
    assert result["real_over_priced"] > 1.0


def test_a_machine_far_from_its_profiles_speed_is_named_in_one_warning():
    """The benchmark's speed check: one-row unloaded plain runs, each priced at its own prompt's context, against
    the profile; within the tolerance nothing is said, 2x slower is one line; other runs do not count."""
    from types import SimpleNamespace

    from specpilot.bench.replay_check import SPEED_TOLERANCE, machine_speed_warning, plain_speed_ratio

    cost = CostModel([0, 1000], [[0.1, 0.2], [0.3, 0.4]], [0.0, 0.0])  # plain step 0.1 s at 0 tokens, 0.3 s at 1,000

    def run(policy, seconds, qid, batch=1, load="none"):
        return SimpleNamespace(policy=policy, batch_size=batch, steps=10, seconds=seconds, new_tokens=0,
                               question_ids=[qid], load=load)

    lens = {"short": 0, "long": 1000}
    same = [run("none", 1.0, "short"), run("none", 3.0, "long"), run("static:3", 9.0, "short"),
            run("none", 9.0, "short", batch=2), run("none", 9.0, "short", load="compute")]
    assert plain_speed_ratio(same, lens, cost) == pytest.approx(1.0, rel=0.03)  # the model prices context buckets
    assert machine_speed_warning(plain_speed_ratio(same, lens, cost), "p.json") is None
    slow = [run("none", 2.0, "short"), run("none", 6.0, "long")]
    line = machine_speed_warning(plain_speed_ratio(slow, lens, cost), "p.json")
    assert re.match(r"plain decoding here takes (1\.9\d|2\.0\d)x the time the cost profile p\.json prices", line)
    assert "\n" not in line
    assert machine_speed_warning(1 / (SPEED_TOLERANCE + 0.01), "p") is not None
    assert plain_speed_ratio([run("static:3", 1.0, "short")], lens, cost) is None


def test_traces_of_another_target_are_refused_in_one_line(tmp_path):
    """Acceptance belongs to the (target, draft) pair: traces recorded with another target are a one-line error;
    the same weights through another kernel (the loader's ' [small-rows gemm]' mark) are the same target."""
    from specpilot.env.oracle import load_draft_traces, save_traces

    path = tmp_path / "traces.json"
    made = stretch_traces(4, 3, 36)
    save_traces(made, path, {"target": "Model-A (weights x)", "draft": "ngram:3", "k_max": 4, "max_new_tokens": 36})
    traces, _ = load_draft_traces(path, "ngram:3", target_name="Model-A (weights x) [small-rows gemm]")
    assert len(traces) == len(made)
    with pytest.raises(SpecPilotError) as error:
        load_draft_traces(path, "ngram:3", target_name="Model-B")
    assert "recorded with target 'Model-A (weights x)', not 'Model-B'" in str(error.value)
    assert "\n" not in str(error.value)
