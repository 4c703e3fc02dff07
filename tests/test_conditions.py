"""Machine conditions (issue 19): the simulated power cap and co-tenant move the best k the way the physics says,
the replay env draws a condition per episode with its own costs and counters and keeps the reward exact under
it, the warm start labels every (context, condition), and the report's ablation shows what the counters carry."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from specpilot.agents.improve import collect
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.hardware import HW_FEATURES
from specpilot.decoding.learned import LearnedK
from specpilot.decoding.policies import StaticK
from specpilot.env.oracle import CostModel, Trace
from specpilot.env.replay_env import MachineCondition, ReplayEnv
from specpilot.env.simulate import CONDITIONS, simulate_profile

from test_reward import brute_plain_seconds

ROOT = Path(__file__).resolve().parents[1]
TARGET = str(ROOT / "configs" / "llama-3.1-8b")
SIZES, CONTEXTS = [1, 8, 32, 128], [512, 4096, 16384]


def best_k(profile, batch, context, accept=0.6, k_max=8):
    tokens = np.array([(1 - accept ** (k + 1)) / (1 - accept) for k in range(k_max + 1)])
    return int(np.argmax(tokens / CostModel.from_profile(profile).step_costs(context, batch)[0]))


@pytest.fixture(scope="module")
def profiles():
    return {c: simulate_profile("a100", TARGET, None, 8, SIZES, CONTEXTS, c) for c in CONDITIONS}


def test_a_power_cap_lowers_and_a_cotenant_raises_the_best_k_where_compute_binds(profiles):
    none, cap, cotenant = profiles["none"], profiles["power-cap"], profiles["cotenant"]
    # one row: memory-bound under every condition, any k nearly free: the best k does not move
    assert best_k(none, 1, 512) == best_k(cap, 1, 512) == best_k(cotenant, 1, 512)
    # a large batch's verify pass is compute-bound: a lower clock makes it dearer than the (memory-bound) plain step
    assert best_k(cap, 32, 512) < best_k(none, 32, 512) and best_k(cap, 128, 4096) < best_k(none, 128, 4096)
    # less bandwidth makes every step memory-bound again: speculation pays where it did not
    assert best_k(cotenant, 128, 512) > best_k(none, 128, 512)
    # and the scale: a co-tenant halving the bandwidth doubles a one-row step (memory-bound)
    one = lambda p: CostModel.from_profile(p).step_costs(512, 1)[0][0]  # noqa: E731
    assert one(cotenant) / one(none) == pytest.approx(2.0, rel=0.05)


def test_the_counters_say_which_condition_it_is(profiles):
    read = {c: dict(zip(HW_FEATURES, p["hardware"])) for c, p in profiles.items()}
    assert read["power-cap"]["hw_sm_clock_ratio"] < read["none"]["hw_sm_clock_ratio"] == 1.0
    assert read["power-cap"]["hw_power_ratio"] > read["none"]["hw_power_ratio"]
    assert read["cotenant"]["hw_gpu_mem_util"] > read["none"]["hw_gpu_mem_util"]
    assert read["none"]["hw_gpm_available"] == 0.0  # an A100 has no GPM (Hopper and newer)
    dram = {c: dict(zip(HW_FEATURES, simulate_profile("h100", TARGET, None, 2, [1], [512], c)["hardware"]))[
        "hw_gpm_dram_bw_util"] for c in ("none", "cotenant")}  # Hopper: GPM reads the DRAM bandwidth in use
    assert dram["cotenant"] > dram["none"] > 0
    assert profiles["both"]["condition"]["name"] == "both" and "both" in profiles["both"]["hardware_name"]
    with pytest.raises(SpecPilotError, match="known conditions"):
        simulate_profile("a100", TARGET, None, 2, [1], [512], "overclocked")


def traces(n=6, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(8, 30)
        out.append(Trace(f"q{i}", "c", list(range(rng.randint(5, 40))), [7] * length,
                         [rng.randint(0, 6) for _ in range(length)], [rng.randint(0, 8) for _ in range(length)],
                         match_lens=[rng.randint(0, 3) for _ in range(length)], k_max=8))
    return out


def conditions(profiles):
    return [MachineCondition(c, CostModel.from_profile(p), np.asarray(p["hardware"], dtype=np.float32))
            for c, p in profiles.items()]


def test_each_episode_runs_under_one_condition_and_the_return_stays_exact(profiles):
    """The return of an episode is the plain time saved under the episode's own condition (brute force)."""
    conds = conditions(profiles)
    env = ReplayEnv(traces(), conds[0].cost, k_max=8, noise=0.0, batch_sizes=[1, 2, 3], context_lens=[512, 4096],
                    conditions=conds)
    seen = set()
    rng = np.random.default_rng(0)
    for episode in range(40):
        obs, info = env.reset(seed=episode)
        seen.add(info["condition"])
        chosen = next(c for c in conds if c.name == info["condition"])
        assert np.array_equal(obs[: len(HW_FEATURES)], chosen.hardware)  # the counters of its condition
        assert env.cost is chosen.cost
        rows = env.state.rows
        prompts, ends = [r.context_offset + r.prompt_len for r in rows], [r.end for r in rows]
        total = seconds = 0.0
        done = False
        while not done:
            _, reward, done, _, info = env.step(int(rng.integers(0, 9)))
            total += reward
            seconds += info["seconds"]
        plain = brute_plain_seconds(prompts, ends, lambda c, b: float(chosen.cost.step_costs(c, b)[0][0]))
        assert total == pytest.approx((plain - seconds) / env.credit.unit, rel=1e-9, abs=1e-9)
    assert seen == set(CONDITIONS)
    obs, info = env.reset(options={"condition": "power-cap"})
    assert info["condition"] == "power-cap"
    with pytest.raises(SpecPilotError, match="unknown condition"):
        env.reset(options={"condition": "thermal"})


