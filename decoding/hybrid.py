"""Two drafts in one loop, the source chosen per step: prompt lookup and the trained head (`--draft hybrid`).

A step's action is (source, k, stop level): `lookup` drafts the tokens that followed the context's latest n-gram
match, `head` drafts from the target's hidden state, `extend` drafts the lookup's continuation and lets the head
carry on from its end (the head advanced through the lookup tokens, as it advances through its own). A length
policy names the source in its `source` attribute after `choose_k` (the loop passes it to `propose`); a policy
that names none gets `extend`. Lossless either way: a lookup token's draft distribution is a point mass, a head
token's the head's own, so greedy verification keeps plain decoding's tokens and speculative sampling the target's
law (tests/test_hybrid.py).

The field's rules for the choice (their definitions cited in `HYBRID_RULES`) are length policies here:
`hybrid-sam` (SAM-Decoding: the retrieved draft when the match is long enough, else the model draft),
`hybrid-score` (Arctic Inference: the suffix draft when its expected accepted length reaches the speculator's),
and `source:S:K` (one source, a fixed k)."""
from __future__ import annotations

import math

import torch

from .drafters import Draft, NgramDrafter, StopRule
from .errors import SpecPilotError
from .observation import FEATURES, LOG_CAP
from .policies import BanditK, LengthPolicy
from .sampling import Sampling

SOURCES = ("lookup", "head", "extend")
ACTION_SOURCES = (None, "lookup", "head")
"""The sources of a learned hybrid policy's actions (`policies.ActionTable`): None first, the default one (the
extension, unless the env or caller names another), so that actions 0..k_max stay k alone."""
HYBRID_RULES = {
    "hybrid-sam": "SAM-Decoding (Hu et al. 2024, arXiv:2411.10666): the suffix automaton's retrieved draft when its "
                  "match is at least N tokens (N = 4 in its code), else the auxiliary draft (EAGLE)",
    "hybrid-score": "Arctic Inference's suffix decoding (Snowflake 2025): the suffix-tree draft when its score (the "
                    "expected accepted tokens, a sum of path frequencies) reaches the model speculator's draft "
                    "length, else the speculator",
    "hybrid-best": "llama.cpp's parallel drafting (PR 22838): every speculator drafts and the best one wins by its "
                   "acceptance rate x its draft length (here each source's acceptance so far in the sequence, "
                   "Laplace-smoothed, times the tokens it can draft now)",
    "hybrid-ucb": "MetaSD (ACL 2026): a UCB bandit over drafters; here over (source, k) arms, each arm's reward its "
                  "steps' tokens per second (BanditSpec's reward, `bandit-ucb`)",
    "source": "one source at a fixed k: each single draft's rule inside the hybrid loop",
}


