"""Rejection sampling must leave the target's distribution unchanged; a broken verifier must not."""
from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama, tiny_target

from specpilot.decoding.drafters import ModelDrafter, NgramDrafter
from specpilot.decoding.loop import generate
from specpilot.decoding.policies import StaticK
from specpilot.decoding.sampling import Sampling, probs_from_logits, sample
from specpilot.decoding.verify import verify_sampling


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
    """The target's own law of its first two sampled tokens, by enumeration (V x V)."""
    p1 = probs_from_logits(model(torch.tensor([prompt])).logits[0, -1], sampling).double()
    V = p1.shape[0]
    joint = torch.zeros(V, V, dtype=torch.float64)
    for a in range(V):
        if p1[a] > 0:
            p2 = probs_from_logits(model(torch.tensor([prompt + [a]])).logits[0, -1], sampling).double()
            joint[a] = p1[a] * p2
    return joint


def expected_noise(law: torch.Tensor, n: int) -> float:
    """E[TV(empirical of n draws, law)] ~ 1/2 sum sqrt(2 p (1 - p) / (pi n)) (normal approximation)."""
    p = law.flatten()
    return 0.5 * float(torch.sqrt(2 * p * (1 - p) / (torch.pi * n)).sum())


class FirstProposal:
    """Wraps a drafter and keeps q, the draft's distribution of its first proposed token (first call)."""

    def __init__(self, draft):
        self.draft, self.q = draft, None

    def __getattr__(self, name):
        return getattr(self.draft, name)

    def propose(self, *args, **kwargs):
        out = self.draft.propose(*args, **kwargs)
        if self.q is None and out.probs is not None:
            self.q = out.probs[0].double()
        return out

    def propose_batch(self, *args, **kwargs):
        out = self.draft.propose_batch(*args, **kwargs)
        if self.q is None and out.probs is not None:
            self.q = out.probs[0, 0].double()
        return out


V_SHARP = 8


def sharp_pair():
    """A target and a draft with sharp, different next-token laws (two independent random models)."""
    return tiny_llama(vocab=V_SHARP, seed=5), tiny_llama(vocab=V_SHARP, seed=9)