def test_counter_noise_reads_each_counter_off_per_episode(profiles):
    conds = conditions(profiles)
    env = ReplayEnv(traces(), conds[0].cost, k_max=8, noise=0.0, conditions=conds[:1], hardware_noise=0.05)
    first = env.reset(seed=1)[0][: len(HW_FEATURES)]
    second = env.reset(seed=2)[0][: len(HW_FEATURES)]
    assert not np.array_equal(first, second) and np.abs(first - conds[0].hardware).max() < 0.3
    assert (first >= 0).all()


def test_the_warm_start_labels_every_context_under_every_condition(profiles, monkeypatch):
    """collect: episode j runs context j mod C under condition j div C mod N, with that condition's costs."""
    conds = conditions(profiles)
    seen = []
    reset = ReplayEnv.reset

    def spy(self, *args, **kwargs):
        out = reset(self, *args, **kwargs)
        seen.append((self.state.rows[0].context_len >= 4096, next(c.name for c in conds if c.cost is self.cost)))
        return out

    monkeypatch.setattr(ReplayEnv, "reset", spy)
    data = collect(StaticK(2), traces(), conds[0].cost, 8, None, [2], {2: 8}, 12, progress=False,
                   context_lens=[512, 4096], conditions=conds)
    assert seen == [(j % 2 == 1, list(CONDITIONS)[(j // 2) % 4]) for j in range(8)]
    assert len(data.obs) > 0 and (data.regret >= 0).all() and (data.regret.min(axis=1) == 0).all()


def test_conditions_report_end_to_end(tmp_path):
    """`scripts/conditions_report.py` on one cell with the committed simulated A100 policy (exported before the
    match-statistics features: it is read by name): the report, its JSON and plot are written; under no load,
    pinning the counters to their no-load reading changes nothing, and under the power cap the policy that reads
    them is ahead of the pinned one (what the counters carry), each speedup equal to a direct replay."""
    from specpilot.bench.conditions_cli import PINNED, conditions_main
    from specpilot.bench.simulated_cli import SimulatedReportConfig, split_traces
    from specpilot.env.oracle import load_profile, profile_hardware
    from specpilot.env.replay_env import replay_evaluate

    report = tmp_path / "conditions.md"
    assert conditions_main(["--devices", "a100", "--batch-sizes", "32", "--context-lens", "512",
                            "--conditions", "none,power-cap", "--report", str(report)]) == 0
    assert report.exists() and report.with_suffix(".png").exists()
    cells = {c: v["cells"]["32x512"] for c, v in json.loads(report.with_suffix(".json").read_text())["results"]["a100"]["conditions"].items()}
    assert cells["none"]["learned"] == pytest.approx(cells["none"][PINNED], rel=1e-12)
    assert cells["power-cap"]["learned"] > 1.05 * cells["power-cap"][PINNED]
    policy = LearnedK.load(ROOT / "policies-simulated" / "a100" / "ngram-3", allow_device_mismatch=True, replay=True)
    from specpilot.decoding.observation import FEATURES
    assert "ngram_agreement" not in policy.features and len(policy.features) < len(FEATURES)  # an older policy
    profile = load_profile(ROOT / "profiles" / "a100-power-cap-simulated.json", "a100")
    test = split_traces(SimulatedReportConfig(), "test")
    direct = replay_evaluate({"learned": policy}, test, CostModel.from_profile(profile), 8, profile_hardware(profile), 32, 48,
                             context_len=512)
    assert direct["learned"]["speedup"] == pytest.approx(cells["power-cap"]["learned"], rel=1e-9)


def test_a_simulated_policy_on_real_hardware_warns_in_one_line(capsys):
    """Loading a policy trained on a SIMULATED profile for the real loop says so in one warning line; for a replay
    (replay=True, as the simulated reports load it) it says nothing."""
    folder = ROOT / "policies-simulated" / "a100" / "ngram-3"
    LearnedK.load(folder, allow_device_mismatch=True, replay=True)
    assert capsys.readouterr().err == ""
    LearnedK.load(folder, allow_device_mismatch=True)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: ") and "SIMULATED" in lines[0]


def test_a_cpu_without_its_own_policy_takes_another_cpus_with_a_warning(tmp_path, monkeypatch, capsys):
    """On a CPU machine key with no policy of its own, the shipped CPU policy for that draft is used, with one
    warning line naming whose it is; another device kind (a GPU key) gets none and a one-line error."""
    from specpilot.decoding.learned import default_policy_path

    monkeypatch.chdir(tmp_path)  # no policies/ here: the package's own are found
    path = default_policy_path("cpu-other-model-64c", "ngram:3")
    assert path.parent.parent.name == "cpu-amd-epyc-2c" and path.name == "policy.json"
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "no policy for this machine (cpu-other-model-64c)" in lines[0]
    with pytest.raises(SpecPilotError, match="no learned policy for device 'a6000'"):
        default_policy_path("a6000", "ngram:3")


def test_commands_write_to_the_working_directorys_folder_else_the_user_folder(tmp_path, monkeypatch):
    """`output_dir`: a working directory with its own policies/ (a checkout) gets the files; any other goes to the
    user folder ($SPECPILOT_HOME), never into the installed package."""
    from specpilot.decoding.paths import output_dir, package_dir, rules_path

    monkeypatch.setenv("SPECPILOT_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert output_dir("policies") == tmp_path / "home" / "policies"
    written = rules_path("cpu-x-1c", "ngram:3", 0.0, output_dir("policies"))
    assert written == tmp_path / "home" / "policies" / "cpu-x-1c" / "ngram-3" / "rules.json"
    assert package_dir("policies") not in written.parents
    (tmp_path / "policies").mkdir()
    assert str(output_dir("policies")) == "policies"
