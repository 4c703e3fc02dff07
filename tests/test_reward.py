"""The reward is exact: an episode's return is the time saved against plain decoding of the same rows
to the same ends, checked against a brute-force simulation of plain decoding."""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from specpilot.decoding.loop import RowView
from specpilot.env.episode import PlainCredit, step_reward


@dataclass
class Row(RowView):  # what the credit reads of a row: prompt_len, length, context_offset / context_len
    prompt_len: int
    length: int


@dataclass
class State:
    rows: list[Row]
    active: list[int]

    @property
    def active_rows(self):
        return [self.rows[i] for i in self.active]


def brute_plain_seconds(prompt_lens, ends, plain_step) -> float:
    """Plain decoding simulated step by step, as the loop runs it: the rows left-padded to the longest
    prompt, every running row gains one token and the cache one slot per step; a row stops at its end
    (and leaves the batch, not the cache's width)."""
    lengths, seconds, width = list(prompt_lens), 0.0, max(prompt_lens)
    running = [i for i, e in enumerate(ends) if e > 0]
    while running:
        seconds += plain_step(width, len(running))
        width += 1
        for i in running:
            lengths[i] += 1
        running = [i for i in running if lengths[i] - prompt_lens[i] < ends[i]]
    return seconds


def run_episode(prompt_lens, ends, schedule, plain_step, step_seconds):
    """Drive PlainCredit through a policy's steps: `schedule(t, state)` -> tokens each active row gains
    (capped at its end); a row whose end is reached leaves the batch. Returns (return, policy seconds)."""
    state = State([Row(p, p) for p in prompt_lens], list(range(len(prompt_lens))))
    credit = PlainCredit(plain_step)
    credit.reset(state)
    total, seconds, t = 0.0, 0.0, 0
    while state.active:
        gains = schedule(t, state)
        for i, g in zip(list(state.active), gains):
            row = state.rows[i]
            row.length = min(row.length + g, row.prompt_len + ends[i])
        state.active = [i for i in state.active if state.rows[i].length - state.rows[i].prompt_len < ends[i]]
        s = step_seconds(t)
        total += step_reward(credit.take(state) / credit.unit, s, credit.unit)
        seconds += s
        t += 1
    return total, seconds, credit


def flat(context, rows):
    return 0.1


def context_and_batch(context, rows):
    """A step's cost grows with the context (KV reads) and the batch."""
    return 0.05 + 0.001 * context + 0.02 * rows


def test_eos_before_the_budget_plain_schedule_returns_zero():
    """One row, budget 10, EOS after 6 tokens, k = 0 every step, flat 0.1 s steps: the return is 0.
    (Crediting the unused budget at the EOS step gave +4.)"""
    total, seconds, _ = run_episode([5], [6], lambda t, s: [1], flat, lambda t: 0.1)
    assert seconds == pytest.approx(0.6)
    assert total == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("cost", [flat, context_and_batch])
def test_return_is_plain_time_minus_policy_time_on_random_batches(cost):
    rng = random.Random(0)
    for trial in range(200):
        b = rng.randint(1, 5)
        prompts = [rng.randint(3, 40) for _ in range(b)]
        ends = [rng.randint(1, 12) for _ in range(b)]  # EOS anywhere, rows ending at different times
        gains = lambda t, s: [rng.randint(1, 4) for _ in s.active]  # noqa: E731 (rows accept different counts)
        step_s = lambda t: 0.07 + 0.01 * (t % 3)  # noqa: E731
        total, seconds, credit = run_episode(prompts, ends, gains, cost, step_s)
        plain = brute_plain_seconds(prompts, ends, cost)
        assert total == pytest.approx((plain - seconds) / credit.unit, abs=1e-9), trial
        assert credit.batch_seconds(ends) == pytest.approx(plain, abs=1e-12)


def test_credit_waits_for_the_row_behind():
    """Advancing only the row ahead completes no plain step, so it earns nothing yet."""
    state = State([Row(4, 4), Row(4, 4)], [0, 1])
    credit = PlainCredit(context_and_batch)
    credit.reset(state)
    state.rows[0].length += 3
    assert credit.take(state) == 0.0
    state.rows[1].length += 2  # now both have >= 2 tokens: plain steps 1 and 2 are complete
    assert credit.take(state) == pytest.approx(context_and_batch(4, 2) + context_and_batch(5, 2))


class BudgetCredit(PlainCredit):
    """The reward before the fix: a potential over the rows' unused budget (budget - generated), which
    drops to 0 when a row ends at EOS and so credits the unused budget as time saved."""

    budget = 12

    def reset(self, state) -> None:
        super().reset(state)
        self.left = self._left(state)

    def _left(self, state) -> float:
        return sum(self.budget - (r.length - r.prompt_len) for r in state.active_rows) * self.plain_step(0, 1)

    def take(self, state) -> float:
        left = self._left(state)
        saved, self.left = self.left - left, left
        return saved


def test_the_brute_force_check_catches_the_budget_credit(monkeypatch):
    """Negative control: the same harness, with the old budget-based credit, misses the brute force by
    the unused budget (one row, EOS after 6 of 12 tokens, plain schedule: +6 instead of 0)."""
    monkeypatch.setattr(__import__(__name__), "PlainCredit", BudgetCredit)
    total, seconds, _ = run_episode([5], [6], lambda t, s: [1], flat, lambda t: 0.1)
    assert total == pytest.approx(6.0)
    assert abs(total - (brute_plain_seconds([5], [6], flat) - seconds) / 0.1) > 1.0
