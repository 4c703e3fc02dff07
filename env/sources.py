"""The hybrid drafter's traces (`--draft hybrid`): every source's proposal at every position, priced exactly.

With greedy decoding the target's output is fixed whatever is drafted, and each source's proposal at position i
depends only on the prefix: the lookup's continuation of the latest n-gram match, the head's tokens from the
target's hidden state, the extension (the lookup's tokens, then the head's from its state advanced through them).
`record_trace` with a `HybridDrafter` records the three at every position (`Trace.sources`); a step from i that
drafts k tokens from source s then keeps min(k', m_s(i)) + 1 tokens, k' = min(k, a_s(i)), whatever came before.

What a step costs depends on the source, since the verify pass is the same for all (the target with its hidden
states, the head's cost profile) but drafting is not: a lookup token is free (a search the observation made
already), a head token costs the profile's draft seconds per token, an extension's copied tokens cost
`ADVANCE_SHARE` of one (the head reads them, without its output projection) and its own tokens one each; an
extension the lookup fills alone is the lookup's own draft (the head does not run).
The oracle over sources is the dynamic program
    T(i) = min_{s, k} [ t_s(k', i) + T(i + min(k', m_s(i)) + 1) ],   T(n) = 0,
a bound no causal choice of source and length can beat on these traces.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.hybrid import SOURCES

from .oracle import CostModel, Trace

ADVANCE_SHARE = 0.59
"""What advancing the head through one copied token costs, as a share of drafting one head token (the head's
recurrent step without the projection on the sub-vocabulary; decoding/hybrid.py `_extend`). Measured: median 0.59
over 12 train prompts on cpu-intel-xeon-2c, 0.57-0.63 each (`python -m specpilot.bench.advance_share --device cpu`,
reports/hybrid-runs/advance-share); the hybrid rules and policy committed before it were priced at 0.5."""


@dataclass
class SourceView:
    """One source's proposals along a trace: m(i), a(i), and the per-token confidences and entropies."""

    matches: list[int]
    available: list[int]
    confidences: list[list[float]]
    entropies: list[list[float]]


def has_sources(trace: Trace) -> bool:
    """Whether the trace is a hybrid drafter's (each source's proposals recorded)."""
    return bool(trace.sources)


def source_view(trace: Trace, source: str | None) -> SourceView:
    """The proposals of `source` along the trace: the trace's own fields for the lookup (and for any trace that is
    not a hybrid's, whatever the source), `Trace.sources[source]` for the head and the extension. `None`: the
    hybrid's default source (`extend`)."""
    if not trace.sources:
        return SourceView(trace.matches, trace.available, trace.confidences, trace.entropies)
    source = source or "extend"
    if source == "lookup":
        return SourceView(trace.matches, trace.available, trace.confidences, trace.entropies)
    if source not in trace.sources:
        raise SpecPilotError(f"trace {trace.question_id} has no proposals of source '{source}' "
                             f"(it holds lookup, {', '.join(trace.sources)})")
    rows = trace.sources[source]
    return SourceView(rows["matches"], rows["available"], rows["confidences"], rows["entropies"])


def head_tokens(trace: Trace | None, source: str | None, i: int, drafted: int) -> float:
    """Head-token equivalents of drafting `drafted` tokens from `source` at position i: what the step's drafting
    costs in the profile's draft seconds per token (lookup 0; head `drafted`; extension its copied tokens at
    `ADVANCE_SHARE` and the rest at 1, all copied: 0, the lookup's own draft). A trace that is not a hybrid's: `drafted` (its draft's own price)."""
    if trace is None or not trace.sources:
        return float(drafted)
    source = source or "extend"
    if source == "lookup":
        return 0.0
    if source == "head":
        return float(drafted)
    copied = min(drafted, trace.available[i])
    if copied == drafted:  # the lookup filled the draft alone: no head token, no advance (decoding/hybrid.py `_extend`)
        return 0.0
    return ADVANCE_SHARE * copied + (drafted - copied)


def step_seconds(table: np.ndarray, draft_per_token: float, trace: Trace | None, source: str | None, i: int,
                 drafted: int) -> float:
    """One row's step seconds from the profile's table (verify + drafted x draft seconds per token), re-priced for
    the source's drafting (`head_tokens`)."""
    return float(table[drafted] - draft_per_token * (drafted - head_tokens(trace, source, i, drafted)))


def oracle_over_sources(trace: Trace, cost: CostModel, k_max: int, sources=SOURCES,
                        budget: int | None = None) -> tuple[float, list[tuple[str, int]]]:
    """(minimum seconds of the trace at one row, the (source, k) of each step on the optimal path) over `sources`
    (module docstring); with one source, that source's oracle (`oracle.oracle_schedule` on its view)."""
    views = {s: source_view(trace, s) for s in sources}
    n = len(trace.output_ids)
    end = n if budget is None else min(budget, n)
    n_prompt = len(trace.prompt_ids)
    best = np.zeros(end + 1)
    choice: list[tuple[str, int]] = [("lookup", 0)] * end
    for i in range(end - 1, -1, -1):
        table, per_token = cost.step_costs(n_prompt + i)
        best[i] = np.inf
        for s, view in views.items():
            for k in range(k_max + 1):
                drafted = max(0, min(k, view.available[i], end - i - 1))
                if drafted < k and k > 0:
                    continue  # the same step as a smaller k
                value = step_seconds(table, per_token, trace, s, i, drafted) + best[min(end, i + min(drafted, view.matches[i]) + 1)]
                if value < best[i] - 1e-15:
                    best[i], choice[i] = value, (s, drafted)
    path, i = [], 0
    while i < end:
        s, k = choice[i]
        path.append((s, k))
        i += min(k, views[s].matches[i]) + 1
    return (float(best[0]) if end else 0.0), path


def source_counts(path: list[tuple[str, int]]) -> dict[str, int]:
    """How many steps of a path draft from each source (k = 0: 'plain')."""
    counts: dict[str, int] = {}
    for s, k in path:
        key = s if k else "plain"
        counts[key] = counts.get(key, 0) + 1
    return counts


class SourceOracleK:
    """Replays the oracle over sources (`oracle_over_sources`) for prompts whose hybrid traces were recorded: per
    position the (source, k) of the optimal path (replay and benchmarks only; a `LengthPolicy` by its methods)."""

    stop = None

    def __init__(self, traces: list[Trace], cost: CostModel, k_max: int, max_new_tokens: int | None = None,
                 sources=SOURCES):
        self.k_max = k_max
        self.name = "oracle" if tuple(sources) == SOURCES else "oracle:" + "/".join(sources)
        self.schedules: dict[str, dict[int, tuple[str, int]]] = {}
        for t in traces:
            _, path = oracle_over_sources(t, cost, k_max, sources, budget=max_new_tokens)
            at, i = {}, 0
            for s, k in path:
                at[i] = (s, k)
                i += min(k, source_view(t, s).matches[i]) + 1
            self.schedules[t.question_id] = at
        self.schedule: dict[int, tuple[str, int]] = {}
        self.position = 0
        self.source: str | None = None

    def prepare(self, question_id: str) -> None:
        if question_id not in self.schedules:
            raise SpecPilotError(f"oracle-sources: no hybrid trace recorded for prompt '{question_id}'")
        self.schedule = self.schedules[question_id]

    def reset(self) -> None:
        self.position = 0

    def choose_k(self, obs) -> int:
        self.source, k = self.schedule.get(self.position, ("lookup", 0))
        return k

    def update(self, step) -> None:
        self.position += len(step.new_tokens)
