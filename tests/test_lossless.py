"""Greedy speculative decoding must reproduce the target's own greedy decoding, token for token."""
from __future__ import annotations

import pytest
import torch
from conftest import RandomK, plain_greedy, tiny_target

from specpilot.decoding.drafters import ModelDrafter, NgramDrafter
from specpilot.decoding.loop import generate
from specpilot.decoding.policy_spec import parse_policy

PROMPTS = [[5, 9, 13, 2, 7], [1, 2, 3, 1, 2, 3, 1, 2], [42]]
POLICIES = ["none", "static:1", "static:3", "static:8", "heuristic", "confidence:0.5", "match:2",
            "sglang-adaptive", "sglang-adaptive:1/2/4:0.5", "trtllm:1=7/4=3:4:0.3"]


def drafters(target_model, draft_model):
    return {
        "ngram": NgramDrafter(3),
        "model": ModelDrafter(draft_model, "perturbed", target_model.config.vocab_size),
        "identical": ModelDrafter(target_model, "identical", target_model.config.vocab_size),
    }


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("drafter", ["ngram", "model", "identical"])
def test_greedy_lossless_every_policy(tiny_pair, policy, drafter):
    target_model, draft_model = tiny_pair
    draft = drafters(target_model, draft_model)[drafter]
    target = tiny_target(target_model)
    for prompt in PROMPTS:
        reference = plain_greedy(target_model, prompt, 40)
        result = generate(target, draft, parse_policy(policy), prompt, 40)
        assert result.token_ids == reference, (policy, drafter, prompt)
        assert sum(len(s.new_tokens) for s in result.steps) == 40


@pytest.mark.parametrize("seed", range(6))
def test_greedy_lossless_random_k_and_eos(tiny_pair, seed):
    target_model, draft_model = tiny_pair
    prompt = PROMPTS[seed % len(PROMPTS)]
    full = plain_greedy(target_model, prompt, 30)
    # an EOS id that the target emits mid-way, so it lands inside some accepted draft
    eos = full[7 + seed]
    reference = plain_greedy(target_model, prompt, 30, eos=eos)
    assert reference[-1] == eos and len(reference) < 30
    for draft in drafters(target_model, draft_model).values():
        result = generate(tiny_target(target_model, eos=eos), draft, RandomK(seed=seed), prompt, 30)
        assert result.token_ids == reference
        made = 0
        for s in result.steps:  # k never exceeds what was asked nor what the budget leaves room to verify
            assert s.k <= min(s.k_requested, 30 - made - 1)
            made += len(s.new_tokens)
        assert made == len(reference)


def test_k_capped_by_remaining_budget(tiny_pair):
    target_model, _ = tiny_pair
    draft = ModelDrafter(target_model, "identical", target_model.config.vocab_size)
    result = generate(tiny_target(target_model), draft, parse_policy("static:8"), [3, 4, 5], 11)
    assert [s.k for s in result.steps] == [8, 1]  # 9 tokens, then only 2 remain: k = 1
    assert len(result.token_ids) == 11
    assert result.token_ids == plain_greedy(target_model, [3, 4, 5], 11)


def test_identical_draft_accepts_everything(tiny_pair):
    target_model, _ = tiny_pair
    draft = ModelDrafter(target_model, "identical", target_model.config.vocab_size)
    result = generate(tiny_target(target_model), draft, parse_policy("static:4"), [7, 8], 25)
    assert result.stats.accept_rate == 1.0
    assert result.stats.steps == 5


def test_perturbed_draft_rejects_some(tiny_pair):
    target_model, draft_model = tiny_pair
    draft = ModelDrafter(draft_model, "perturbed", target_model.config.vocab_size)
    result = generate(tiny_target(target_model), draft, parse_policy("static:4"), [7, 8], 40)
    assert 0.0 < result.stats.accept_rate < 1.0  # so the tests above exercise rollback


def test_stats_are_consistent(tiny_pair):
    target_model, draft_model = tiny_pair
    draft = ModelDrafter(draft_model, "perturbed", target_model.config.vocab_size)
    stats = generate(tiny_target(target_model), draft, parse_policy("heuristic"), [7, 8], 40).stats
    assert stats.new_tokens == 40
    assert sum(stats.accept_counts.values()) == stats.steps
    assert stats.mean_accepted == pytest.approx(sum(a * c for a, c in stats.accept_counts.items()) / stats.steps)
    assert stats.tokens_per_s > 0


@pytest.mark.embedded
def test_embedded_target_ngram_lossless(embedded_target):
    prompt = embedded_target.encode(
        "Rewrite this function with a docstring:\ndef add(a, b):\n    return a + b\n", chat=True
    )
    reference = embedded_target.model.generate(
        torch.tensor([prompt]), max_new_tokens=48, do_sample=False, pad_token_id=2
    )[0, len(prompt):].tolist()
    eos = next(iter(embedded_target.eos_ids))
    if eos in reference:
        reference = reference[: reference.index(eos) + 1]
    for policy in ["static:4", "heuristic"]:
        result = generate(embedded_target, NgramDrafter(3), parse_policy(policy), prompt, 48)
        assert result.token_ids == reference, policy
        assert result.stats.mean_k > 0


