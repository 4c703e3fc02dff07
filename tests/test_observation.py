"""The one observation builder and the background hardware monitor."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
from conftest import tiny_target

from specpilot.decoding.drafters import ModelDrafter
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.hardware import HW_FEATURES, HardwareMonitor, cpu_key, device_key, resolve_device
from specpilot.decoding.loop import generate, speculative_step, start
from specpilot.decoding.observation import FEATURES, HISTORY, ObservationBuilder, repetition_rate
from specpilot.decoding.policy_spec import parse_policy


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_monitor_samples_in_background_and_reads_a_busy_cpu():
    """The CPU monitor polls in its own thread, never reads NaN, and its utilisation counter sees a load: with every
    core spinning in other processes it reads >= 0.8 (the GPU counters of a CPU monitor are checked against a fake
    NVML in tests/test_devices.py)."""
    import multiprocessing

    with HardwareMonitor("cpu", interval_s=0.02) as monitor:
        first = monitor.samples
        time.sleep(0.2)
        assert monitor.samples > first + 3
        values = monitor.read()
        assert values.shape == (len(HW_FEATURES),) and np.isfinite(values).all()
        assert values[HW_FEATURES.index("hw_cpu_available")] == 1.0
        spinners = [multiprocessing.get_context("fork").Process(target=_spin, args=(1.5,)) for _ in range(os.cpu_count() or 1)]
        for s in spinners:
            s.start()
        time.sleep(0.7)  # the polls after the spinners started
        busy = monitor.read()
        for s in spinners:
            s.join()
    assert busy[HW_FEATURES.index("hw_cpu_util")] >= 0.8, busy[HW_FEATURES.index("hw_cpu_util")]
    assert np.isfinite(busy).all()


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="the co-running counters read Linux's /proc")
def test_co_running_counters_tell_a_background_load_from_none():
    """While this process keeps both cores busy with torch, the co-running counters read near idle without a load
    and clearly up beside env.load's compute load (one core of other work): other processes' CPU share, the run
    queue and this process's preemptions. (The load-independent hw_cpu_util reads ~1 in both: it cannot tell.)"""
    import threading

    import torch

    from specpilot.env.load import background_load

    stop = threading.Event()

    def work():
        a, w = torch.randn(64, 576), torch.randn(576, 1536)
        while not stop.is_set():
            for _ in range(20):
                a @ w

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    read = {}
    try:
        with HardwareMonitor("cpu", interval_s=0.05) as monitor:
            for load in ("none", "compute"):
                with background_load(load):
                    time.sleep(1.6)  # more than the counters' one-second window
                    read[load] = dict(zip(HW_FEATURES, monitor.read()))
    finally:
        stop.set()
        worker.join()
    idle, busy = read["none"], read["compute"]
    assert idle["hw_cpu_other_util"] < 0.15 < 0.2 < busy["hw_cpu_other_util"], (idle, busy)
    assert busy["hw_run_queue_per_core"] > idle["hw_run_queue_per_core"] + 0.2, (idle, busy)
    assert busy["hw_preempt_rate_log"] > idle["hw_preempt_rate_log"], (idle, busy)
    # the load per core follows within the second (the one-minute load average would have moved ~0.03 here)
    assert busy["hw_load_per_core"] > idle["hw_load_per_core"] + 0.3, (idle, busy)


def test_the_damped_load_follows_a_step_in_about_a_second_whatever_the_polling():
    """`damped_load`: the kernel's load-average formula with a one-second time constant; after a step from 0 to 4
    tasks it reads 4 (1 - 1/e) one second later, polled every 10 ms or every 250 ms, and the first reading is the
    tasks themselves."""
    import math

    from specpilot.decoding.hardware import WINDOW_S, damped_load

    assert damped_load(None, 3, 0.0) == 3.0
    for dt in (0.01, 0.25):
        load = 0.0
        for _ in range(round(WINDOW_S / dt)):
            load = damped_load(load, 4, dt)
        assert load == pytest.approx(4 * (1 - math.exp(-1)), rel=1e-9)


def test_counters_of_an_older_record_read_by_name():
    """A profile recorded before counters were added (13 values, no names) reads its own values and neutral ones for
    the rest; a record with names is placed by name."""
    from specpilot.decoding.hardware import counters_by_name, neutral_counters

    old = counters_by_name([0.5] * 13)
    assert np.allclose(old[:13], 0.5) and np.allclose(old[13:], neutral_counters()[13:])
    named = counters_by_name([0.7, 0.3], ["hw_cpu_other_util", "hw_no_such_counter"])
    assert named[HW_FEATURES.index("hw_cpu_other_util")] == pytest.approx(0.7)
    assert named[HW_FEATURES.index("hw_cpu_freq_ratio")] == 1.0
    with pytest.raises(SpecPilotError, match="recorded counters"):
        counters_by_name([1.0, 2.0], ["hw_cpu_util"])


