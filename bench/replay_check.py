"""The sim-to-real check: does the replay env show a policy what the real loop shows it?

A policy pre-trained on the replay env is only as good as the replay's observations are faithful.
`replay_check` runs the policy on the real loop and on the replay of the same prompts (same batches)
and returns the k it chose in each and how far each observation feature moved between them, in the
policy's own normalised units for a learned policy; and how each real step's seconds compare with the
cost profile's price for it (by k, relative to the plain steps), since the replay's speeds are only as
good as those prices. Greedy acceptance does not depend on the
schedule, so a policy that ignores timing and hardware (static k, the heuristic) chooses the same
k in both; a learned policy should come close, and a feature far apart names the leak.
(`scripts/benchmark.py --replay-check` prints it.)
"""
from __future__ import annotations

import numpy as np

from specpilot.decoding.loop import generate
from specpilot.decoding.observation import FEATURES
from specpilot.decoding.policies import LengthPolicy
from specpilot.decoding.prompts import batches_of
from specpilot.env.replay_env import ReplayEnv, replay_episode
from specpilot.env.sources import step_seconds


class Recorder(LengthPolicy):
    """Wraps a policy and keeps every (observation, k) it was asked for."""

    def __init__(self, policy: LengthPolicy):
        self.policy, self.name, self.k_max = policy, policy.name, policy.k_max
        self.seen: list[tuple[np.ndarray, int]] = []

    @property
    def stop(self):
        """The wrapped policy's stop rule as it stands (a learned or adaptive policy sets it as it decides)."""
        return self.policy.stop

    @property
    def source(self):
        """The wrapped policy's draft source as it stands (a hybrid policy names one per step; None: the draft's default)."""
        return getattr(self.policy, "source", None)

    def reset(self) -> None:
        self.policy.reset()

    def choose_k(self, obs: np.ndarray) -> int:
        k = self.policy.choose_k(obs)
        self.seen.append((np.array(obs, dtype=np.float64), k))
        return k

    def update(self, step) -> None:
        self.policy.update(step)


def replay_check(target, draft, policy: LengthPolicy, prompt_ids: list[list[int]], traces, cost, batch_size: int,
                 max_new_tokens: int, k_max: int, hardware=None) -> dict:
    """`traces[i]` must be the recorded trace of `prompt_ids[i]`. Returns {"real_k", "replay_k"}: how
    often each k was chosen; "k_distance": total variation distance between the two (0 = the same
    choices as often, 1 = disjoint); "features": per feature (real mean, replay mean, shift in
    standard deviations: the policy's training ones for a learned policy, else the pooled ones)."""
    groups = batches_of(len(prompt_ids), batch_size)
    real = Recorder(policy)
    generate(target, draft, real, [prompt_ids[i] for i in groups[0]], 4)  # warm-up, not recorded
    real.seen.clear()
    steps, prices = [], []
    for group in groups:
        out = generate(target, draft if policy.k_max > 0 else None, real, [prompt_ids[i] for i in group], max_new_tokens)
        steps.extend(out.steps)
        prices.extend(step_prices(out.steps, cost, traces[group[0]] if len(group) == 1 else None))
    replay = Recorder(policy)
    env = ReplayEnv(traces, cost, k_max=k_max, noise=0.0, hardware=hardware, batch_sizes=[batch_size],
                    max_new_tokens=max_new_tokens)
    for group in groups:
        replay_episode(env, replay, group)
    hist = {name: np.bincount([k for _, k in rec.seen], minlength=k_max + 1)
            for name, rec in (("real", real), ("replay", replay))}
    real_obs = np.array([o for o, _ in real.seen])
    replay_obs = np.array([o for o, _ in replay.seen])
    if hasattr(policy, "feature_scale"):  # a learned policy: its own normalisation (pinned or unread features: 0)
        scale = policy.feature_scale()
    else:
        std = np.concatenate([real_obs, replay_obs]).std(axis=0)
        scale = np.where(std > 0, 1.0 / np.where(std > 0, std, 1.0), 0.0)
    shift = (real_obs.mean(axis=0) - replay_obs.mean(axis=0)) * scale
    p, q = hist["real"] / hist["real"].sum(), hist["replay"] / hist["replay"].sum()
    return {
        "batch_size": batch_size,
        "real_k": hist["real"].tolist(),
        "replay_k": hist["replay"].tolist(),
        "k_distance": float(0.5 * np.abs(p - q).sum()),
        "costs": step_cost_check(steps, cost, prices),
        "features": {name: [float(a), float(b), float(z)]
                     for name, a, b, z in zip(FEATURES, real_obs.mean(axis=0), replay_obs.mean(axis=0), shift)},
    }


