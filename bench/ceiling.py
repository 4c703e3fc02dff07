"""How fast can a causal policy be with the n-gram draft? `python -m bench.ceiling` (about a minute).

At one row on the CPU the choice is nearly binary (a verify pass of any k >= 1 costs 1.6-2.1 plain steps),
so a policy is as good as its estimate of how many drafted tokens the target will keep. This fits that
estimate directly, P(m >= j | features) for j = 1..k_max (an MLP, train split), over everything a policy
could know before the step: the n-gram match length and the tokens on offer, the shadow acceptance (was
the draft's first token at the previous position right, drafted or not), the match's extension beyond n
(how many tokens before it also agree) and the agreement of the continuations of every earlier occurrence.
It then drafts the k maximising E[tokens] - lam * step cost / plain step cost (lam, the price of time in
plain steps, tuned on the train split) and replays that on the test and ood traces against the rule
`match:N:K` and the oracle. A learned k controller with these inputs cannot beat this by much: it is the
throughput-optimal use of a calibrated acceptance estimate.
"""
from __future__ import annotations

import argparse
import math

import numpy as np
import torch

from decoding.drafters import match_statistics
from decoding.paths import profile_path, traces_path
from env.oracle import CostModel, Trace, load_profile, load_traces, oracle_schedule, plain_seconds, truncate


def match_features(trace: Trace, i: int) -> tuple[int, int, float]:
    """(suffix agreeing before the continuation, occurrences of the n-gram, agreement of their continuations):
    `decoding.drafters.match_statistics`, what the learned policy reads too."""
    return match_statistics(np.asarray(trace.prompt_ids + trace.output_ids[:i]), 3)


def features(trace: Trace, i: int, shadow: float, extra: tuple[int, int, float]) -> list[float]:
    n, (ext, hits, agree) = trace.match_lens[i], extra
    return [n == 1, n == 2, n == 3, trace.available[i] / 8, shadow, min(ext, 32) / 32, math.log1p(ext), agree,
            math.log1p(hits)]


def fit_acceptance(traces: list[Trace], extras: dict, k_max: int, seed: int = 0):
    """P(m >= j), j = 1..k_max, from the features (the shadow taken at the previous position)."""
    x, y = [], []
    for t in traces:
        for i in range(len(t.output_ids)):
            if t.available[i]:
                shadow = float(t.matches[i - 1] >= 1) if i and t.available[i - 1] else 0.5
                x.append(features(t, i, shadow, extras[t.question_id][i]))
                y.append([t.matches[i] >= j for j in range(1, k_max + 1)])
    torch.manual_seed(seed)
    xt, yt = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)
    mean, std = xt.mean(0), xt.std(0) + 1e-6
    net = torch.nn.Sequential(torch.nn.Linear(xt.shape[1], 32), torch.nn.Tanh(), torch.nn.Linear(32, k_max))
    opt = torch.optim.Adam(net.parameters(), 1e-2)
    for _ in range(800):
        opt.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(net((xt - mean) / std), yt).backward()
        opt.step()
    return lambda f: torch.sigmoid(net((torch.tensor(f, dtype=torch.float32) - mean) / std)).detach().numpy()


def run(trace: Trace, cost: CostModel, choose) -> tuple[float, float]:
    """(seconds of a causal policy, seconds of plain decoding) on one trace at one row."""
    i, seconds, shadow, n = 0, 0.0, 0.5, len(trace.output_ids)
    while i < n:
        table = cost.step_costs(len(trace.prompt_ids) + i, 1)[0]
        k = max(0, min(choose(trace, i, shadow, table), trace.available[i], n - i - 1)) if trace.available[i] else 0
        seconds += table[k]
        if trace.available[i]:
            shadow = float(trace.matches[i] >= 1)
        i += min(k, trace.matches[i]) + 1
    return seconds, plain_seconds(trace, cost)


def speedup(traces, cost, choose) -> float:
    runs = [run(t, cost, choose) for t in traces]
    return sum(p for _, p in runs) / sum(s for s, _ in runs)


def predictive_policy(predict, extras, lam: float):
    def choose(trace, i, shadow, table):
        p = predict(features(trace, i, shadow, extras[trace.question_id][i]))
        values = [1.0 - lam] + [1.0 + p[:k].sum() - lam * table[k] / table[0] for k in range(1, trace.available[i] + 1)]
        return int(np.argmax(values))
    return choose


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--draft", default="ngram:3")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    cost = CostModel.from_profile(load_profile(profile_path(args.device, args.draft)))
    traces, meta = load_traces(traces_path(args.draft))
    splits = meta.get("splits") or {}
    by_split = {s: [truncate(t, args.max_new_tokens) for t in traces if splits.get(t.question_id) == s]
                for s in ("train", "test", "ood")}
    extras = {t.question_id: [match_features(t, i) for i in range(len(t.output_ids))] for ts in by_split.values() for t in ts}
    k_max = min(cost.k_max, traces[0].k_max)
    predict = fit_acceptance(by_split["train"], extras, k_max)
    lam = max((1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.4), key=lambda v: speedup(by_split["train"], cost, predictive_policy(predict, extras, v)))
    best_rule = max(((n, k) for n in (1, 2, 3) for k in range(1, k_max + 1)),
                    key=lambda r: speedup(by_split["train"], cost, lambda t, i, s, tab: r[1] if t.match_lens[i] >= r[0] else 0))
    print(f"one row, {args.device} cost profile, {args.draft} traces, {args.max_new_tokens} tokens; lam = {lam} and "
          f"match:{best_rule[0]}:{best_rule[1]} tuned on the train split")
    print(f"{'split':<6}{'match rule':>12}{'predictive':>12}{'oracle':>9}")
    for split in ("train", "test", "ood"):
        ts = by_split[split]
        rule = speedup(ts, cost, lambda t, i, s, tab: best_rule[1] if t.match_lens[i] >= best_rule[0] else 0)
        pred = speedup(ts, cost, predictive_policy(predict, extras, lam))
        oracle = sum(plain_seconds(t, cost) for t in ts) / sum(oracle_schedule(t, cost, k_max)[0] for t in ts)
        print(f"{split:<6}{rule:>11.3f}x{pred:>11.3f}x{oracle:>8.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