def test_device_names():
    assert device_key("NVIDIA H200") == "h200"
    assert device_key("NVIDIA A100-SXM4-80GB") == "a100"
    assert device_key("NVIDIA L4") == "l4"
    assert device_key("NVIDIA L40S") == "l40s"
    assert device_key("NVIDIA GH200 480GB") == "gh200"
    assert resolve_device("cpu")[0] == cpu_key() and cpu_key().startswith("cpu-")
    with pytest.raises(SpecPilotError, match="not present"):
        resolve_device("h100")


def test_observation_tracks_acceptance(tiny_pair):
    target_model, draft_model = tiny_pair
    draft = ModelDrafter(draft_model, "d", target_model.config.vocab_size)
    state = start(tiny_target(target_model), draft, [3, 1, 4, 1, 5], 40)
    observer = ObservationBuilder(k_max=8)
    observer.reset(state)
    obs = observer.build(state)
    assert obs.shape == (len(FEATURES),) and obs.dtype == np.float32 and np.isfinite(obs).all()
    named = dict(zip(FEATURES, obs))
    assert named["accept_history_len"] == 0 and named["last_k_frac"] == 0
    steps = []
    for k in (4, 0, 6):
        step = speculative_step(state, k)
        observer.push(step)
        steps.append(step)
    named = dict(zip(FEATURES, observer.build(state)))
    ratios = [s.accepted / s.k for s in steps if s.k]
    assert named[f"accept_ratio_{HISTORY}"] == pytest.approx(ratios[-1])
    assert named[f"accept_ratio_{HISTORY - 1}"] == pytest.approx(ratios[-2])
    assert named["accept_history_len"] == pytest.approx(2 / HISTORY)
    assert named["last_k_frac"] == pytest.approx(6 / 8)
    assert named["plain_ms_log"] > 0 and named["draft_ms_per_token_log"] > 0
    assert named["context_len_log"] == pytest.approx(np.log1p(state.length), rel=1e-5)


def test_repetition_rate():
    assert repetition_rate(np.array([1, 2, 3, 4])) == 0.0
    assert repetition_rate(np.array([7, 7, 7, 7])) == 0.75


def test_the_running_repetition_window_equals_the_rate_of_the_last_tokens():
    """The builder's per-step window (counts kept as tokens come and leave) gives `repetition_rate` of the
    context's last REPETITION_WINDOW tokens exactly, across the window's filling and sliding."""
    from specpilot.decoding.observation import REPETITION_WINDOW, RepetitionWindow

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 40, 400).tolist()
    window = RepetitionWindow(tokens[:3])
    at = 3
    while at < len(tokens):
        step = int(rng.integers(1, 9))
        window.extend(tokens[at : at + step])
        at = min(len(tokens), at + step)
        assert window.rate == repetition_rate(np.array(tokens[max(0, at - REPETITION_WINDOW) : at]))
    assert len(window.tokens) == REPETITION_WINDOW and RepetitionWindow([5]).rate == 0.0


def test_generate_measures_controller_overhead(tiny_pair):
    target_model, draft_model = tiny_pair
    draft = ModelDrafter(draft_model, "d", target_model.config.vocab_size)
    stats = generate(tiny_target(target_model), draft, parse_policy("heuristic"), [1, 2, 3], 30).stats
    assert 0 < stats.policy_s < stats.seconds


def test_record_counters_writes_measured_counters_into_a_profile_and_keeps_its_costs(tiny_model_dirs, tmp_path):
    """profile_device.py --record-counters: a profile from before the co-running counters gains them, measured while
    the target decodes here, under their names; its costs are untouched. A profile measured under another load, or
    of another device, is refused in one line."""
    import json

    from conftest import CPU_KEY

    from specpilot.bench.profile_cli import profile_main
    from specpilot.decoding.hardware import CO_RUNNING

    path = tmp_path / "old.json"
    costs = {"context_lens": [64], "k": [0, 1], "verify_s": [[0.05, 0.06]], "draft_s_per_token": [0.0]}
    path.write_text(json.dumps({**costs, "device": CPU_KEY, "hardware": [0.0] * 13}))
    args = ["--device", "cpu", "--target", tiny_model_dirs["target"], "--record-counters", str(path),
            "--counter-seconds", "1.5"]
    assert profile_main(args) == 0
    profile = json.loads(path.read_text())
    assert profile["hardware_features"] == list(HW_FEATURES) and len(profile["hardware"]) == len(HW_FEATURES)
    read = dict(zip(HW_FEATURES, profile["hardware"]))
    assert read["hw_cpu_available"] == 1.0 and read["hw_run_queue_per_core"] > 0.0
    assert all(np.isfinite(read[c]) for c in CO_RUNNING)
    assert {k: profile[k] for k in costs} == costs
    path.write_text(json.dumps({**costs, "device": CPU_KEY, "background_load": "compute"}))
    with pytest.raises(SpecPilotError, match="measured under the load 'compute'"):
        profile_main(args)
    path.write_text(json.dumps({**costs, "device": "h100"}))
    with pytest.raises(SpecPilotError, match="h100"):
        profile_main(args)
