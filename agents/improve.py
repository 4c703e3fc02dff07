"""Rollout policy improvement on the replay env: the warm start that PPO then fine-tunes.

Approximate policy iteration (Bertsekas' rollout; Lagoudakis & Parr's classification-based API). From
every state a base policy visits in the noise-free replay env, each k = 0..k_max is tried once and the
base policy finishes the episode from there: Q(s, k) = the seconds the batch still needs. The improved
policy takes argmin_k Q(s, k), which is at least as fast as the base policy from every state (one step
of policy improvement, exact on the traces because the replay is deterministic). An MLP over the
observation learns it by minimising its expected regret, sum_k softmax(z)_k * (Q(s, k) - min_k Q(s, k))
in plain steps of the batch, so that states where the choice matters weigh more than states where any
k will do. The fitted policy becomes the next base policy (`rounds`).

The base policy of the first round is the best engine rule tuned on the train split
(`scripts/tune_rules.py`), so the learned policy starts from the rule it must beat, not from scratch.
"""
from __future__ import annotations

import copy
import multiprocessing
import os
import sys
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.learned import LearnedK, pinned_mask
from specpilot.decoding.policies import ActionTable, LengthPolicy
from specpilot.decoding.prompts import batches_of
from specpilot.env.oracle import CostModel, Trace, hindsight_q
from specpilot.env.replay_env import MachineCondition, ReplayEnv, stop_depth


ENTROPY = 0.02
"""Weight of the fit's entropy bonus, in plain steps of regret (see `fit`)."""


@dataclass
class Dataset:
    obs: np.ndarray
    """(n, features) observations of the visited states."""
    regret: np.ndarray
    """(n, actions): Q(s, a) - min_a Q(s, a), in plain steps of the episode's batch (an action is k, or with stop
    levels a (k, stop level) pair: `decoding.policies.ActionTable`)."""
    batch: np.ndarray
    """(n,) the batch size of each state's episode."""


def _rollout_seconds(env: ReplayEnv, policy: LengthPolicy, action: int, memo: dict) -> float:
    """Seconds to finish the episode from `env`'s state: one step with this action, then `policy` (with its own
    stop rule; copies: the originals are untouched)."""
    env, policy = copy.deepcopy(env, dict(memo)), copy.deepcopy(policy)
    _, _, done, _, info = env.step(action)
    policy.update(env.last_step)
    seconds = info["seconds"]
    while not done:
        k = policy.choose_k(env.observer.build(env.state))
        env.stop, env.source = policy.stop, getattr(policy, "source", None)
        _, _, done, _, info = env.step(k)
        policy.update(env.last_step)
        seconds += info["seconds"]
    return seconds


def hindsight_actions(q: np.ndarray, env: ReplayEnv) -> np.ndarray:
    """Q*(s, a) for each action of the env's table from the oracle's Q*(s, k) of its one row (`hindsight_q`): an
    action's k, cut where its stop level stops the draft (`stop_depth`, from the row's trace), plus the draft step it
    ran before stopping, as the replay env prices it."""
    row = env.state.rows[0]
    at = (row.trace, row.length - row.prompt_len)
    per_token = env.cost.step_costs(row.context_offset + row.prompt_len + at[1])[1]
    out = np.empty(len(env.actions))
    for a in range(len(env.actions)):
        k, stop = env.actions.decode(a)
        n, stopped = stop_depth(stop, [at], k) if stop is not None and k else (k, False)
        out[a] = q[n] + (per_token if stopped else 0.0)
    return out