class HybridDrafter:
    """Prompt lookup (`NgramDrafter`) and a draft head (`head_draft.HeadDrafter`) behind one drafter, per step the
    source its caller names (`propose(..., source=)`; default `extend`)."""

    needs_hidden = True
    reports_confidence = True

    def __init__(self, lookup: NgramDrafter, head, name: str = "hybrid"):
        self.lookup, self.head, self.name = lookup, head, name
        self.hidden_layers = head.hidden_layers
        self.weights_id = getattr(head, "weights_id", "")
        self.distilled_on = getattr(head, "distilled_on", None)
        self.last_source = "extend"
        """The source of the last proposal (the policy's, or the default)."""

    # the lookup's free reads, for the observation builder
    def peek(self, context: torch.Tensor, k: int, row: int = 0) -> tuple[int, int]:
        return self.lookup.peek(context, k, row)

    def match_stats(self, context: torch.Tensor, row: int = 0) -> tuple[int, int, float]:
        return self.lookup.match_stats(context, row)

    def reset(self, prompt: torch.Tensor) -> None:
        self.lookup.reset(prompt)
        self.head.reset(prompt)

    def reset_batch(self, contexts) -> None:
        self.lookup.reset_batch(contexts)
        self.head.reset_batch(contexts)

    def rollback(self, length: int) -> None:
        self.lookup.rollback(length)
        self.head.rollback(length)

    def rollback_batch(self, lengths, rows) -> None:
        self.lookup.rollback_batch(lengths, rows)
        self.head.rollback_batch(lengths, rows)

    def propose(self, context, k, sampling: Sampling, generator, stop=None, target_hidden=None, source=None) -> Draft:
        draft = self.propose_batch([context], k, sampling, generator, stop,
                                   target_hidden[-1:] if target_hidden is not None else None, source=source)
        draft.tokens = draft.tokens[0]
        draft.probs = draft.probs[0] if draft.probs is not None else None
        return draft

    @torch.inference_mode()
    def propose_batch(self, contexts, k, sampling: Sampling, generator, stop=None, target_hidden=None, rows=None,
                      source=None) -> Draft:
        """Every row's draft from the named source; `extend` takes the rows' lookup tokens up to the shortest
        continuation among them, then the head's (one source and one length for the whole batch)."""
        source = source or "extend"
        if source not in SOURCES:
            raise SpecPilotError(f"unknown draft source '{source}'; expected one of {', '.join(SOURCES)}")
        self.last_source = source
        rows = rows if rows is not None else list(range(len(contexts)))
        device = contexts[0].device
        if k <= 0:
            return Draft(tokens=torch.empty(len(contexts), 0, dtype=torch.long, device=device))
        if source == "lookup":
            return self.lookup.propose_batch(contexts, k, sampling, generator, rows=rows)
        if source == "head" or target_hidden is None:
            if target_hidden is None:
                return Draft(tokens=torch.empty(len(contexts), 0, dtype=torch.long, device=device))
            return self.head.propose_batch(contexts, k, sampling, generator, stop, target_hidden, rows)
        found = [self.lookup.lookup(c, k, row) for c, row in zip(contexts, rows)]
        n_lookup = min(t.shape[0] for t, _ in found)
        copied = torch.stack([t[:n_lookup] for t, _ in found]) if n_lookup else None
        match = sum(n for _, n in found) / len(found)
        return self._extend(contexts, copied, k, sampling, generator, stop, target_hidden, match)

    def _extend(self, contexts, copied, k, sampling, generator, stop, target_hidden, match) -> Draft:
        """`copied` (rows, n) lookup tokens, then up to k - n head tokens from the head's state advanced through them
        (`HeadDrafter.draft_on`); a lookup token's draft distribution is a point mass on it."""
        head = self.head
        n = 0 if copied is None else copied.shape[1]
        if n >= k:  # the lookup fills the draft alone: its own draft (a point mass), the head not advanced through it
            return Draft(tokens=copied, confidences=[1.0] * n, entropies=[0.0] * n, match_len=match)
        point = None
        if n and not sampling.greedy:
            point = torch.nn.functional.one_hot(copied, head.vocab_size).to(head.head_weight.dtype)
        state = head.head.start(target_hidden)
        token = torch.stack([c[-1] for c in contexts])
        for j in range(n):  # the head reads the copied tokens as it reads its own
            state = head.head.advance(state, head.embed(token))
            token = copied[:, j]
        drafted = Draft(tokens=copied, probs=point, confidences=[1.0] * n, entropies=[0.0] * n) if n else None
        draft = head.draft_on(state, token, k - n, sampling, generator, stop, contexts[0].device, drafted)
        draft.match_len = match
        return draft


_SUFFIX = FEATURES.index("ngram_suffix_log")
_AGREEMENT = FEATURES.index("ngram_agreement")
_AVAILABLE = FEATURES.index("draft_available_frac")


def match_suffix(obs) -> float:
    """The lookup match's suffix in tokens (the observation's `ngram_suffix_log`, undone)."""
    return math.expm1(float(obs[_SUFFIX]) * LOG_CAP)


class SourceK(LengthPolicy):
    """One source at a fixed k (`source:lookup:3`, `source:head:2[:P]` with a p-min stop, `source:extend:4`)."""

    def __init__(self, source: str, k: int, min_confidence: float = 0.0):
        if source not in SOURCES:
            raise SpecPilotError(f"unknown draft source '{source}'; expected one of {', '.join(SOURCES)}")
        self.source = source
        self.k = self.k_max = k
        self.stop = StopRule(min_confidence=min_confidence) if min_confidence > 0 else None
        self.name = f"source:{source}:{k}" + (f":{min_confidence:g}" if min_confidence > 0 else "")

    def choose_k(self, obs) -> int:
        return self.k


