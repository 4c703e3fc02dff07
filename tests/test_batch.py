"""Batched speculative decoding: every row's greedy output equals its own plain greedy decoding."""
from __future__ import annotations

import pytest
import torch
from conftest import RandomK, perturbed_copy, plain_greedy, tiny_llama, tiny_target

from specpilot.decoding.drafters import ModelDrafter, NgramDrafter
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.head_draft import DraftHead, HeadConfig, HeadDrafter, target_signature
from specpilot.decoding.loop import generate, speculative_step, start
from specpilot.decoding.policy_spec import parse_policy

# different lengths (one of a single token), repetitive and not
BATCH = [[5, 9, 13, 2, 7], [1, 2, 3, 1, 2, 3, 1, 2], [42], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 3], [11, 30]]


@pytest.fixture(scope="module")
def tiny_pair():
    """A tiny target with sharp attention (scaled query/key weights), so that a wrong position id or
    an unmasked slot changes its greedy output: the default init attends almost uniformly."""
    model = tiny_llama(seed=2)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
            layer.self_attn.k_proj.weight.mul_(6.0)
    return model, None


def head_draft(model, seed=0):
    torch.manual_seed(seed)
    cfg = HeadConfig(hidden_size=model.config.hidden_size, intermediate_size=48, blocks=1,
                     vocab_ids=list(range(model.config.vocab_size)), target_vocab_size=model.config.vocab_size,
                     target_signature=target_signature(model))
    return HeadDrafter(DraftHead(cfg).to(model.dtype), model)


def batch_drafters(model):
    return {"ngram": NgramDrafter(3), "head": head_draft(model),
            "lm": ModelDrafter(perturbed_copy(model, 0.1), "perturbed", model.config.vocab_size),
            "identical": ModelDrafter(model, "identical", model.config.vocab_size)}


@pytest.mark.parametrize("policy", ["none", "static:2", "static:6", "heuristic"])
@pytest.mark.parametrize("drafter", ["ngram", "head", "lm", "identical"])
def test_batch_rows_equal_their_own_greedy(tiny_pair, policy, drafter):
    model, _ = tiny_pair
    result = generate(tiny_target(model), batch_drafters(model)[drafter], parse_policy(policy), BATCH, 24)
    assert result.token_ids == [plain_greedy(model, p, 24) for p in BATCH]
    assert result.stats.new_tokens == 24 * len(BATCH)


@pytest.mark.parametrize("seed", range(4))
def test_batch_rows_finish_at_different_times(tiny_pair, seed):
    model, _ = tiny_pair
    # an EOS that the second row emits early; other rows may emit it at other times or never
    eos = plain_greedy(model, BATCH[1], 30)[4 + seed]
    references = [plain_greedy(model, p, 30, eos=eos) for p in BATCH]
    assert len({len(r) for r in references}) > 1
    for draft in batch_drafters(model).values():
        result = generate(tiny_target(model, eos=eos), draft, RandomK(seed=seed), BATCH, 30)
        assert result.token_ids == references


class PartlyRightDrafter:
    """Knows each row's true continuation; row r proposes r % (k + 1) right tokens, then wrong ones."""

    name = "partly-right"
    needs_hidden = False

    def __init__(self, prompts, references, vocab):
        self.prompts, self.references, self.vocab = prompts, references, vocab

    def reset_batch(self, contexts):
        pass

    def rollback_batch(self, lengths, rows):
        pass

    def propose_batch(self, contexts, k, sampling, generator, stop=None, target_hidden=None, rows=None):
        from specpilot.decoding.drafters import Draft

        tokens = torch.empty(len(contexts), k, dtype=torch.long)
        for i, (context, row) in enumerate(zip(contexts, rows)):
            done = context.shape[0] - len(self.prompts[row])
            truth = (self.references[row][done:] + [0] * k)[:k]
            right = row % (k + 1)
            tokens[i] = torch.tensor(truth[:right] + [(t + 1) % self.vocab for t in truth[right:]])
        return Draft(tokens=tokens)


