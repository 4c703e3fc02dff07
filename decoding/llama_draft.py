"""The controller inside llama-cpp-python's own speculation: `Llama(..., draft_model=SpecPilotDraftModel(policy))`.

llama-cpp-python calls its draft model once per round with the whole sequence so far (`input_ids`) and verifies
whatever it returns (sample-and-match at every drafted position). It never says how many drafted tokens it kept;
this model reads it from the next call: the sequence grew by the kept tokens plus the target's one. From that it
keeps the loop's running statistics (decoding/observation.py), so a length policy (a tuned rule or a learned one,
decoding/policy_spec.py) chooses k each round exactly as in the loop, and a drafter of the loop (prompt lookup by
default) proposes the tokens. The verify's seconds are the time between two calls less the drafting.

For the project's own loop over llama.cpp (the Gymnasium env, traces, cost profiles): decoding/llama_cpp.py.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from .drafters import NgramDrafter
from .loop import DecodeState, Row, StepResult
from .observation import ObservationBuilder
from .sampling import Sampling

CHECK_TAIL = 16
"""A call continues the previous sequence when its tokens before the new ones end as the previous call's did."""


class RoundLog:
    """(k, kept) of each round of llama-cpp-python's speculation, read off the next call: the sequence grew by the
    kept drafted tokens plus the target's one. A call that does not continue the last one starts a new sequence."""

    def __init__(self) -> None:
        self.rounds: list[tuple[int, int]] = []
        self._last: tuple[int, int, np.ndarray] | None = None  # (length, k drafted, its last tokens)

    def observe(self, ids: np.ndarray) -> int | None:
        """The tokens the previous round kept, or None where `ids` starts a new sequence (the rounds restart)."""
        if self._last is not None:
            length, k, tail = self._last
            kept = len(ids) - length - 1
            if 0 <= kept <= k and np.array_equal(ids[length - len(tail):length], tail):
                self.rounds.append((k, kept))
                return kept
        self.rounds = []
        return None

    def proposed(self, ids: np.ndarray, k: int) -> None:
        """This call's sequence and the k tokens it drafts."""
        self._last = (len(ids), k, np.array(ids[-CHECK_TAIL:]))


class CountingLookup:
    """llama-cpp-python's own `LlamaPromptLookupDecoding`, its rounds logged (`log.rounds`): the benchmark's
    `engine-lookup:N` row (decoding/llama_cpp.py EngineDecoding)."""

    def __init__(self, num_pred_tokens: int = 10, max_ngram_size: int = 2):
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.lookup = LlamaPromptLookupDecoding(max_ngram_size=max_ngram_size, num_pred_tokens=num_pred_tokens)
        self.log = RoundLog()

    def __call__(self, input_ids: np.ndarray, /, **kwargs) -> np.ndarray:
        self.log.observe(input_ids)
        out = self.lookup(input_ids, **kwargs)
        self.log.proposed(input_ids, len(out))
        return out


class SpecPilotDraftModel:
    """A llama-cpp-python draft model (duck-typed `LlamaDraftModel`) whose k comes from a specpilot length policy.

    `policy`: a LengthPolicy (`choose_k(obs)`, `update(step)`), e.g. `parse_policy("best-rule", target=...)` or
    `LearnedK.load(...)`; `drafter`: the loop's drafter (default prompt lookup, `NgramDrafter(3)`); `max_new_tokens`:
    the budget the observation's `remaining_frac` reads (the engine does not tell it; past it, it doubles)."""

    def __init__(self, policy, drafter=None, max_new_tokens: int = 256, observer: ObservationBuilder | None = None):
        self.policy = policy
        self.drafter = drafter if drafter is not None else NgramDrafter(3)
        self.max_new_tokens = max_new_tokens
        self.observer = observer or ObservationBuilder(k_max=policy.k_max)
        self.state: DecodeState | None = None
        self.log = RoundLog()
        """(k, kept) of every round of the current sequence whose outcome is known: `log.rounds`."""
        self._pending: tuple[int, list, float, float] | None = None  # k asked, confidences, draft_s, when returned

    def _start(self, ids: np.ndarray) -> None:
        """A new sequence: the prompt is all but the token the engine just sampled."""
        buffer = torch.from_numpy(ids.astype(np.int64))
        row = Row(buffer, len(ids), len(ids) - 1, self.max_new_tokens)
        self.state = DecodeState(target=None, draft=self.drafter, sampling=Sampling(), rows=[row], cache=None,
                                 generator=None, active=[0])
        self.policy.reset()
        self.observer.reset(self.state)
        self.drafter.reset(buffer)
        self._pending = None

    def __call__(self, input_ids: np.ndarray, /, **kwargs) -> np.ndarray:
        now = time.perf_counter()
        ids = np.asarray(input_ids)
        kept = self.log.observe(ids)
        if kept is None:
            self._start(ids)
        else:
            row = self.state.rows[0]
            asked, confidences, draft_s, returned = self._pending
            k = self.log.rounds[-1][0]
            step = StepResult(k=k, k_requested=asked, accepted=kept, new_tokens=ids[row.length:].tolist(),
                              draft_s=draft_s, verify_s=now - returned, confidences=confidences[:k],
                              context_len=row.length)
            row.rebind(torch.from_numpy(ids.astype(np.int64)))
            row.length = len(ids)
            while row.remaining <= 0:
                row.max_new_tokens *= 2
            self.policy.update(step)
            self.observer.push(step)
        row = self.state.rows[0]
        asked = int(self.policy.choose_k(self.observer.build(self.state)))
        t0 = time.perf_counter()
        draft = self.drafter.propose(row.context, asked, self.state.sampling, None, stop=self.policy.stop) \
            if asked > 0 else None
        tokens = draft.tokens.cpu().numpy().astype(np.intc) if draft is not None else np.empty(0, dtype=np.intc)
        done = time.perf_counter()
        self._pending = (asked, list(draft.confidences) if draft is not None else [], done - t0, done)
        self.log.proposed(ids, len(tokens))
        return tokens
