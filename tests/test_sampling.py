"""Rejection sampling must leave the target's distribution unchanged; a broken verifier must not."""
from __future__ import annotations

import pytest
import torch
from conftest import perturbed_copy, tiny_llama, tiny_target

from decoding.drafters import ModelDrafter, NgramDrafter
from decoding.loop import generate
from decoding.policies import StaticK
from decoding.sampling import Sampling, probs_from_logits, sample
from decoding.verify import verify_sampling


def verify_broken_no_residual(draft_tokens, draft_probs, target_probs, generator):
    """A classic bug: on rejection, resample from p instead of the residual max(0, p - q)."""
    k = draft_tokens.shape[0]
    for i in range(k):
        x = draft_tokens[i]
        if torch.rand((), generator=generator) * draft_probs[i, x] >= target_probs[i, x]:
            return i, torch.cat([draft_tokens[:i], sample(target_probs[i], generator).reshape(1)])
    return k, torch.cat([draft_tokens, sample(target_probs[k], generator).reshape(1)])


def empirical_first_two(verifier, p, q, n, seed=0):
    """Distribution of the first two output tokens of one speculative step with k = 2.

    The draft samples x1 ~ q0 and x2 ~ q1 (context-free toy distributions); the target's next-token
    distribution is p0 for the first and p1 for the second position.
    """
    g = torch.Generator().manual_seed(seed)
    V = p.shape[-1]
    counts = torch.zeros(V, V)
    for _ in range(n):
        draft = sample(q, g)
        accepted, new = verifier(draft, q, p, g)
        if new.shape[0] < 2:  # rejected at 0: the second token comes from the target's next step
            second = sample(p[1], g)
            new = torch.cat([new, second.reshape(1)])
        counts[new[0], new[1]] += 1
    return counts / n


def toy_distributions(V=5, seed=3):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(2.0 * torch.randn(3, V, generator=g), -1)
    q = torch.softmax(2.0 * torch.randn(2, V, generator=g), -1)
    return p, q


def total_variation(a, b):
    return 0.5 * float((a - b).abs().sum())


def test_rejection_sampling_preserves_target_distribution():
    p, q = toy_distributions()
    exact = p[0][:, None] * p[1][None, :]  # toy target: positions independent
    empirical = empirical_first_two(verify_sampling, p, q, 20000)
    # 25 outcomes, 20k samples: sampling noise in TV is ~0.015; the broken verifier is off by > 0.1
    assert total_variation(empirical, exact) < 0.03


def test_broken_verifier_is_detected():
    p, q = toy_distributions()
    exact = p[0][:, None] * p[1][None, :]
    empirical = empirical_first_two(verify_broken_no_residual, p, q, 20000)
    assert total_variation(empirical, exact) > 0.06


def test_probs_from_logits_top_k_top_p():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    probs = probs_from_logits(logits, Sampling(temperature=1.0, top_k=2))
    assert (probs[2:] == 0).all() and probs[:2].sum() == pytest.approx(1.0)
    full = torch.softmax(logits, -1)
    probs = probs_from_logits(logits, Sampling(temperature=1.0, top_p=float(full[0] + 0.01)))
    assert (probs[:2] > 0).all() and (probs[2:] == 0).all()
    probs = probs_from_logits(logits, Sampling(temperature=1.0, top_p=0.01))
    assert probs[0] == 1.0
    assert probs_from_logits(logits, Sampling(temperature=0.5)).max() > full.max()


@torch.no_grad()
def exact_two_token_distribution(model, prompt, sampling):
    p1 = probs_from_logits(model(torch.tensor([prompt])).logits[0, -1], sampling)
    V = p1.shape[0]
    joint = torch.zeros(V, V, dtype=torch.float64)
    for a in range(V):
        if p1[a] > 0:
            p2 = probs_from_logits(model(torch.tensor([prompt + [a]])).logits[0, -1], sampling)
            joint[a] = p1[a] * p2
    return joint


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_speculative_generate_matches_target_sampling(drafter):
    """End to end: the first two tokens of speculative sampling follow the target's joint law."""
    V = 8
    target_model = tiny_llama(vocab=V, seed=5)
    with torch.no_grad():
        target_model.lm_head.weight.mul_(0.06)  # back to soft distributions: sampling must matter
    draft_model = perturbed_copy(target_model, 0.5, seed=9)
    sampling = Sampling(temperature=0.9, top_k=6)
    prompt = [1, 2, 3, 1, 2]
    if drafter == "ngram":  # let the looked-up token (z in [1, 2, z, 1, 2]) be a likely one
        with torch.no_grad():
            z = max(range(V), key=lambda z: float(torch.softmax(target_model(torch.tensor([[1, 2, z, 1, 2]])).logits[0, -1], -1)[z]))
        prompt = [1, 2, z, 1, 2]
    exact = exact_two_token_distribution(target_model, prompt, sampling)
    target = tiny_target(target_model)
    draft = ModelDrafter(draft_model, "d", V) if drafter == "model" else NgramDrafter(2)
    n = 3000
    counts = torch.zeros(V, V, dtype=torch.float64)
    accepted = 0
    for seed in range(n):
        result = generate(target, draft, StaticK(3), prompt, 2, sampling, seed=seed)
        a, b = result.token_ids
        counts[a, b] += 1
        accepted += result.steps[0].accepted
    assert 0 < accepted < n  # both accept and reject paths ran
    tv = total_variation(counts / n, exact)
    assert tv < 0.07, tv
