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
"""A call continues the previous sequence when its first tokens end as the previous call's did (the last 16)."""


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
        self.rounds: list[tuple[int, int]] = []
        """(k, accepted) of every round of the current sequence whose outcome is known."""
        self._pending: tuple[int, int, list, float, float] | None = None  # k asked, k drafted, confidences, draft_s, t

    def _start(self, ids: np.ndarray) -> None:
        """A new sequence: the prompt is all but the token the engine just sampled."""
        buffer = torch.from_numpy(ids.astype(np.int64))
        row = Row(buffer, len(ids), len(ids) - 1, self.max_new_tokens)
        self.state = DecodeState(target=None, draft=self.drafter, sampling=Sampling(), rows=[row], cache=None,
                                 generator=None, active=[0])
        self.policy.reset()
        self.observer.reset(self.state)
        self.drafter.reset(buffer)
        self.rounds, self._pending = [], None

    def _continues(self, ids: np.ndarray) -> bool:
        if self.state is None or self._pending is None:
            return False
        row = self.state.rows[0]
        kept = len(ids) - row.length - 1
        at = max(0, row.length - CHECK_TAIL)
        return 0 <= kept <= self._pending[1] and np.array_equal(ids[at:row.length], row.buffer[at:row.length].numpy())

    def __call__(self, input_ids: np.ndarray, /, **kwargs) -> np.ndarray:
        now = time.perf_counter()
        ids = np.asarray(input_ids)
        if not self._continues(ids):
            self._start(ids)
        else:
            row = self.state.rows[0]
            asked, k, confidences, draft_s, returned = self._pending
            kept = len(ids) - row.length - 1
            new = ids[row.length:].tolist()
            step = StepResult(k=k, k_requested=asked, accepted=kept, new_tokens=new, draft_s=draft_s,
                              verify_s=now - returned, confidences=confidences[:k], context_len=row.length)
            row.buffer = torch.from_numpy(ids.astype(np.int64))
            row.length = len(ids)
            while row.remaining <= 0:
                row.max_new_tokens *= 2
            self.policy.update(step)
            self.observer.push(step)
            self.rounds.append((k, kept))
        row = self.state.rows[0]
        asked = int(self.policy.choose_k(self.observer.build(self.state)))
        t0 = time.perf_counter()
        draft = self.drafter.propose(row.context, asked, self.state.sampling, None, stop=self.policy.stop) \
            if asked > 0 else None
        tokens = draft.tokens.cpu().numpy().astype(np.intc) if draft is not None else np.empty(0, dtype=np.intc)
        done = time.perf_counter()
        self._pending = (asked, len(tokens), list(draft.confidences) if draft is not None else [], done - t0, done)
        return tokens