def two_token_law(target_model, draft, prompts, sampling, n, rows=200, seed0=0, new_tokens=2):
    """Empirical law of the first two tokens after each prompt over n speculative runs (k = 2: with `new_tokens` 2
    the first step drafts one token, the budget's last comes from the verify; 3 lets it draft two).

    The runs are the rows of batches (`rows` per call, the prompts alternating), so the batched path is
    the one under test; `rows=1` runs one sequence at a time (the single-sequence path)."""
    counts = torch.zeros(len(prompts), V_SHARP, V_SHARP, dtype=torch.float64)
    accepted = 0
    for call in range(n * len(prompts) // rows):
        batch = [prompts[i % len(prompts)] for i in range(rows)]
        result = generate(tiny_target(target_model), draft, StaticK(2), batch if rows > 1 else batch[0], new_tokens,
                          sampling, seed=seed0 + call)
        tokens = result.token_ids if rows > 1 else [result.token_ids]
        for i, (a, b, *_) in enumerate(tokens):
            counts[i % len(prompts), a, b] += 1
        accepted += sum(result.steps[0].accepted_rows)
    return counts / n, accepted


def likely_lookup_prompt(model, sampling) -> list[int]:
    """[1, 2, z, 1, 2] with z the token the target gives the most probability below 0.7 after it: the
    n-gram draft proposes z, accepted often, rejected often."""
    def p_of(z):
        with torch.no_grad():
            return float(probs_from_logits(model(torch.tensor([[1, 2, z, 1, 2]])).logits[0, -1], sampling)[z])
    return [1, 2, max((z for z in range(V_SHARP) if p_of(z) < 0.7), key=p_of), 1, 2]


CASES = {
    "lm-top-k": ("model", Sampling(temperature=1.0, top_k=5), 1),
    "lm-top-p": ("model", Sampling(temperature=1.0, top_p=0.8), 1),
    "head-sub-vocabulary": ("head", Sampling(temperature=1.0), 1),
    "ngram": ("ngram", Sampling(temperature=1.0), 1),
    "lm-two-prompts": ("model", Sampling(temperature=1.0), 2),
    "hybrid-lookup-then-head": ("hybrid", Sampling(temperature=1.0), 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_speculative_sampling_follows_the_targets_law_and_a_broken_verifier_does_not(case, monkeypatch):
    """End to end through `generate` (batched rows): each row's first two tokens follow the target's
    exact joint law (by enumeration), for sharp target and draft laws at least 0.3 apart in total
    variation; the same runs with the classic bug (resample from p instead of the residual) miss it by
    more than twice the tolerance, so the test has the power to catch it."""
    import specpilot.decoding.loop
    from specpilot.decoding.head_draft import DraftHead, HeadConfig, HeadDrafter, target_signature

    kind, sampling, n_prompts = CASES[case]
    target_model, draft_model = sharp_pair()
    prompts = [[1, 2, 3, 1, 2], [4, 0, 6, 5, 7]][:n_prompts]
    if kind == "model":
        draft = FirstProposal(ModelDrafter(draft_model, "d", V_SHARP))
    elif kind in ("head", "hybrid"):  # proposes from a sub-vocabulary only: q is 0 on the rest, the residual covers it
        torch.manual_seed(3)
        config = HeadConfig(hidden_size=target_model.config.hidden_size, intermediate_size=48, blocks=1,
                            vocab_ids=[0, 1, 2, 6], target_vocab_size=V_SHARP,
                            target_signature=target_signature(target_model))
        head = HeadDrafter(DraftHead(config).to(target_model.dtype).eval(), target_model)
        if kind == "hybrid":  # `extend` at k = 2: the lookup's one token (a point mass on 5), then one from the head
            from specpilot.decoding.hybrid import HybridDrafter

            head, prompts = HybridDrafter(NgramDrafter(2), head), [[4, 0, 6, 5, 5]]
        draft = FirstProposal(head)
    else:  # the n-gram draft proposes the token after the earlier [1, 2]: q is a point mass on it
        draft = FirstProposal(NgramDrafter(2))
        prompts = [likely_lookup_prompt(target_model, sampling)]
    exacts = [exact_two_token_distribution(target_model, p, sampling) for p in prompts]
    n, new_tokens = 4000, 3 if kind == "hybrid" else 2
    law, accepted = two_token_law(target_model, draft, prompts, sampling, n, new_tokens=new_tokens)
    q_first = draft.q if draft.q is not None else torch.nn.functional.one_hot(torch.tensor(prompts[0][2]), V_SHARP).double()
    if kind == "hybrid":  # the draft had probs, so the head drafted after the copy (a copy alone is a bare point mass)
        assert draft.q is not None and torch.equal(q_first, torch.nn.functional.one_hot(torch.tensor(5), V_SHARP).double())
    assert total_variation(exacts[0].sum(1), q_first) >= 0.3  # sharp and different: rejections and residuals matter
    assert 0 < accepted < n * 2 * len(prompts)  # both accept and reject paths ran
    monkeypatch.setattr(specpilot.decoding.loop, "verify_sampling", verify_broken_no_residual)
    draft.q = None
    broken, _ = two_token_law(target_model, draft, prompts, sampling, n, seed0=10**6, new_tokens=new_tokens)
    for row, exact in enumerate(exacts):
        tolerance = 1.6 * expected_noise(exact, n)
        tv, tv_broken = total_variation(law[row], exact), total_variation(broken[row], exact)
        assert tv < tolerance, (row, tv, tolerance)
        assert tv_broken > 2 * tolerance, (row, tv_broken, tolerance)


def test_single_sequence_sampling_follows_the_targets_law(monkeypatch):
    """The same check one sequence at a time (the unbatched path), with fewer runs and so a looser
    tolerance, which the broken verifier still misses by more than twice."""
    import specpilot.decoding.loop

    target_model, draft_model = sharp_pair()
    sampling, prompt = Sampling(temperature=1.0, top_k=5), [1, 2, 3, 1, 2]
    exact = exact_two_token_distribution(target_model, prompt, sampling)
    n = 600
    tolerance = 1.6 * expected_noise(exact, n)
    law, accepted = two_token_law(target_model, ModelDrafter(draft_model, "d", V_SHARP), [prompt], sampling, n, rows=1)
    assert 0 < accepted < 2 * n
    assert total_variation(law[0], exact) < tolerance
    monkeypatch.setattr(specpilot.decoding.loop, "verify_sampling", verify_broken_no_residual)
    broken, _ = two_token_law(target_model, ModelDrafter(draft_model, "d", V_SHARP), [prompt], sampling, n, rows=1,
                              seed0=10**6)
    assert total_variation(broken[0], exact) > 2 * tolerance