def step_prices(steps, cost, trace=None) -> list[float]:
    """The replay's price of each step of one generation: the profile's (its k, context length and batch size), and
    for one row of a hybrid draft with its trace (`trace`), re-priced by the step's source as the replay env prices
    it (env.sources: lookup tokens free, an extension's copied tokens at ADVANCE_SHARE of a head token)."""
    prices, position = [], 0
    for s in steps:
        table, per_token = cost.step_costs(s.context_len, s.batch_size)
        if trace is not None and trace.sources and s.k:
            prices.append(step_seconds(table, per_token, trace, s.source, position, s.k))
        else:
            prices.append(float(table[s.k]))
        position += len(s.new_tokens)
    return prices


def step_cost_check(steps, cost, prices: list[float] | None = None) -> dict:
    """Real step seconds against the replay's price of the same step (`prices`, default `step_prices` without a
    trace). Absolute speed drifts between machines and hours, so prices are scaled by the plain (k = 0)
    steps' real / priced ratio (every step's when none was plain): "by_k" maps each k to [steps,
    real mean seconds, priced mean seconds, (real / priced) / scale], "by_source" each drafting source (a hybrid's:
    lookup, head, extend) likewise; "real_over_priced" is the whole run's (real / priced) / scale, the factor by
    which the replay under-prices this policy's steps."""
    real = np.array([s.draft_s + s.verify_s for s in steps], dtype=np.float64)
    priced = np.array(prices if prices is not None else step_prices(steps, cost), dtype=np.float64)
    ks = np.array([s.k for s in steps])
    plain = ks == 0
    base = plain if plain.any() else np.ones_like(plain)
    scale = real[base].sum() / priced[base].sum()

    def cell(mask) -> list:
        return [int(mask.sum()), float(real[mask].mean()), float(priced[mask].mean()),
                float(real[mask].sum() / priced[mask].sum() / scale)]

    by_k = {int(k): cell(ks == k) for k in np.unique(ks)}
    sources = np.array([(getattr(s, "source", None) or "") if s.k else "" for s in steps])
    by_source = {str(x): cell(sources == x) for x in np.unique(sources) if x}
    return {"scale": float(scale), "by_k": by_k, "by_source": by_source,
            "real_over_priced": float(real.sum() / priced.sum() / scale)}


def format_check(name: str, result: dict, top: int = 3) -> str:
    """One line: the k histograms, their distance, and the features that moved most."""
    moved = sorted(result["features"].items(), key=lambda kv: -abs(kv[1][2]))[:top]
    features = ", ".join(f"{f} {z:+.2f}" for f, (_, _, z) in moved)
    return (f"{name:<16}B={result['batch_size']:<3} real k {result['real_k']}  replay k {result['replay_k']}  "
            f"distance {result['k_distance']:.2f}  most moved (sd): {features}\n"
            f"{'':<16}step seconds / profile price, relative to plain steps: whole run "
            f"{result['costs']['real_over_priced']:.3f}; by k " + ", ".join(
                f"{k}: {r:.2f} (n={n})" for k, (n, _, _, r) in result["costs"]["by_k"].items())
            + "".join("; by source " + ", ".join(f"{x}: {r:.2f} (n={n})" for x, (n, _, _, r) in by_source.items())
                      for by_source in [result["costs"].get("by_source") or {}] if by_source))


SPEED_TOLERANCE = 1.33
"""How far (either way) this machine's plain step may sit from the cost profile's price before a warning says so:
more than the profile's own cell noise (10-14%) and a run's drift, less than the 1.5-2x between machines of a key."""


def plain_speed_ratio(runs, prompt_lens: dict[str, int], cost) -> float | None:
    """Median over the one-row, unloaded plain-decoding runs (policy `none`) of their seconds per step over the cost
    profile's price of a plain step at that prompt's context (mid-answer); None without such runs."""
    ratios = []
    for r in runs:
        if r.policy == "none" and r.batch_size == 1 and r.steps and getattr(r, "load", "none") == "none":
            context = prompt_lens.get(r.question_ids[0], 0) + r.new_tokens // 2
            ratios.append((r.seconds / r.steps) / float(cost.step_costs(context, 1)[0][0]))
    return float(np.median(ratios)) if ratios else None


def machine_speed_warning(ratio: float | None, profile_name: str) -> str | None:
    """One warning line when this machine's plain step is outside SPEED_TOLERANCE of the profile's (None if not)."""
    if ratio is None or 1 / SPEED_TOLERANCE <= ratio <= SPEED_TOLERANCE:
        return None
    return (f"plain decoding here takes {ratio:.2f}x the time the cost profile {profile_name} prices it at: the replay, "
            "the tuned rules and the learned policy price another machine's steps (profile this one: "
            "python scripts/profile_device.py --device cpu, then tune_rules.py and train_policy.py)")