def collect(base: LengthPolicy, traces: list[Trace], cost: CostModel, k_max: int, hardware, batch_sizes: list[int],
            episodes: dict[int, int], max_new_tokens: int, seed: int = 0, progress: bool = True,
            follow: LengthPolicy | None = None, context_lens: list[int] = (),
            conditions: list[MachineCondition] = (), hardware_noise: float = 0.0, cost_jitter: float = 0.0,
            workers: int = 1, labels: str = "rollout", stop_levels=(0.0,), sources=(None,)) -> Dataset:
    """Q-regret labels (rollouts of `base`) on the states that `follow` visits (None: the improved policy,
    argmin Q): for each batch size b, `episodes[b]` episodes (one row: every trace once, in order, when
    episodes >= the traces); with `context_lens` (simulated long contexts) the episodes cycle through them,
    and with `conditions` (machine conditions: cost model + counters) through those, every context under each
    (episode j: context j mod C, condition j div C mod N), the counters read off by `hardware_noise`; with
    `cost_jitter` each episode's cost curve is perturbed (ReplayEnv), its rollouts priced under that curve.
    `workers` processes label the episodes (0 = one per CPU core); the labels are the same for any number.
    `labels="oracle"`: one-row episodes are labelled with the oracle's hindsight Q* (env.oracle.hindsight_q: k now,
    then the optimal schedule, which knows what will be accepted; behaviour cloning of the oracle, cost-weighted)
    instead of rollouts of `base`; batch episodes keep rollouts (the oracle is per sequence). With `stop_levels`
    the labels cover every (k, stop level) action (`decoding.policies.ActionTable`), with `sources` (a hybrid
    drafter's traces) every (source, k, stop level) one."""
    rng = np.random.default_rng(seed)
    obs, regret, batch = [], [], []
    plan = []
    # the traces in a seeded order: fewer episodes than traces must not all come from the head of the file
    # (where a prompt set's original prompts sit, before the prompts added later: long contexts, synthetic)
    order = [int(i) for i in rng.permutation(len(traces))]
    for b in batch_sizes:
        n = episodes.get(b, 0)
        if b == 1 and n >= len(traces):
            plan += [(1, [i]) for i in range(len(traces))]
        elif n:
            groups = [[order[i] for i in group] for group in batches_of(len(traces), b)]
            plan += [(b, [int(i) for i in rng.permutation(len(traces))[:b]]) if j >= len(groups) else (b, groups[j])
                     for j in range(n)]
    if labels not in ("rollout", "oracle"):
        raise SpecPilotError(f"warm-start labels are 'rollout' or 'oracle', got '{labels}'")
    if labels == "oracle" and tuple(sources) != (None,):
        raise SpecPilotError("warm-start labels 'oracle' price k alone; a hybrid drafter's actions need 'rollout'")
    shared = (base, follow, traces, cost, k_max, hardware, max_new_tokens, context_lens, conditions, hardware_noise,
              cost_jitter, seed, labels, tuple(stop_levels), tuple(sources))
    tasks = [(j, b, indices) for j, (b, indices) in enumerate(plan)]
    workers = max(1, min(workers or os.cpu_count() or 1, len(tasks)))
    bar = tqdm(total=len(plan), desc="rollout labels", disable=not progress, file=sys.stderr)
    if workers == 1:
        _start_worker(*shared)
        labelled = map(_label_episode, tasks)
    else:  # episodes are independent and seeded by their index: the same labels in any process, in plan order
        pool = multiprocessing.get_context("spawn").Pool(workers, _start_worker, shared)
        labelled = pool.imap(_label_episode, tasks)
    try:
        for o, r, b in labelled:
            obs += o
            regret += r
            batch += b
            bar.update()
    finally:
        if workers > 1:
            pool.terminate()
        _WORKER.clear()
    bar.close()
    return Dataset(np.asarray(obs, dtype=np.float32), np.asarray(regret, dtype=np.float32), np.asarray(batch))


_WORKER: dict = {}
"""What every episode of one `collect` shares, set once per process (`_start_worker`)."""


def _start_worker(base, follow, traces, cost, k_max, hardware, max_new_tokens, context_lens, conditions,
                  hardware_noise, cost_jitter, seed, labels, stop_levels, sources=(None,)) -> None:
    _WORKER.update(base=base, follow=follow, traces=traces, cost=cost, k_max=k_max, hardware=hardware,
                   max_new_tokens=max_new_tokens, context_lens=context_lens, conditions=conditions,
                   hardware_noise=hardware_noise, cost_jitter=cost_jitter, seed=seed, labels=labels,
                   stop_levels=stop_levels, sources=sources)


