"""Device placement without a GPU: the models sit explicitly on the CPU while torch's default device is
"meta" (no data), so any tensor the code makes without an explicit device is a meta tensor: the run
fails when it is read (.item(), .tolist(), a copy), and where an op quietly mixes it with real data
(an embedding of meta ids returns garbage on the CPU) the tokens change, which the comparison with the
same run outside the guard catches. On a GPU those are the tensors that would land on the CPU beside a
model on the GPU."""
from __future__ import annotations

import pytest
import torch
from conftest import perturbed_copy, plain_greedy, tiny_llama, tiny_target

from specpilot.decoding.drafters import ModelDrafter, NgramDrafter
from specpilot.decoding.head_draft import DraftHead, HeadConfig, HeadDrafter, target_signature
from specpilot.decoding.loop import generate
from specpilot.decoding.policies import StaticK
from specpilot.decoding.sampling import Sampling

PROMPTS = [[5, 9, 13, 2, 7, 5, 9], [1, 2, 3, 1, 2]]


def elsewhere():
    """Everything made without an explicit device goes to 'meta' (models and inputs are on the CPU)."""
    return torch.device("meta")


@pytest.fixture(scope="module")
def models():
    target = tiny_llama()
    return target, perturbed_copy(target, 0.15)


def drafters(target, draft_model):
    torch.manual_seed(0)
    config = HeadConfig(hidden_size=target.config.hidden_size, intermediate_size=48, blocks=1,
                        vocab_ids=list(range(target.config.vocab_size)), target_vocab_size=target.config.vocab_size,
                        target_signature=target_signature(target))
    return {"ngram": NgramDrafter(3), "lm": ModelDrafter(draft_model, "d", target.config.vocab_size),
            "head": HeadDrafter(DraftHead(config).to(target.dtype).eval(), target)}


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("batch", [False, True])
@pytest.mark.parametrize("kind", ["ngram", "lm", "head"])
def test_decode_loop_makes_no_tensor_without_a_device(models, kind, batch, greedy):
    target, draft_model = models
    draft = drafters(target, draft_model)[kind]
    sampling = Sampling() if greedy else Sampling(temperature=0.8, top_p=0.9)
    prompts = PROMPTS if batch else PROMPTS[0]
    with elsewhere():
        result = generate(tiny_target(target), draft, StaticK(3), prompts, 16, sampling, seed=1)
    same = generate(tiny_target(target), drafters(target, draft_model)[kind], StaticK(3), prompts, 16, sampling, seed=1)
    assert result.token_ids == same.token_ids  # no meta garbage crept in
    if greedy:  # and it is the plain greedy output
        reference = [plain_greedy(target, p, 16) for p in PROMPTS]
        assert result.token_ids == (reference if batch else reference[0])


def test_env_step_observation_and_profiler_make_no_tensor_without_a_device(models):
    from specpilot.env import PlainSpeed, SpecDecodeEnv
    from specpilot.env.profile import profile_costs
    from specpilot.decoding.prompts import Prompt

    target, draft_model = models
    env = SpecDecodeEnv(tiny_target(target), NgramDrafter(3), [Prompt("q", "c", "x")], k_max=4, max_new_tokens=8,
                        plain_speed=PlainSpeed([16, 1024], [0.002, 0.003]), encoded=[PROMPTS[0]], chat=False)
    with elsewhere():
        obs, _ = env.reset(seed=0)
        for k in (2, 0, 3):
            obs, reward, *_ = env.step(k)
        profile = profile_costs(tiny_target(target), ModelDrafter(draft_model, "d", target.config.vocab_size),
                                PROMPTS[0], k_max=2, context_lens=(16,), repeats=1, batch_sizes=(1, 2))
    assert obs.dtype.kind == "f" and reward == reward
    assert len(profile["verify_s"][0]) == 3 and profile["batch_sizes"] == [1, 2]


def test_the_guard_catches_a_tensor_made_without_a_device(models):
    """Negative control: the test helper as it was (torch.tensor([ids]) fed to the model) fails here."""
    target, _ = models

    def old_plain_greedy(model, prompt, n):
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt):]

    truth = old_plain_greedy(target, PROMPTS[0], 6)  # outside the guard it works (on the CPU)
    with elsewhere():
        try:
            guarded = old_plain_greedy(target, PROMPTS[0], 6)
        except (RuntimeError, NotImplementedError):
            guarded = None
        fixed = plain_greedy(target, PROMPTS[0], 6)
    assert guarded != truth and fixed == truth
