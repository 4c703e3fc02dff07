"""The serving engines' k rules, on hand-made step sequences: the k each chooses after given accept histories."""
from __future__ import annotations

import math

import numpy as np
import pytest

from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.loop import StepResult
from specpilot.decoding.observation import FEATURES
from specpilot.decoding.policies import SGLangAdaptiveK, TrtllmK
from specpilot.decoding.policy_spec import parse_policy


def obs(batch: int = 1) -> np.ndarray:
    o = np.zeros(len(FEATURES), dtype=np.float32)
    o[FEATURES.index("batch_size_log")] = math.log(batch)
    return o


def step(k: int, accepted_rows: list[int]) -> StepResult:
    return StepResult(k=k, k_requested=k, accepted=sum(accepted_rows) / len(accepted_rows), new_tokens=[],
                      draft_s=0.0, verify_s=0.0, accepted_rows=accepted_rows)


def run(policy, accepts: list[int], batch: int = 1) -> list[int]:
    """Feed steps that accept these counts; return the k chosen before each step."""
    chosen = []
    for a in accepts:
        k = policy.choose_k(obs(batch))
        chosen.append(k)
        policy.update(step(k, [min(a, k)] * batch))
    return chosen


def test_sglang_defaults_hold_k_through_warmup_then_follow_the_ema():
    policy = parse_policy("sglang-adaptive")
    assert isinstance(policy, SGLangAdaptiveK) and policy.candidates == [1, 3, 7] and policy.alpha == 0.2
    # nothing accepted (accept length 1, target 2): k stays at 7 for the 10 warm-up steps and the first
    # 4 after, then drops straight to the smallest candidate at the 15th update
    ks = run(policy, [0] * 20)
    assert ks[:15] == [7] * 15 and ks[15:] == [1] * 5


def test_sglang_goes_up_only_when_the_target_reaches_the_next_candidate():
    policy = SGLangAdaptiveK(warmup=0, update_interval=1)
    policy.buckets[1] = [0, 1.0, 0]  # k = 1, EMA accept length 1
    # k = 1 accepting nothing: accept length 1, target 2 < 3: stays
    assert run(policy, [0] * 10) == [1] * 10
    # full accepts at k = 1: accept length 2, EMA 1.2, 1.36, ... target = EMA + 1 reaches 3 only when EMA
    # reaches 2, which an EMA of 2s approaches but never meets: stays at 1 with up_hysteresis 0
    assert run(policy, [1] * 10) == [1] * 10
    up = SGLangAdaptiveK(warmup=0, update_interval=1, up_hysteresis=-0.2)
    up.buckets[1] = [0, 1.0, 0]
    # now EMA + 1 >= 3 - 0.2 once EMA reaches 1.8 (after 7 full accepts): up to 3; at 3, full accepts give
    # accept length 4, target <= 5 < 7: it stays at 3
    ks = run(up, [7] * 20)
    assert ks[:8] == [1] * 8 and ks[8:] == [3] * 12


def test_sglang_hysteresis_down():
    policy = SGLangAdaptiveK(warmup=0, update_interval=1)
    policy.buckets[1] = [2, 7.0, 0]  # k = 7, EMA accept length 7 (target 8)
    # accepting 5 (length 6): EMA 6.8, target 7.8 >= 6.75: stays at 7; accepting 1 (length 2): EMA 5.84,
    # target 6.84: stays; accepting 0: EMA 4.87, target 5.87 < 6.75: down to 3
    assert run(policy, [5, 1, 0, 0]) == [7, 7, 7, 3]


def test_sglang_keeps_one_state_per_batch_size():
    policy = SGLangAdaptiveK(warmup=0, update_interval=1)
    run(policy, [0] * 3, batch=4)
    assert policy.choose_k(obs(4)) == 1 and policy.choose_k(obs(1)) == 7
    policy.reset()
    assert policy.choose_k(obs(4)) == 7


def test_trtllm_schedule_and_cutoff():
    policy = parse_policy("trtllm:1=7/4=3/8=1:4:0.5")
    assert isinstance(policy, TrtllmK)
    assert [policy.choose_k(obs(b)) for b in (1, 2, 4, 5, 8, 9, 16)] == [7, 3, 3, 1, 1, 0, 0]
    # rolling acceptance over 4 drafting steps: 7/7, 0/7, 7/7 then 0/7 -> 14/28 = 0.5, not below 0.5: on;
    # the next 0/7 makes it 7/28 < 0.5: off for good, whatever is accepted after
    assert run(policy, [7, 0, 7, 0, 0, 7, 7]) == [7, 7, 7, 7, 7, 0, 0]
    policy.reset()  # a new request
    assert policy.choose_k(obs(1)) == 7


