"""Hand-made length rules by their CLI spelling (`static:2`, `match:2:8`, `confidence:0.2:2`, ...): `parse_rule`.

The spellings a learned or tuned policy adds (`learned`, `best-rule`, `rule:FAMILY`) are `policy_spec.parse_policy`'s,
which builds on this module as `learned.LearnedK` does (its deferred rules are spellings)."""
from __future__ import annotations

from .errors import SpecPilotError
from .hybrid import is_hybrid_rule, parse_hybrid_rule
from .policies import (
    DEFAULT_K_MAX,
    AdaEDL,
    BanditK,
    ConfidenceStop,
    EntropyStop,
    HeuristicK,
    LengthPolicy,
    MatchLengthK,
    NoSpeculation,
    RocConfidence,
    SGLangAdaptiveK,
    StaticK,
    TrtllmK,
)

POLICY_HELP = ("none | static:K | heuristic | confidence:P[:K] (p-min) | transformers-roc[:T[:K]] | entropy:H[:K] (SVIP) | "
               "adaedl[:GAMMA[:LAMBDA0[:K]]] | bandit-ucb[:K1/K2/..[:C]] | match:N[:K] | sglang-adaptive[:C1/C2/..[:ALPHA]] | "
               "trtllm:B=K/B=K/..[:WINDOW:THRESHOLD] | with --draft hybrid: source:lookup|head|extend:K[:P], hybrid-sam[:N[:KL[:KH[:P]]]] "
               "(SAM-Decoding), hybrid-score[:KL[:KH[:P]]] (Arctic Inference), hybrid-best[:KL[:KH[:P]]] (llama.cpp's best-of-"
               "speculators), hybrid-ucb[:S=K/S=K/..[:C]] (MetaSD's bandit) | best-rule | rule:FAMILY (tuned on the train split) | learned | learned:PATH "
               "| learned-mlp[:PATH] (the MLP alone, without its deferred rules) | learned-idle-counters[:PATH] (its hardware "
               "counters pinned to its device profile's idle ones: an ablation) (benchmark also: oracle, batch-table)")


def resolve_k_max(requested: int | None, policies) -> int:
    """The k_max to draft and observe with: a learned policy's own (its features were scaled by it in
    training), else `requested`, else DEFAULT_K_MAX. A `requested` value that differs from a learned
    policy's, or learned policies with different k_max, are an error."""
    # a learned policy (decoding.learned.LearnedK) maps actions to k
    own = sorted({int(p.k_max) for p in policies if getattr(p, "action_to_k", None) is not None})
    if len(own) > 1:
        raise SpecPilotError(f"the learned policies were trained with different k_max {own}; compare them in separate runs")
    if own:
        if requested is not None and requested != own[0]:
            raise SpecPilotError(f"--k-max {requested} conflicts with the learned policy's k_max {own[0]} (the one it "
                                 "was trained with); drop --k-max")
        return own[0]
    if requested is not None and requested < 0:
        raise SpecPilotError(f"--k-max must be >= 0, got {requested}")
    return DEFAULT_K_MAX if requested is None else requested


def parse_rule(text: str, k_max: int = DEFAULT_K_MAX, draft: str | None = None) -> LengthPolicy:
    """Build a hand-made rule from its CLI spelling (POLICY_HELP less the learned and tuned policies, which
    `policy_spec.parse_policy` adds); `draft` names the drafter a rule that reads its output must match."""
    name, _, arg = text.strip().partition(":")
    try:
        if name == "none" and not arg:
            return NoSpeculation()
        if name == "static":
            k = int(arg)
            if not 0 <= k <= k_max:
                raise SpecPilotError(f"k={k} is outside [0, k_max={k_max}] (raise --k-max to allow it)")
            return StaticK(k)
        if name == "heuristic" and not arg:
            return HeuristicK(k_max)
        if name in ("confidence", "entropy", "transformers-roc", "adaedl"):
            parts = [float(v) for v in arg.split(":")] if arg else []
            limits = {"confidence": (1, 2), "entropy": (1, 2), "transformers-roc": (0, 2), "adaedl": (0, 3)}[name]
            if not limits[0] <= len(parts) <= limits[1]:
                raise ValueError
            k = int(parts.pop()) if len(parts) == limits[1] else k_max
            if not 1 <= k <= k_max:
                raise SpecPilotError(f"k={k} is outside [1, k_max={k_max}] (raise --k-max to allow it)")
            if name == "confidence":
                return ConfidenceStop(parts[0], k)
            if name == "entropy":
                return EntropyStop(parts[0], k)
            if name == "transformers-roc":
                return RocConfidence(*parts, k_max=k)
            return AdaEDL(*parts, k_max=k)
        if name == "bandit-ucb":
            parts = arg.split(":") if arg else []
            if len(parts) > 2:
                raise ValueError
            arms = [int(a) for a in parts[0].split("/")] if parts and parts[0] else (0, 1, 2, 3, 4, 6, 8)
            if max(arms) > k_max:
                raise SpecPilotError(f"bandit arm {max(arms)} is above k_max={k_max}")
            return BanditK(arms, float(parts[1]) if len(parts) > 1 else 0.3, k_max=k_max)
        if name == "match":
            n, _, k = arg.partition(":")
            k = int(k) if k else k_max
            if k > k_max:
                raise SpecPilotError(f"k={k} is outside [1, k_max={k_max}] (raise --k-max to allow it)")
            if draft and not str(draft).startswith("ngram"):
                raise SpecPilotError(f"policy '{text}' reads prompt lookup's n-gram match; draft '{draft}' has none "
                                     "(use --draft ngram)")
            return MatchLengthK(float(n), k)
        if is_hybrid_rule(name):
            if draft and draft != "hybrid":
                raise SpecPilotError(f"policy '{text}' chooses the draft source of --draft hybrid; draft '{draft}' has one")
            return parse_hybrid_rule(name, arg, k_max)
        if name == "sglang-adaptive":
            parts = arg.split(":") if arg else []
            candidates = [int(c) for c in parts[0].split("/")] if parts and parts[0] else (1, 3, 7)
            if max(candidates) > k_max:
                raise SpecPilotError(f"sglang-adaptive candidate {max(candidates)} is above k_max={k_max}")
            return SGLangAdaptiveK(candidates, float(parts[1]) if len(parts) > 1 else 0.2, k_max=k_max)
        if name == "trtllm":
            parts = arg.split(":") if arg else []
            if len(parts) not in (0, 1, 3):
                raise ValueError
            window, threshold = (int(parts[1]), float(parts[2])) if len(parts) == 3 else (0, 0.0)
            entries = [e.partition("=") for e in parts[0].split("/")] if parts and parts[0] else []
            if len(entries) == 1 and not entries[0][1]:  # trtllm:K: no schedule, K at every batch size
                k = int(entries[0][0])
                if not 0 <= k <= k_max:
                    raise SpecPilotError(f"k={k} is outside [0, k_max={k_max}]")
                return TrtllmK(None, window, threshold, k)
            return TrtllmK({int(b): int(k) for b, _, k in entries}, window, threshold, k_max)
    except ValueError:
        pass
    raise SpecPilotError(f"unknown policy '{text}'; expected {POLICY_HELP}")
