"""`--draft hybrid`: prompt lookup and the trained head in one loop, the source chosen per step by the policy;
token-identical to plain decoding whatever the source (one row and a batch), each source actually drafting, and the
field's source rules decided as defined. (The sampled law: tests/test_sampling.py, case hybrid-lookup-then-head.)"""
from __future__ import annotations

import math

import numpy as np
import pytest

from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.hybrid import SamK, ScoreK, match_suffix
from specpilot.decoding.loop import generate
from specpilot.decoding.models import load_draft
from specpilot.decoding.observation import FEATURES, LOG_CAP
from specpilot.decoding.policy_spec import parse_policy
from specpilot.decoding.policies import NoSpeculation

PROMPTS = ["Repeat exactly: the quick brown fox jumps over the lazy dog. The quick brown fox",
           "What is 17 times 3? Explain step by step."]


@pytest.fixture(scope="module")
def hybrid(embedded_target):
    return embedded_target, load_draft("hybrid", embedded_target)


@pytest.mark.embedded
@pytest.mark.parametrize("policy", ["source:extend:5", "hybrid-sam:2:8:2"] + [
    pytest.param(p, marks=pytest.mark.slow) for p in ("source:lookup:4", "source:head:2", "hybrid-score:8:2:0.2",
                                                      "static:3")])  # the default suite: two, -m slow the rest
def test_every_source_and_rule_is_token_identical_to_plain(hybrid, policy):
    target, draft = hybrid
    prompts = [target.encode(p, chat=True) for p in PROMPTS]
    for ids in prompts:
        plain = generate(target, None, NoSpeculation(), ids, 32)
        spec = generate(target, draft, parse_policy(policy, 8, draft="hybrid"), ids, 32)
        assert spec.token_ids == plain.token_ids, policy
        assert sum(s.k for s in spec.steps) > 0
    batch = generate(target, draft, parse_policy(policy, 8, draft="hybrid"), prompts, 24)
    assert batch.token_ids == [generate(target, None, NoSpeculation(), ids, 24).token_ids for ids in prompts]
    sources = {s.source for s in spec.steps if s.k}
    expected = {"source:lookup:4": {"lookup"}, "source:head:2": {"head"}, "source:extend:5": {"extend"},
                "static:3": {"extend"}}.get(policy)
    assert sources == expected if expected else sources <= {"lookup", "head"}


def obs(suffix: float = 0.0, agreement: float = 0.0, available: float = 0.0) -> np.ndarray:
    o = np.zeros(len(FEATURES), dtype=np.float32)
    o[FEATURES.index("ngram_suffix_log")] = math.log1p(suffix) / LOG_CAP
    o[FEATURES.index("ngram_agreement")] = agreement
    o[FEATURES.index("draft_available_frac")] = available
    return o


def test_the_source_rules_decide_as_defined():
    assert match_suffix(obs(suffix=5)) == pytest.approx(5, rel=1e-5)
    sam = SamK(4, 8, 2, 0.3)
    assert (sam.choose_k(obs(suffix=4)), sam.source, sam.stop) == (8, "lookup", None)
    assert (sam.choose_k(obs(suffix=3)), sam.source, sam.stop.min_confidence) == (2, "head", 0.3)
    score = ScoreK(8, 2, k_max=8)
    assert (score.choose_k(obs(agreement=0.5, available=0.5)), score.source) == (8, "lookup")  # 0.5 x 4 >= 2
    assert (score.choose_k(obs(agreement=0.4, available=0.5)), score.source) == (2, "head")
    with pytest.raises(SpecPilotError, match="chooses the draft source"):
        parse_policy("hybrid-sam", 8, draft="ngram:3")
    with pytest.raises(SpecPilotError, match="unknown draft source"):
        parse_policy("source:both:2", 8, draft="hybrid")


@pytest.mark.embedded
def test_an_extension_the_lookup_fills_alone_is_the_lookups_draft_without_the_head(hybrid, monkeypatch):
    import torch

    from specpilot.decoding.drafters import hidden_features
    from specpilot.decoding.sampling import Sampling

    target, draft = hybrid
    ids = target.encode(PROMPTS[0], chat=False)
    context = torch.tensor(ids)
    with torch.inference_mode():
        out = target.model(input_ids=context[None, :-1], output_hidden_states=True)
    hidden = hidden_features(out.hidden_states, draft)[:, -1]
    draft.reset(context)
    lookup = draft.lookup.lookup(context, 64)[0]  # all the lookup can propose here
    assert 2 <= lookup.shape[0] < 64  # the prompt repeats itself: the lookup has a continuation
    advances = []
    real_advance = draft.head.head.advance
    monkeypatch.setattr(draft.head.head, "advance", lambda *a: advances.append(1) or real_advance(*a))
    n = lookup.shape[0]
    alone = draft.propose(context, n, Sampling(), None, target_hidden=hidden, source="extend")
    assert alone.tokens.tolist() == lookup.tolist() and advances == []  # a broken skip would advance n times
    longer = draft.propose(context, n + 2, Sampling(), None, target_hidden=hidden, source="extend")
    assert longer.tokens[:n].tolist() == lookup.tolist() and longer.tokens.shape[0] == n + 2
    assert len(advances) == n + 2  # through the copied tokens, then one per head token


def test_the_replay_checks_recorder_passes_on_the_source_its_policy_chose():
    """The replay check runs a policy inside a Recorder: the loop and the replay env read the step's source off it (a
    Recorder without it ran every hybrid policy on the default source)."""
    from specpilot.bench.replay_check import Recorder

    recorder = Recorder(SamK(4, 8, 2, 0.3))
    assert recorder.choose_k(obs(suffix=5)) == 8 and recorder.source == "lookup" and recorder.stop is None
    assert recorder.choose_k(obs(suffix=1)) == 2 and recorder.source == "head" and recorder.stop.min_confidence == 0.3