def test_trtllm_defaults_and_bad_specs():
    policy = parse_policy("trtllm:5")
    assert [policy.choose_k(obs(b)) for b in (1, 64)] == [5, 5] and run(policy, [0] * 20) == [5] * 20
    for bad in ("trtllm:1=9", "trtllm:0=3", "trtllm:1=3:4", "trtllm:1=3:4:1.5", "sglang-adaptive:0/3",
                "sglang-adaptive:1/3/9", "sglang-adaptive:1/3:0", "trtllm:x"):
        with pytest.raises(SpecPilotError):
            parse_policy(bad)


def test_per_batch_policy_dispatches_on_the_batch_size():
    from specpilot.decoding.policies import PerBatchK, StaticK

    policy = PerBatchK({1: StaticK(5), 4: StaticK(2), 16: StaticK(0)})
    assert [policy.choose_k(obs(b)) for b in (1, 3, 4, 15, 16, 40)] == [5, 5, 2, 2, 0, 0]
    assert policy.k_max == 5


def test_tune_picks_each_familys_best_on_the_train_split_and_best_rule_replays_it(tmp_path, capsys):
    """On the hand-made profile (speculation free at one row, a loss at 16 rows) with every draft
    accepted, the tuned best rule drafts the most at B = 1 and nothing at B = 16, the test-split trace
    (no accepts) never influences it, and the benchmark's best-rule replays what was tuned."""
    import json

    from test_batch_policy import K_MAX, batch_profile, full_match_trace

    from specpilot.bench.benchmark_cli import benchmark_main
    from specpilot.bench.tune_cli import tune_main
    from specpilot.env.oracle import Trace

    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({**batch_profile(), "device": "cpu"}))
    bad = Trace("test-0", "c", list(range(5)), list(range(100, 120)), [0] * 20, [K_MAX] * 20, k_max=K_MAX)
    traces = tmp_path / "traces.json"
    traces.write_text(json.dumps({"meta": {"draft": "ngram:3", "target": "t", "max_new_tokens": 20,
                                           "splits": {"t0": "train", "t1": "train", "test-0": "test"}},
                                  "traces": [full_match_trace(q).__dict__ for q in ("t0", "t1")] + [bad.__dict__]}))
    rules = tmp_path / "rules.json"
    assert tune_main(["--profile", str(profile), "--traces", str(traces), "--batch-sizes", "1,16", "--k-max",
                      str(K_MAX), "--max-new-tokens", "20", "--out", str(rules), "--no-progress"]) == 0
    doc = json.loads(rules.read_text())
    assert doc["traces"] == 2 and doc["split"] == "train"
    assert doc["best"]["static"] == {"1": f"static:{K_MAX}", "16": "static:0"}
    assert doc["best_rule"]["16"] == "static:0" and doc["speedups"]["16"]["static:0"] == pytest.approx(1.0)
    best = doc["best_rule"]
    assert doc["speedups"]["1"][best["1"]] == max(doc["speedups"]["1"].values())
    assert doc["speedups"]["16"][best["16"]] == max(doc["speedups"]["16"].values())
    assert set(doc["best"]) == {"static", "heuristic", "batch-table", "match", "sglang-adaptive", "trtllm", "bandit-ucb"}
    # the benchmark reads the tuned rules: on the train split's replay it reproduces the tuned speedups
    code = benchmark_main(["--device", "cpu", "--draft", "ngram:3", "--split", "all", "--replay", "--profile",
                           str(profile), "--traces", str(traces), "--rules", str(rules), "--batch-sizes", "1",
                           "--k-max", str(K_MAX), "--max-new-tokens", "20", "--policies", "none,best-rule,rule:static",
                           "--prompts", str(write_prompts(tmp_path)), "--out", str(tmp_path / "out"),
                           "--cost-jitter", "0.1", "--cost-draws", "3", "--versus", "rule:static", "--no-progress"])
    assert code == 0
    written = json.loads((tmp_path / "out" / "replay_batch.json").read_text())
    replay = written["results"]["1"]
    assert replay["rule:static"]["speedup"] == pytest.approx(doc["speedups"]["1"][f"static:{K_MAX}"])
    # under perturbed cost curves: each policy over the --versus one; every draft accepted here, so drafting
    # K_MAX stays the best whatever the curve, and plain decoding behind it in every draw
    jitter = written["cost_jitter"]
    assert jitter["draws"] == 3 and jitter["versus"] == "rule:static"
    assert jitter["ratios"]["rule:static"]["1"]["worst"] == pytest.approx(1.0)
    assert jitter["ratios"]["none"]["1"]["worst"] < jitter["ratios"]["none"]["1"]["mean"] < 1.0