def _label_episode(task: tuple[int, int, list[int]]) -> tuple[list, list, list]:
    """(observations, regrets, batch sizes) of episode j of the plan: batch size b, these traces."""
    j, b, indices = task
    w = _WORKER
    base, follow, traces, k_max, context_lens, conditions = (w[x] for x in ("base", "follow", "traces", "k_max",
                                                                            "context_lens", "conditions"))
    condition = conditions[(j // max(1, len(context_lens))) % len(conditions)] if conditions else None
    env = ReplayEnv(traces, condition.cost if condition else w["cost"], k_max=k_max, noise=0.0,
                    hardware=condition.hardware if condition else w["hardware"], batch_sizes=[b],
                    max_new_tokens=w["max_new_tokens"], hardware_noise=w["hardware_noise"], cost_jitter=w["cost_jitter"],
                    stop_levels=w["stop_levels"], sources=w["sources"])
    memo = {id(t): t for t in traces} | {id(traces): traces, id(env.cost): env.cost}
    context = context_lens[j % len(context_lens)] if context_lens else 0
    o, _ = env.reset(seed=w["seed"] * 100003 + j, options={"trace_indices": indices, "context_len": context})
    base.reset()
    if follow is not None:
        follow.reset()
    obs, regret, batch = [], [], []
    hindsight = None
    if w["labels"] == "oracle" and b == 1:  # one row: the oracle's Q* from every position, no rollouts
        row = env.state.rows[0]
        hindsight = hindsight_q(row.trace, env.cost, k_max, w["max_new_tokens"], row.context_offset, env.shape)
    done = False
    while not done:
        if hindsight is not None:
            q = hindsight_actions(hindsight[env.state.rows[0].length - env.state.rows[0].prompt_len], env)
        else:
            rolled: dict[tuple, float] = {}  # actions that draft alike from one source step alike: one rollout each
            q = np.array([rolled[e] if (e := (*env.draft_length(a)[1:], env.actions.source(a))) in rolled else
                          rolled.setdefault(e, _rollout_seconds(env, base, a, memo)) for a in range(len(env.actions))])
        obs.append(o)
        regret.append((q - q.min()) / env.credit.unit)
        batch.append(b)
        if follow is None:
            action = int(np.argmin(q))
        else:
            action = follow.choose_k(o)
            env.stop, env.source = follow.stop, getattr(follow, "source", None)
        o, _, done, _, _ = env.step(action)
        env.stop = env.source = None
        base.update(env.last_step)
        if follow is not None and follow is not base:
            follow.update(env.last_step)
    return obs, regret, batch


def merge(*sets: Dataset) -> Dataset:
    return Dataset(*(np.concatenate([getattr(s, f) for s in sets]) for f in ("obs", "regret", "batch")))


def fit(data: Dataset, hidden: list[int], activation: str = "tanh", epochs: int = 300, lr: float = 3e-3,
        seed: int = 0, batch_weights: dict[int, float] | None = None,
        entropy: float = ENTROPY) -> tuple[list[tuple[np.ndarray, np.ndarray]], dict]:
    """An MLP minimising the expected regret of its softmax policy; returns its layers as (W, b) arrays and
    the normalisation LearnedK applies (features that hardly varied are pinned, as in PPO training)."""
    torch.manual_seed(seed)
    mean = data.obs.astype(np.float64).mean(axis=0)
    var = data.obs.astype(np.float64).var(axis=0)
    norm = {"mean": mean.tolist(), "var": var.tolist(), "epsilon": 1e-8, "clip": 10.0,
            "low": data.obs.min(axis=0).astype(np.float64).tolist(), "high": data.obs.max(axis=0).astype(np.float64).tolist()}
    inv_std = np.where(pinned_mask(var), 0.0, 1.0 / np.sqrt(var + 1e-8))  # the rule LearnedK applies
    x = torch.tensor(np.clip((data.obs - mean) * inv_std, -10.0, 10.0), dtype=torch.float32)
    r = torch.tensor(data.regret, dtype=torch.float32)
    w = torch.tensor([(batch_weights or {}).get(int(b), 1.0) for b in data.batch], dtype=torch.float32)
    act = {"tanh": torch.nn.Tanh, "relu": torch.nn.ReLU}[activation]
    sizes = [x.shape[1], *hidden, r.shape[1]]
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(act())
    net = torch.nn.Sequential(*layers)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        for idx in torch.randperm(len(x), generator=generator).split(512):
            logp = torch.log_softmax(net(x[idx]), dim=-1)
            probs = logp.exp()
            # expected regret minus an entropy bonus: per state its minimiser is softmax(-E[regret | obs] / entropy),
            # whose argmax is still the k of least expected regret, and its gradient does not vanish on a state
            # whose softmax settled early on a wrong k (plain expected regret stalls there)
            loss = (((probs * r[idx]).sum(-1) + entropy * (probs * logp).sum(-1)) * w[idx]).sum() / w[idx].sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    linear = [m for m in net if isinstance(m, torch.nn.Linear)]
    return [(m.weight.detach().numpy().astype(np.float32), m.bias.detach().numpy().astype(np.float32)) for m in linear], norm


def as_policy(layers, norm: dict, activation: str, k_max: int, meta: dict | None = None, stop_levels=(0.0,),
              sources=(None,)) -> LearnedK:
    """The fitted MLP as a LearnedK (in memory), to score or to serve as the next round's base policy."""
    table = ActionTable(k_max, stop_levels, sources)
    names = [f"layer{i}" for i in range(len(layers))]
    weights = {}
    for name, (w, b) in zip(names, layers):
        weights[f"{name}.weight"], weights[f"{name}.bias"] = w, b
    full = {"normalization": norm, "activation": activation, "layers": names, "action_to_k": table.to_k,
            "action_to_stop": table.to_stop, **({"action_to_source": table.to_source} if table.sources != [None] else {}),
            "k_max": k_max, **(meta or {})}
    return LearnedK(full, weights)


def mean_regret(policy: LearnedK, data: Dataset) -> float:
    """The regret, in plain steps, of the policy's choices (its actions) on the labelled states (0 = the improved policy)."""
    chosen = np.argmax(policy.logits(data.obs.astype(np.float64)), axis=-1)
    return float(data.regret[np.arange(len(chosen)), chosen].mean())


def improve_policy(base: LengthPolicy, traces: list[Trace], cost: CostModel, k_max: int, hardware, batch_sizes: list[int],
                   episodes: dict[int, int], max_new_tokens: int, rounds: int, hidden: list[int], activation: str,
                   epochs: int = 200, seed: int = 0, progress: bool = True, log=None, context_lens: list[int] = (),
                   conditions: list[MachineCondition] = (), hardware_noise: float = 0.0, cost_jitter: float = 0.0,
                   workers: int = 1, labels: str = "rollout", batch_weights: dict[int, float] | None = None,
                   stop_levels=(0.0,), sources=(None,)):
    """`rounds` of rollout policy improvement from `base`: round 1 labels the states of the improved policy
    under `base`; each later round labels the states the last fitted policy visits, with rollouts of it
    (DAgger: the datasets are pooled) and refits (`batch_weights`: {batch size: weight of its states in the
    fit}, 1 for the rest). Returns (layers, normalisation, per-round history)."""
    data, policy, history, layers, norm = None, base, [], None, None
    for r in range(rounds):
        new = collect(policy, traces, cost, k_max, hardware, batch_sizes, episodes, max_new_tokens, seed=seed + r,
                      progress=progress, follow=None if r == 0 else policy, context_lens=context_lens,
                      conditions=conditions, hardware_noise=hardware_noise, cost_jitter=cost_jitter, workers=workers,
                      labels=labels, stop_levels=stop_levels, sources=sources)
        data = new if data is None else merge(data, new)
        layers, norm = fit(data, hidden, activation, epochs, seed=seed + r, batch_weights=batch_weights)
        fitted = as_policy(layers, norm, activation, k_max, stop_levels=stop_levels, sources=sources)
        row = {"round": r + 1, "states": int(len(data.obs)), "base_regret": float(new.regret.mean()),
               "fitted_regret": mean_regret(fitted, data)}
        history.append(row)
        if log:
            log(f"rollout round {row['round']}: {row['states']} labelled states, regret of the base policy "
                f"{row['base_regret']:.3f} plain steps per step, of the fitted one {row['fitted_regret']:.3f}")
        policy = fitted
    return layers, norm, history