class SamK(LengthPolicy):
    """SAM-Decoding's choice (`hybrid-sam:N:KL:KH[:P]`): the lookup's continuation (KL tokens) when its match suffix
    is at least N tokens, else the head (KH tokens, stopping below confidence P)."""

    def __init__(self, min_match: float = 4.0, k_lookup: int = 8, k_head: int = 2, min_confidence: float = 0.0):
        if min_match <= 0 or k_lookup < 1 or k_head < 0:
            raise SpecPilotError(f"hybrid-sam needs N > 0, KL >= 1, KH >= 0; got {min_match:g}, {k_lookup}, {k_head}")
        self.min_match, self.k_lookup, self.k_head = float(min_match), k_lookup, k_head
        self.k_max = max(k_lookup, k_head)
        self._head_stop = StopRule(min_confidence=min_confidence) if min_confidence > 0 else None
        self.name = f"hybrid-sam:{min_match:g}:{k_lookup}:{k_head}" + (f":{min_confidence:g}" if min_confidence > 0 else "")
        self.source = "head"

    def choose_k(self, obs) -> int:
        if match_suffix(obs) >= self.min_match:
            self.source, self.stop = "lookup", None
            return self.k_lookup
        self.source, self.stop = "head", self._head_stop
        return self.k_head


class ScoreK(LengthPolicy):
    """Arctic Inference's choice (`hybrid-score:KL:KH[:P]`): the lookup's score, its expected accepted tokens (here
    the share of the n-gram's earlier occurrences followed by the proposed token, times the tokens it can draft, up
    to KL), against the head's draft length KH: the lookup when the score reaches it, else the head."""

    def __init__(self, k_lookup: int = 8, k_head: int = 2, min_confidence: float = 0.0, k_max: int = 8):
        if k_lookup < 1 or k_head < 0:
            raise SpecPilotError(f"hybrid-score needs KL >= 1, KH >= 0; got {k_lookup}, {k_head}")
        self.k_lookup, self.k_head, self.k_scale = k_lookup, k_head, k_max
        # the observation's available share is of its builder's k_max, the policy's (decoding.loop.generate): this
        # rule's is the scale it reads the share with, so the loop and the replay env (k_max = the scale) agree
        self.k_max = max(k_lookup, k_head, k_max)
        self._head_stop = StopRule(min_confidence=min_confidence) if min_confidence > 0 else None
        self.name = f"hybrid-score:{k_lookup}:{k_head}" + (f":{min_confidence:g}" if min_confidence > 0 else "")
        self.source = "head"

    def choose_k(self, obs) -> int:
        available = min(self.k_lookup, float(obs[_AVAILABLE]) * self.k_scale)
        if available >= 1 and float(obs[_AGREEMENT]) * available >= max(self.k_head, 1):
            self.source, self.stop = "lookup", None
            return self.k_lookup
        self.source, self.stop = "head", self._head_stop
        return self.k_head


class BestOfK(LengthPolicy):
    """llama.cpp's best-of-speculators choice (`hybrid-best:KL:KH[:P]`): the source whose acceptance rate so far in
    the sequence ((accepted + 1) / (drafted + 2) over its own steps) times the tokens it can draft now (the lookup's
    continuation up to KL, the head's KH) is the larger."""

    def __init__(self, k_lookup: int = 8, k_head: int = 2, min_confidence: float = 0.0, k_max: int = 8):
        if k_lookup < 1 or k_head < 1:
            raise SpecPilotError(f"hybrid-best needs KL >= 1, KH >= 1; got {k_lookup}, {k_head}")
        self.k_lookup, self.k_head, self.k_scale = k_lookup, k_head, k_max
        self.k_max = max(k_lookup, k_head, k_max)  # the scale of the available share it reads (ScoreK)
        self._head_stop = StopRule(min_confidence=min_confidence) if min_confidence > 0 else None
        self.name = f"hybrid-best:{k_lookup}:{k_head}" + (f":{min_confidence:g}" if min_confidence > 0 else "")
        self.reset()

    def reset(self) -> None:
        self.counts = {"lookup": [0, 0], "head": [0, 0]}  # [accepted, drafted] of each source's steps
        self.source = "head"

    def rate(self, source: str) -> float:
        accepted, drafted = self.counts[source]
        return (accepted + 1) / (drafted + 2)

    def choose_k(self, obs) -> int:
        available = min(self.k_lookup, round(float(obs[_AVAILABLE]) * self.k_scale))
        if available >= 1 and self.rate("lookup") * available >= self.rate("head") * self.k_head:
            self.source, self.stop = "lookup", None
            return self.k_lookup
        self.source, self.stop = "head", self._head_stop
        return self.k_head

    def update(self, step) -> None:
        counts = self.counts.get(getattr(step, "source", None) or "")
        if counts is not None and step.k:
            counts[0] += step.accepted
            counts[1] += step.k