def write_prompts(folder):
    import json

    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps({"question_id": q, "category": "c", "split": "train", "turns": ["hi"]}) + "\n"
                            for q in ("t0", "t1")))
    return path


def test_rules_are_tuned_and_read_per_temperature(tmp_path):
    """Rules tuned on sampled traces record their temperature; the benchmark takes them only for that temperature,
    and tuning refuses traces of another one (a one-line error, exit code 2)."""
    import json

    from test_batch_policy import K_MAX, batch_profile, full_match_trace

    from specpilot.bench.benchmark_cli import benchmark_main
    from specpilot.bench.tune_cli import tune_main
    from specpilot.decoding.config import run_cli

    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({**batch_profile(), "device": "cpu"}))
    traces = tmp_path / "traces.json"
    traces.write_text(json.dumps({"meta": {"draft": "ngram:3", "target": "t", "max_new_tokens": 20, "temperature": 0.7,
                                           "seed": 0, "splits": {"t0": "train", "t1": "train"}},
                                  "traces": [full_match_trace(q).__dict__ for q in ("t0", "t1")]}))
    common = ["--profile", str(profile), "--traces", str(traces), "--batch-sizes", "1", "--k-max", str(K_MAX),
              "--max-new-tokens", "20", "--no-progress"]
    assert run_cli(tune_main, common + ["--out", str(tmp_path / "greedy.json")]) == 2  # greedy asked, 0.7 recorded
    rules = tmp_path / "rules-t0.7.json"
    assert tune_main(common + ["--temperature", "0.7", "--out", str(rules)]) == 0
    assert json.loads(rules.read_text())["temperature"] == 0.7
    bench = common + ["--device", "cpu", "--draft", "ngram:3", "--split", "all", "--replay", "--rules", str(rules),
                      "--policies", "none,best-rule", "--prompts", str(write_prompts(tmp_path)), "--out", str(tmp_path / "out")]
    assert benchmark_main(bench + ["--temperature", "0.7"]) == 0
    written = json.loads((tmp_path / "out" / "replay_batch.json").read_text())
    assert written["results"]["1"]["best-rule"]["speedup"] > 1.0  # every draft accepted in these traces
    assert run_cli(benchmark_main, bench) == 2  # greedy decoding: neither these traces nor these rules


def test_best_rule_by_name_reads_the_tuned_spellings_and_the_recorded_batch_table(tmp_path):
    """`best-rule` wherever a policy is named (generate, custom_generate, the benchmark) is the rules.json's per-batch
    spellings; vLLM's batch-table at a size reads the table recorded beside them, and without one (or for another
    draft or temperature) it is a one-line error."""
    import json

    doc = {"draft": "ngram-3", "temperature": 0.0, "best": {"static": {"1": "static:2"}},
           "best_rule": {"1": "static:2", "2": "batch-table", "8": "static:0"}, "batch_table": {"1": 2, "2": 5, "8": 0}}
    path = tmp_path / "rules.json"
    path.write_text(json.dumps(doc))
    policy = parse_policy("best-rule", 8, rules=path, draft="ngram-3")
    assert [policy.choose_k(obs(b)) for b in (1, 2, 3, 7, 8, 16)] == [2, 5, 5, 5, 0, 0]
    assert parse_policy("rule:static", 8, rules=path, draft="ngram-3").choose_k(obs(1)) == 2
    for rules, kwargs, message in [({**doc, "batch_table": None}, {}, "record no table"),
                                   (doc, {"draft": "head"}, "tuned for draft 'ngram-3'"),
                                   (doc, {"temperature": 0.7}, "tuned for temperature 0"),
                                   (doc, {"text": "rule:trtllm"}, "no family 'trtllm'")]:
        path.write_text(json.dumps(rules))
        with pytest.raises(SpecPilotError, match=message):
            parse_policy(kwargs.pop("text", "best-rule"), 8, rules=path, **{"draft": "ngram-3", **kwargs})
    with pytest.raises(SpecPilotError, match="name the draft"):
        parse_policy("best-rule", 8, rules=path)
