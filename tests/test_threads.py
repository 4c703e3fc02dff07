"""The CPU's threads follow the cores a co-running process leaves free (decoding/threads.py): the arithmetic, the
calls it makes, and the real loop beside a real load, whose tokens stay those of plain decoding on an idle machine."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from specpilot.decoding.drafters import NgramDrafter
from specpilot.decoding.hardware import HW_FEATURES, cpu_cores
from specpilot.decoding.loop import generate
from specpilot.decoding.policies import NoSpeculation, StaticK
from specpilot.decoding.threads import ThreadGovernor
from specpilot.env.load import background_load


class FakeMonitor:
    def __init__(self, other: float):
        self.values = np.zeros(len(HW_FEATURES), dtype=np.float32)
        self.set(other)

    def set(self, other: float) -> None:
        self.values[HW_FEATURES.index("hw_cpu_other_util")] = other

    def read(self) -> np.ndarray:
        return self.values


def test_threads_are_the_cores_other_processes_leave_free():
    two = ThreadGovernor(FakeMonitor(0.0), cores=2, most=2)
    # idle (0.003), one core of matrix products beside two spinning threads (0.30) or beside one (0.50), a quarter core
    assert [two.threads_for(s) for s in (0.003, 0.30, 0.50, 0.20, 1.0, -0.1)] == [2, 1, 1, 2, 1, 2]
    sixteen = ThreadGovernor(FakeMonitor(0.0), cores=16, most=8)
    assert [sixteen.threads_for(s) for s in (0.0, 0.5, 0.75, 0.97)] == [8, 8, 4, 1]


def test_apply_sets_torch_threads_only_when_the_machine_changes():
    before = torch.get_num_threads()
    monitor = FakeMonitor(0.0)
    gov = ThreadGovernor(monitor, cores=2, most=2)
    try:
        assert gov.apply() == 2 and torch.get_num_threads() == 2
        changes = gov.changes
        monitor.set(0.4)
        assert gov.apply() == 1 and torch.get_num_threads() == 1 and gov.changes == changes + 1
        assert gov.apply() == 1 and gov.changes == changes + 1  # nothing changed: no call
        monitor.set(0.0)
        assert gov.apply() == 2 and torch.get_num_threads() == 2 and gov.changes == changes + 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow  # (10-30 s of real decoding; CI runs it, the default suite keeps under 8 min)
@pytest.mark.skipif(cpu_cores() < 2, reason="one core: no thread to give up")
def test_beside_a_real_load_the_loop_gives_up_a_thread_and_keeps_its_tokens(embedded_target):
    assert isinstance(embedded_target.threads, ThreadGovernor)  # load_target's default on the CPU
    before, kept = torch.get_num_threads(), embedded_target.threads  # (the suite runs one thread: conftest)
    prompt = embedded_target.encode("List the days of the week, then list them again in reverse order.", chat=True)
    try:
        embedded_target.threads = None
        torch.set_num_threads(cpu_cores())
        gov = ThreadGovernor(cores=cpu_cores(), most=cpu_cores())  # every core, as a command runs
        plain = generate(embedded_target, None, NoSpeculation(), prompt, 24).token_ids  # idle, every core: the reference
        embedded_target.threads = gov
        with background_load("compute"):
            time.sleep(1.5)  # the monitor's rates cover about a second
            spec = generate(embedded_target, NgramDrafter(3), StaticK(3), prompt, 24).token_ids
            assert gov.threads == gov.most - 1 and gov.changes >= 1  # one core is taken: one thread fewer
            loaded_plain = generate(embedded_target, None, NoSpeculation(), prompt, 24).token_ids
    finally:
        embedded_target.threads = kept
        torch.set_num_threads(before)
    assert spec == plain and loaded_plain == plain


def test_the_threads_benchmark_refuses_an_unknown_load_in_one_line():
    from specpilot.bench.threads import threads_main
    from specpilot.decoding.errors import SpecPilotError

    with pytest.raises(SpecPilotError, match="--loads takes names of none, compute, memory, both, got 'gpu'"):
        threads_main(["--loads", "gpu"])
