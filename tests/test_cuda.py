"""The CUDA path (runs only where a GPU is present): lossless decoding on the GPU, NVML counters."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from conftest import perturbed_copy, plain_greedy, tiny_llama, tiny_target

from specpilot.decoding.drafters import ModelDrafter
from specpilot.decoding.loop import generate
from specpilot.decoding.policy_spec import parse_policy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_greedy_lossless_on_gpu():
    target_model = tiny_llama(dtype=torch.float32).cuda()
    draft_model = perturbed_copy(target_model, 0.15)
    draft = ModelDrafter(draft_model, "perturbed", target_model.config.vocab_size)
    prompt = [5, 9, 13, 2, 7]
    reference = plain_greedy(target_model, prompt, 40)
    for policy in ["static:4", "heuristic", "confidence:0.5"]:
        result = generate(tiny_target(target_model), draft, parse_policy(policy), prompt, 40)
        assert result.token_ids == reference
        assert all(s.verify_s > 0 for s in result.steps)


def test_batched_lossless_on_gpu():
    target_model = tiny_llama(dtype=torch.float32).cuda()
    draft = ModelDrafter(perturbed_copy(target_model, 0.15), "perturbed", target_model.config.vocab_size)
    prompts = [[5, 9, 13, 2, 7], [1, 2, 3, 1, 2, 3], [42]]
    result = generate(tiny_target(target_model), draft, parse_policy("static:4"), prompts, 24)
    assert result.token_ids == [plain_greedy(target_model, p, 24) for p in prompts]


def test_nvml_counters_sampled():
    from specpilot.decoding.hardware import HW_FEATURES, HardwareMonitor, device_of

    key, name = device_of("cuda:0")
    assert key and name
    with HardwareMonitor("cuda:0", interval_s=0.02) as monitor:
        x = torch.randn(4096, 4096, device="cuda")
        for _ in range(50):
            x = x @ x
            x = x / x.norm()
        torch.cuda.synchronize()
        time.sleep(0.2)
        values = dict(zip(HW_FEATURES, monitor.read()))
    assert values["hw_is_gpu"] == 1.0
    assert 0.0 < values["hw_sm_clock_ratio"] <= 1.5 and values["hw_temperature"] > 0
    assert all(np.isfinite(v) for v in values.values())