def test_self_bf16_draft_lossless(tiny_pair):
    """--draft self:bf16: a lower-precision copy of the target as draft (high acceptance, no training)."""
    from specpilot.decoding.models import load_draft

    target_model, _ = tiny_pair
    target = tiny_target(target_model)
    draft = load_draft("self:bf16", target)
    assert next(draft.model.parameters()).dtype == torch.bfloat16
    assert next(target_model.parameters()).dtype == torch.float64  # the target itself is untouched
    result = generate(target, draft, parse_policy("static:4"), PROMPTS[0], 30)
    assert result.token_ids == plain_greedy(target_model, PROMPTS[0], 30)
    assert result.stats.accept_rate > 0.5


def test_match_length_policy_speculates_only_on_long_ngram_matches(tiny_pair):
    """match:N:K drafts K tokens exactly when the observed n-gram match is >= N tokens, else none."""
    from specpilot.decoding.errors import SpecPilotError
    from specpilot.decoding.observation import FEATURES

    target_model, _ = tiny_pair
    policy = parse_policy("match:2:4")
    assert policy.k_max == 4 and parse_policy("match:1.5").k == 8
    choose, seen = policy.choose_k, []
    policy.choose_k = lambda obs: seen.append((float(obs[FEATURES.index("ngram_match_len")]), choose(obs))) or seen[-1][1]
    prompt = [1, 2, 3, 1, 2, 3, 1, 2, 5, 9, 13, 2, 7]
    result = generate(tiny_target(target_model), NgramDrafter(3), policy, prompt, 40)
    assert result.token_ids == plain_greedy(target_model, prompt, 40)
    assert all(k == (4 if match >= 2 else 0) for match, k in seen)
    assert {k for _, k in seen} == {0, 4}  # both branches ran
    assert [s.k_requested for s in result.steps] == [k for _, k in seen]
    for bad in ("match:0", "match:2:0", "match:2:9", "match:x"):
        with pytest.raises(SpecPilotError):
            parse_policy(bad)
    assert parse_policy("match:2", draft="ngram:3").k == 8
    with pytest.raises(SpecPilotError, match="n-gram match"):  # a model draft has no match to read
        parse_policy("match:2", draft="default")


@pytest.mark.parametrize("greedy", [True, False])
def test_bf16_every_token_is_the_verify_pass_choice(greedy, monkeypatch):
    """What "lossless" promises in bf16: every emitted token is the verify pass's own choice (its argmax,
    or a draw the rejection sampler may make from its logits). A (k+1)-token pass can differ from a
    1-token step in the last bits and flip a near-tie, so bf16 output is not promised token-identical to
    plain bf16 decoding; the benchmark reports that mismatch rate instead (measured here too)."""
    import specpilot.decoding.loop
    from specpilot.decoding.sampling import Sampling
    from specpilot.bench.benchmark import mismatch_rate
    from conftest import perturbed_copy, tiny_llama

    target_model = tiny_llama(dtype=torch.bfloat16, seed=2)
    draft_model = perturbed_copy(target_model, 0.15)
    sampling = Sampling() if greedy else Sampling(temperature=1.0, top_k=3)
    passes = []
    real_greedy, real_sampling = specpilot.decoding.loop.verify_greedy_rows, specpilot.decoding.loop.verify_sampling

    def greedy_recorded(tokens, logits):
        accepted, new, kept = real_greedy(tokens, logits)
        for i in range(tokens.shape[0]):
            passes.append((logits[i].float().argmax(-1), None, accepted[i], torch.tensor(new[i]), tokens.shape[1]))
        return accepted, new, kept

    def sampling_recorded(tokens, q, p, generator):
        accepted, new = real_sampling(tokens, q, p, generator)
        passes.append((None, p, accepted, new, tokens.shape[0]))
        return accepted, new

    monkeypatch.setattr(specpilot.decoding.loop, "verify_greedy_rows", greedy_recorded)
    monkeypatch.setattr(specpilot.decoding.loop, "verify_sampling", sampling_recorded)
    prompt = [5, 9, 13, 2, 7]
    draft = ModelDrafter(draft_model, "d", target_model.config.vocab_size)
    result = generate(tiny_target(target_model), draft, parse_policy("static:4"), prompt, 40, sampling, seed=3)
    assert [t for _, _, _, new, _ in passes for t in new.tolist()] == result.token_ids  # the passes' output
    assert any(a < k for _, _, a, _, k in passes) and any(a > 0 for _, _, a, _, _ in passes)  # kept and refused
    for argmax, p, accepted, new, _ in passes:
        new = new.tolist()
        if greedy:  # each kept draft and the final token are the pass's argmax at their position
            assert new == argmax[: len(new)].tolist()
        else:  # each has probability under the pass's (top-3) law: a draft token it would never draw is refused
            assert all(float(p[j, t]) > 0 for j, t in enumerate(new))
    if greedy:
        plain = generate(tiny_target(target_model), None, parse_policy("none"), prompt, 40).token_ids
        print(f"bf16 token mismatch against plain bf16 decoding: {100 * mismatch_rate(result.token_ids, plain):.1f}%")