def test_rows_accept_different_counts_and_holes_stay_masked(tiny_pair):
    """Rows accept different numbers of drafted tokens: the shared cache keeps one row's rejected
    slots (masked) while another row uses them, and the outputs stay exact."""
    model, _ = tiny_pair
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 9, 13, 2, 7], [1, 2, 3], [8, 8], [4, 4, 4, 4, 4, 4, 4]]
    references = [plain_greedy(model, p, 24) for p in prompts]
    state = start(tiny_target(model), PartlyRightDrafter(prompts, references, 64), prompts, 24)
    seen = set()
    while not state.done:
        step = speculative_step(state, 4)
        seen.add(tuple(step.accepted_rows))
        if not state.done:
            assert state.slot_mask.shape == (len(state.active), state.cache.get_seq_length())
            # each row sees exactly its confirmed tokens but the last
            assert state.slot_mask.sum(dim=1).tolist() == [r.length - 1 for r in state.active_rows]
    assert [r.generated for r in state.rows] == references
    assert (0, 1, 2, 3, 4) in seen  # row r accepted r tokens in the same step


def test_batch_of_one_is_the_single_sequence_path(tiny_pair):
    model, _ = tiny_pair
    draft = NgramDrafter(3)
    single = generate(tiny_target(model), draft, parse_policy("static:4"), BATCH[1], 20)
    batch = generate(tiny_target(model), draft, parse_policy("static:4"), [BATCH[1]], 20)
    assert batch.token_ids == [single.token_ids]
    assert [s.k for s in batch.steps] == [s.k for s in single.steps]


def test_batched_sampling_is_reproducible_and_complete(tiny_pair):
    from specpilot.decoding.sampling import Sampling

    model, _ = tiny_pair
    sampling = Sampling(temperature=0.8)
    runs = [generate(tiny_target(model), head_draft(model), parse_policy("static:3"), BATCH, 16, sampling, seed=5)
            for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids
    assert all(len(row) == 16 for row in runs[0].token_ids)


def test_batched_draft_lm_cache_matches_a_fresh_forward(tiny_pair):
    """After steps with different acceptance per row, the draft LM's own batched cache (holes masked)
    gives the same next-token logits as running the draft on each row's confirmed tokens from scratch."""
    model, _ = tiny_pair
    draft_model = perturbed_copy(model, 0.1)
    draft = ModelDrafter(draft_model, "perturbed", model.config.vocab_size)
    state = start(tiny_target(model), draft, BATCH[:4], 16)
    for k in (3, 5, 2, 4):
        speculative_step(state, k)
    contexts = [r.context for r in state.active_rows]
    proposal = draft.propose_batch(contexts, 1, state.sampling, None, rows=list(state.active))
    for i, context in enumerate(contexts):
        with torch.no_grad():
            fresh = draft_model(context[None]).logits[0, -1].argmax()
        assert int(proposal.tokens[i, 0]) == int(fresh)
    assert draft._mask.shape[1] == draft.cache.get_seq_length()


def test_drafter_without_batch_support_is_refused(tiny_pair):
    model, _ = tiny_pair

    class SingleOnly:
        name, needs_hidden = "single-only", False

        def reset(self, prompt):
            pass

    with pytest.raises(SpecPilotError, match="does not support batched decoding"):
        start(tiny_target(model), SingleOnly(), BATCH[:2], 8)


def test_grouped_query_attention_in_place_is_transformers_attention(tiny_pair):
    """CPU models run sdpa with the grouped key/value heads read in place (decoding.models.use_gqa_attention:
    transformers copies them per query head in a masked multi-token pass, the batch verify). Same logits as
    transformers' path on a left-padded batch verifying 4 drafts, the holes test's outputs still exact; and
    the comparison has the power to see a wrong head grouping (kv heads tiled instead of interleaved)."""
    import copy

    from specpilot.decoding.models import GQA_SDPA, use_gqa_attention

    model, _ = tiny_pair
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    fast = use_gqa_attention(copy.deepcopy(model))
    assert fast.config._attn_implementation == GQA_SDPA and model.config._attn_implementation == "sdpa"
    ids = torch.tensor([[0, 0, 5, 9, 13, 2, 7, 1, 2], [1, 2, 3, 1, 2, 3, 1, 2, 4]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 9])
    positions = (mask.cumsum(1) - 1).clamp_min(0)

    def logits(m):
        with torch.inference_mode():
            return m(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -5:]

    reference, ours = logits(model), logits(fast)
    assert torch.allclose(reference, ours, atol=1e-9)

    def tiled(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        groups = module.num_key_value_groups
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat(1, groups, 1, 1), value.repeat(1, groups, 1, 1), attn_mask=attention_mask, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("tiled_kv", tiled)
    AttentionMaskInterface.register("tiled_kv", sdpa_mask)
    broken = copy.deepcopy(model)
    broken.set_attn_implementation("tiled_kv")
    assert not torch.allclose(reference, logits(broken), atol=1e-3)
    test_rows_accept_different_counts_and_holes_stay_masked((fast, None))
