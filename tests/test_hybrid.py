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