def test_rows_verifier_equals_the_one_row_verifier():
    """verify_greedy_rows (one transfer for all rows) keeps what verify_greedy keeps, row by row."""
    from specpilot.decoding.verify import verify_greedy, verify_greedy_rows

    g = torch.Generator().manual_seed(0)
    for k, ties in ((0, False), (1, False), (4, False), (4, True)):
        logits = torch.randn(6, k + 1, 5, generator=g)
        if ties:  # two or more maxima per position: the host (numpy) argmax takes the first one, as torch's
            logits = torch.randint(0, 2, (6, k + 1, 5), generator=g).float()
        drafts = logits[:, :k].argmax(-1)
        drafts[1, :] = (drafts[1, :] + 1) % 5  # row 1 rejected at once
        if k > 1:
            drafts[2, 1] = (drafts[2, 1] + 1) % 5  # row 2 after one
        accepted, new, kept = verify_greedy_rows(drafts, logits)
        for i in range(6):
            a, tokens = verify_greedy(drafts[i], logits[i])
            assert (accepted[i], new[i]) == (a, tokens.tolist())
            assert kept[i, : a + 1].tolist() == tokens.tolist()
        assert accepted[0] == k and accepted[1] == 0 and (k < 2 or accepted[2] == 1)
        assert verify_greedy_rows(drafts, logits.argmax(-1).numpy())[:2] == (accepted, new)  # an argmax given


def test_ngram_lookup_equals_a_plain_search_as_the_context_grows():
    """The n-gram drafter searches a host copy it extends step by step: it must find what a direct search
    of the whole context finds (the most recent earlier match of the longest suffix n-gram)."""
    import random

    def reference(ctx, k, max_n=3):
        for n in range(min(max_n, len(ctx) - 1), 0, -1):
            starts = [s for s in range(len(ctx) - n) if ctx[s : s + n] == ctx[len(ctx) - n :]]
            if starts:
                return ctx[starts[-1] + n : starts[-1] + n + k], n
        return [], 0

    rng = random.Random(0)
    draft = NgramDrafter(3)
    for _ in range(3):
        tokens = [rng.randint(0, 5) for _ in range(60)]
        draft.reset(torch.tensor(tokens[:5]))
        for length in list(range(5, 60, 1)) + [40, 41, 59]:  # growing, then shorter again (a new sequence view)
            got, n = draft.lookup(torch.tensor(tokens[:length]), 4)
            assert (got.tolist(), n) == reference(tokens[:length], 4), length


def test_match_statistics_equal_a_plain_count():
    """The match statistics the policy reads (suffix agreeing before the continuation, earlier occurrences,
    their agreement on the next token) against a direct count over the whole context, by hand and at random."""
    import random

    import numpy as np

    from specpilot.decoding.drafters import MATCH_CAP, match_statistics

    # a b c X a b c Y a b c: two earlier occurrences of "a b c", followed by X and Y; the latest is followed by Y
    assert match_statistics(np.array([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3]), 3) == (3, 2, 0.5)
    # q a b c Y ... q a b c: the match extends one token before the n-gram (q), one occurrence, agreeing
    assert match_statistics(np.array([7, 1, 2, 3, 8, 5, 6, 7, 1, 2, 3]), 3) == (4, 1, 1.0)
    assert match_statistics(np.array([1, 2, 3, 4]), 3) == (0, 0, 0.0)

    def reference(ctx, max_n=3):
        for n in range(min(max_n, len(ctx) - 1), 0, -1):
            starts = [s for s in range(len(ctx) - n) if ctx[s : s + n] == ctx[len(ctx) - n :]]
            if starts:
                start = starts[-1] + n
                suffix = 0
                while suffix < MATCH_CAP and start - 1 - suffix >= 0 and ctx[start - 1 - suffix] == ctx[-1 - suffix]:
                    suffix += 1
                agree = sum(ctx[s + n] == ctx[start] for s in starts) / len(starts)
                return suffix, min(len(starts), MATCH_CAP), agree
        return 0, 0, 0.0

    rng = random.Random(1)
    draft = NgramDrafter(3)
    seen = set()
    for _ in range(40):
        vocab = rng.choice([1, 3])  # binary text repeats every 3-gram often: past the cap
        tokens = [rng.randint(0, vocab) for _ in range(rng.randint(2, 300))]
        draft.reset(torch.tensor(tokens[:1]))  # a new sequence
        got = draft.match_stats(torch.tensor(tokens))
        assert got == pytest.approx(reference(tokens)), tokens
        seen.add(got[1] == MATCH_CAP)
    assert seen == {True, False}  # both below and at the cap