class SourceBanditK(BanditK):
    """MetaSD's UCB bandit over drafters (`hybrid-ucb:S=K/S=K/..[:C]`): each arm a (source, k), its reward its steps'
    tokens per second, played by `BanditK`'s UCB (statistics kept across sequences, one bandit per batch size)."""

    def __init__(self, arms=(("lookup", 8), ("head", 2), ("extend", 4)), c: float = 0.3):
        arms = [(str(s), int(k)) for s, k in arms]
        for source, k in arms:
            if source not in SOURCES or k < 0:
                raise SpecPilotError(f"hybrid-ucb arm '{source}={k}': expected SOURCE=K with a source in {', '.join(SOURCES)}")
        if not arms or len(set(arms)) != len(arms) or c < 0:
            raise SpecPilotError(f"hybrid-ucb needs distinct arms and c >= 0, got {arms}, {c}")
        super().__init__(range(len(arms)), c, k_max=len(arms))
        self.pairs = arms
        self.k_max = max(k for _, k in arms)
        self.name = "hybrid-ucb:" + "/".join(f"{s}={k}" for s, k in arms) + f":{c:g}"
        self.source = arms[0][0]

    def choose_k(self, obs) -> int:
        self.source, k = self.pairs[self.pick(obs)]
        return k


def parse_hybrid_rule(name: str, arg: str, k_max: int) -> LengthPolicy:
    """`source:S:K[:P]`, `hybrid-sam[:N[:KL[:KH[:P]]]]`, `hybrid-score[:KL[:KH[:P]]]`, `hybrid-best[:KL[:KH[:P]]]`,
    `hybrid-ucb[:S=K/S=K/..[:C]]` (ValueError: not one)."""
    parts = arg.split(":") if arg else []
    if name == "hybrid-ucb":
        if len(parts) > 2:
            raise ValueError
        arms = [a.partition("=") for a in parts[0].split("/")] if parts and parts[0] else None
        if arms is not None and any(not sep or not k.isdigit() for _, sep, k in arms):
            raise ValueError
        policy = SourceBanditK([(s, int(k)) for s, _, k in arms] if arms else
                               [(s, min(k, k_max)) for s, k in (("lookup", 8), ("head", 2), ("extend", 4))],
                               float(parts[1]) if len(parts) > 1 else 0.3)
        _check_k(policy.k_max, k_max)
        return policy
    if name == "source":
        if not 2 <= len(parts) <= 3:
            raise ValueError
        k = int(parts[1])
        _check_k(k, k_max)
        return SourceK(parts[0], k, float(parts[2]) if len(parts) == 3 else 0.0)
    if name == "hybrid-sam":
        if len(parts) > 4:
            raise ValueError
        n, kl, kh, p = (parts + [None] * 4)[:4]
        policy = SamK(float(n or 4), int(kl or min(8, k_max)), int(kh or min(2, k_max)), float(p or 0.0))
    elif name in ("hybrid-score", "hybrid-best"):
        if len(parts) > 3:
            raise ValueError
        kl, kh, p = (parts + [None] * 3)[:3]
        rule = ScoreK if name == "hybrid-score" else BestOfK
        policy = rule(int(kl or min(8, k_max)), int(kh or min(2, k_max)), float(p or 0.0), k_max)
    else:
        raise ValueError
    _check_k(policy.k_max, k_max)
    return policy


def _check_k(k: int, k_max: int) -> None:
    if not 0 <= k <= k_max:
        raise SpecPilotError(f"k={k} is outside [0, k_max={k_max}] (raise --k-max to allow it)")


def is_hybrid_rule(name: str) -> bool:
    return name in HYBRID_RULES

