"""After a rejected draft, both KV caches are rolled back: next logits equal a fresh forward."""
from __future__ import annotations

import torch
from conftest import tiny_target

from specpilot.decoding.drafters import ModelDrafter
from specpilot.decoding.loop import speculative_step, start


@torch.no_grad()
def test_rollback_after_rejection_matches_fresh_forward(tiny_pair):
    target_model, draft_model = tiny_pair
    draft = ModelDrafter(draft_model, "perturbed", target_model.config.vocab_size)
    state = start(tiny_target(target_model), draft, [4, 8, 15, 16, 23, 42], 60)
    rejected = 0
    while not state.done and rejected < 3:
        step = speculative_step(state, 6)
        if step.accepted < step.k:
            rejected += 1
            context = state.context
            assert state.cache.get_seq_length() == context.shape[0] - 1
            cached = target_model(context[-1:][None], cache=state.cache, use_cache=True).logits[0, -1]
            fresh = target_model(context[None]).logits[0, -1]
            torch.testing.assert_close(cached, fresh)
            state.cache.crop(-1)  # undo the probe
            assert draft.cached <= context.shape[0] - 1
            assert draft.cache.get_seq_length() == draft.cached
            draft_cached = draft_model(context[draft.cached:][None], cache=draft.cache, use_cache=True).logits[0, -1]
            torch.testing.assert_close(draft_cached, draft_model(context[None]).logits[0, -1])
            draft.cache.crop(-(context.shape[0] - draft.cached))
    assert rejected == 3


def test_k_zero_is_a_plain_step(tiny_pair):
    target_model, draft_model = tiny_pair
    draft = ModelDrafter(draft_model, "perturbed", target_model.config.vocab_size)
    state = start(tiny_target(target_model), draft, [1, 2, 3], 10)
    calls = []
    draft.propose = lambda *a, **kw: calls.append(a) or ModelDrafter.propose(draft, *a, **kw)
    cached = draft.cache.get_seq_length() if draft.cache is not None else 0
    step = speculative_step(state, 0)
    assert step.k == 0 and step.accepted == 0 and len(step.new_tokens) == 1
    assert calls == [] and (draft.cache.get_seq_length() if draft.cache is not None else 0) == cached  # no draft ran
    assert state.cache.get_seq_length() == state.length - 1
