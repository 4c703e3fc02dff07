"""Simulated GPU cost profiles: decode latency against published measurements, the qualitative shape on the A100
model, the batch x context grid in the cost model and the replay env, the context-axis tables and their exports,
and the guard rails."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from specpilot.bench.batch_table import BatchContextTableK, trtllm_schedule
from specpilot.decoding.errors import SpecPilotError
from specpilot.env.oracle import CostModel, Trace, oracle_schedule
from specpilot.env.replay_env import ReplayEnv
from specpilot.env.simulate import CHIPS, Shape, forward_seconds, simulate_profile

ROOT = Path(__file__).resolve().parents[1]
TARGET = str(ROOT / "configs" / "llama-3.1-8b")


def best_k(profile, batch, context, accept=0.6, k_max=8):
    """The k of the best goodput for a draft whose tokens are each accepted with probability `accept`."""
    tokens = np.array([(1 - accept ** (k + 1)) / (1 - accept) for k in range(k_max + 1)])
    seconds = CostModel.from_profile(profile).step_costs(context, batch)[0]
    return int(np.argmax(tokens / seconds)), float((tokens / seconds).max() / (tokens[0] / seconds[0]))


@pytest.fixture(scope="module")
def a100():
    return simulate_profile("a100", TARGET, None, 8, [1, 2, 4, 8, 16, 32, 64, 128, 256], [128, 512, 4096, 16384, 32768])


# Published measured decode figures of Llama-3.1-8B (bf16, vLLM, one GPU):
# - A100 40 GB (HBM 1,555 GB/s), one request, 1,024 input and 128 output tokens, vLLM 0.23.0: "about 75 tokens/sec,
#   roughly 77% of the GPU's memory-bandwidth ceiling" (johnmusgrave.com, "vLLM throughput-latency sweep on NVIDIA
#   A100"): 13.3 ms per output token.
# - H200, batch 8, 32 input and 128 output tokens: mean end-to-end latency 833 ms (vLLM's CI performance benchmark,
#   `latency_llama8B_tp1`, buildkite vllm/performance-benchmark build 9515): 6.5 ms per output token, prefill,
#   sampling and scheduling included.
A100_40GB_B1_S_PER_TOKEN = 1 / 75
H200_B8_E2E_S_PER_TOKEN = 0.833 / 128


def test_decode_latency_matches_published_measurements():
    """The roofline decode step against the measured ones above. Tolerances: within 15% of the A100 figure (a
    rounded "about 75 tokens/sec" at 77% of the bandwidth, where the model assumes 75%); for the H200, at most the
    end-to-end time per token (the model prices the forward only) and at least 60% of it."""
    shape = Shape.from_config(TARGET)
    a100_40 = dataclasses.replace(CHIPS["a100"], name="NVIDIA A100-SXM4-40GB", hbm_gb_s=1555)
    step = forward_seconds(shape, a100_40, 1, 1, 1024 + 64)  # mid-answer context
    assert step == pytest.approx(A100_40GB_B1_S_PER_TOKEN, rel=0.15), step
    h200 = forward_seconds(shape, CHIPS["h200"], 8, 1, 32 + 64)
    assert 0.6 * H200_B8_E2E_S_PER_TOKEN <= h200 <= H200_B8_E2E_S_PER_TOKEN, h200
    # and the simulated profiles price a plain step as that forward (their k = 0 cell)
    profile = simulate_profile("h200", TARGET, None, 4, [8], [96])
    assert CostModel.from_profile(profile).step_costs(96, 8)[0][0] == pytest.approx(h200, rel=0.02)


def test_the_a100_model_shows_the_shape_the_engines_report(a100):
    k1, gain1 = best_k(a100, 1, 512)
    assert k1 >= 4 and gain1 > 1.5  # speculation pays at one row (decode is memory-bound)
    ks = [best_k(a100, b, 512)[0] for b in (1, 8, 32, 128)]
    assert ks == sorted(ks, reverse=True) and ks[-1] < ks[0]  # the best k falls as the batch grows
    assert best_k(a100, 256, 128)[0] == 0  # and speculation stops paying at large batch, short context
    assert best_k(a100, 128, 16384)[0] > best_k(a100, 128, 512)[0]  # at large batch the best k rises with context
    assert a100["simulated"] is True and "simulated" in a100["hardware_name"]


def test_roofline_numbers():
    shape = Shape.from_config(TARGET)
    assert 7.9e9 < shape.params < 8.1e9 and shape.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    # one row at a short context: 15 GB of matmul weights (the embedding table is not read whole) at 75% of
    # 2.04 TB/s, 9.8 ms, plus 32 layers x 10 us of launches
    assert 7.4e9 < shape.matmul_params < 7.6e9
    assert forward_seconds(shape, CHIPS["a100"], 1, 1, 128) == pytest.approx(0.0101, abs=2e-4)
    # at B = 256 and 9 tokens a row the matmuls are compute-bound: 2 x 7.5e9 x 2304 flops at 60% of 312 TFLOP/s
    assert forward_seconds(shape, CHIPS["a100"], 256, 9, 128) == pytest.approx(0.185, rel=0.05)
    with pytest.raises(SpecPilotError, match="known chips"):
        simulate_profile("tpu", TARGET, None, 4, [1], [128])


def test_cost_model_reads_the_grid_where_batch_and_context_interact(a100):
    cost = CostModel.from_profile(a100)
    grid = np.array(a100["grid"]["verify_s"])
    b, c = a100["grid"]["batch_sizes"].index(128), a100["grid"]["context_lens"].index(16384)
    assert cost.step_costs(16384 + 16, 128)[0] == pytest.approx(grid[b, c], rel=1e-3)
    between = cost.step_costs(16384, 90)[0][0]
    assert grid[b - 1, c, 0] < between < grid[b, c, 0]


def test_replay_rows_sit_at_the_simulated_context(a100):
    trace = Trace("q", "c", list(range(20)), list(range(20, 40)), [1] * 20, [4] * 20, match_lens=[2] * 20, k_max=8)
    cost = CostModel.from_profile(a100)
    env = ReplayEnv([trace], cost, k_max=8, noise=0.0, batch_sizes=[1])
    env.reset(options={"trace_index": 0, "context_len": 16384})
    _, _, _, _, info = env.step(0)
    assert info["seconds"] == pytest.approx(cost.step_costs(16384, 1)[0][0])
    best_long, _ = oracle_schedule(trace, cost, 8, context_offset=16384 - 20)
    best_short, _ = oracle_schedule(trace, cost, 8)
    assert best_long > best_short


def test_context_table_and_its_engine_exports(a100):
    trace = Trace("q", "c", [1, 2], [3] * 40, [2, 0, 4, 1] * 10, [8] * 40, k_max=8)
    table = BatchContextTableK.from_profile(a100, [trace], 8, [512, 16384])
    assert table.k_for(128, 16384) > table.k_for(128, 512)
    entries = table.vllm_entries(256, 32767)
    assert all(len(e) == 5 for e in entries) and entries[0][:3] == [1, entries[0][1], 0]
    covered = {(b, c) for b0, b1, c0, c1, _ in entries for b in (b0, b1) for c in (c0, c1)}
    assert (256, 32767) in covered and (1, 0) in covered
    assert trtllm_schedule({1: 4, 2: 4, 4: 3, 8: 3, 16: 0}) == {3: 4, 15: 3}  # k = 0 above the largest key


def test_training_on_a_simulated_profile_needs_allow_simulated(tmp_path, a100):
    from specpilot.agents.train_cli import train_main

    path = tmp_path / "a100-simulated.json"
    path.write_text(json.dumps(a100))
    with pytest.raises(SpecPilotError, match="pass --allow-simulated"):
        train_main(["--device", "a100", "--profile", str(path), "--no-track"])
    with pytest.raises(SpecPilotError, match="replay env only"):
        train_main(["--device", "a100", "--profile", str(path), "--allow-simulated", "--env", "real", "--no-track"])


def test_the_simulated_report_replays_a_model_drafts_traces_with_its_cost_and_confidence_rule(tmp_path, monkeypatch):
    """With `--draft-shape` the report prices a drafted token as that shape (an EAGLE-style head on the 8B target) and
    adds the p-min rule tuned on the train traces when they carry the draft's confidences."""
    from specpilot.bench.simulated_cli import simulated_main
    from specpilot.env.oracle import save_traces

    root = Path(__file__).resolve().parents[1]
    rng = np.random.default_rng(0)

    def trace(qid):
        n = 30
        runs = rng.integers(0, 9, n)
        conf = [[0.9 if d < r else 0.2 for d in range(8)] for r in runs]
        return Trace(qid, "c", list(range(20)), list(range(100, 100 + n)), [int(r) for r in runs], [8] * n,
                     confidences=conf, entropies=[[0.3] * 8 for _ in range(n)])

    traces = [trace(f"q{i}") for i in range(8)]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "profiles").mkdir()
    save_traces(traces, tmp_path / "profiles" / "traces-default.json",
                {"draft": "default", "max_new_tokens": 30, "splits": {t.question_id: "train" if i < 4 else "test"
                                                                       for i, t in enumerate(traces)}})
    shape = "llama-3.1-8b-eagle-head"
    profile = simulate_profile("a100", str(root / "configs" / "llama-3.1-8b"), str(root / "configs" / shape), 8, [1, 8],
                               [512, 4096])
    assert profile["draft_s_per_token"][0] > 0
    (tmp_path / "profiles" / f"a100-{shape}-simulated.json").write_text(json.dumps(profile))
    assert simulated_main(["--devices", "a100", "--draft", "default", "--draft-shape", shape, "--batch-sizes", "1,8",
                           "--context-lens", "512", "--max-new-tokens", "30", "--profiles", "profiles",
                           "--policies", str(tmp_path / "none"), "--report", "r.md"]) == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    names = doc["results"]["a100"]["policies"]
    assert any(n.startswith("p-min (confidence:") for n in names)
    cell = doc["results"]["a100"]["cells"]["1x512"]
    rule = next(n for n in names if n.startswith("p-min"))
    assert cell[rule] > max(cell[n] for n in names if n.startswith("static:"))  # confidence tells the run: it pays
    assert shape in (tmp_path / "r.md").read_text()
