"""How fast can a causal policy be with the n-gram draft? `python -m specpilot.bench.ceiling` (about a minute).

At one row on the CPU the choice is nearly binary (a verify pass of any k >= 1 costs 1.6-2.1 plain steps),
so a policy is as good as its estimate of how many drafted tokens the target will keep. This fits that
estimate directly, P(m >= j | inputs) for j = 1..k_max (an MLP, train split), over what a policy could know
before the step, and then drafts the k maximising E[tokens] - lam * step cost / plain step cost (lam, the price
of time in plain steps, tuned on the train split); it replays that on the test, ood and outside traces against the rule
`match:N:K` and the oracle. A learned k controller with these inputs cannot beat this by much: it is the
throughput-optimal use of a calibrated acceptance estimate.

`--inputs` names the families of inputs (comma-separated):
  match   the n-gram match length and tokens on offer, the shadow acceptance (was the draft's first token at the
          previous position right, drafted or not), the match's extension beyond n, the count and agreement of the
          n-gram's earlier occurrences (what the learned policy reads; always on);
  target  the target's confidence in the token it just chose (top probability, entropy) and the lowest top
          probability over the last four (free in the verify pass; one teacher-forced forward per trace, cached);
  source  where the match comes from: prompt or answer, how far back, the position in the answer, the prompt's
          length, and the classes of the proposed and the last token (whitespace, punctuation, leading space,
          digit, newline);
  frames:N  the match inputs and shadow acceptance of the N previous positions (frame stacking).
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specpilot.decoding.hardware import artifact_key
from specpilot.decoding.config import ReplayInputs, parse_config, run_cli
from specpilot.decoding.drafters import match_statistics, ngram_search
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.paths import atomic_write_text, profile_path, slug, temperature_suffix, traces_path
from specpilot.env.oracle import (CostModel, Trace, load_profile, load_traces, oracle_schedule, plain_seconds, trace_temperature,
                        truncate)


@dataclass
class CeilingConfig(ReplayInputs):
    """The acceptance-estimate ceiling of a causal k policy at one row, per family of inputs."""

    max_new_tokens: int = 48
    """Tokens per trace."""
    inputs: str = "match"
    """Comma-separated input families: match (always on), target, source, frames:N (see the module's help)."""
    target: str = "embedded"
    """The target model (for the target and source inputs: its confidences, its tokenizer)."""
    profile: str | None = None
    """Cost profile (default: the device's)."""
    traces: str | None = None
    """Acceptance traces (default: the draft's greedy ones); sampled traces (profile_device --temperature) give the
    ceiling of sampled decoding at their temperature."""
    cache: str = "runs/ceiling"
    """Folder of the cached target confidences (one teacher-forced forward per trace, reused on rerun)."""


def match_features(trace: Trace, i: int) -> tuple[int, int, float]:
    """(suffix agreeing before the continuation, occurrences of the n-gram, agreement of their continuations):
    `decoding.drafters.match_statistics`, what the learned policy reads too."""
    return match_statistics(np.asarray(trace.prompt_ids + trace.output_ids[:i]), 3)


def features(trace: Trace, i: int, shadow: float, extra: tuple[int, int, float]) -> list[float]:
    """The match family at position i: n-gram length one-hot, tokens on offer, shadow, the match statistics."""
    n, (ext, hits, agree) = trace.match_lens[i], extra
    return [n == 1, n == 2, n == 3, trace.available[i] / 8, shadow, min(ext, 32) / 32, math.log1p(ext), agree,
            math.log1p(hits)]


def shadow_at(trace: Trace, i: int) -> float:
    """The shadow acceptance a policy knows at position i: was the draft's first token at i - 1 right (0.5: unknown)."""
    return float(trace.matches[i - 1] >= 1) if i and trace.available[i - 1] else 0.5


class Featurizer:
    """featurize(trace, i, shadow) -> the inputs at position i: the match family, then the chosen others."""

    def __init__(self, traces: list[Trace], families: list[str] = ("match",), confidences: dict | None = None,
                 token_class=None, budget: int = 48):
        self.families, self.confidences, self.token_class, self.budget = list(families), confidences, token_class, budget
        self.frames = max([int(f.split(":")[1]) for f in self.families if f.startswith("frames:")] or [0])
        self.extras = {t.question_id: [match_features(t, i) for i in range(len(t.output_ids))] for t in traces}
        self._source: dict = {}

    def __call__(self, trace: Trace, i: int, shadow: float) -> list[float]:
        f = features(trace, i, shadow, self.extras[trace.question_id][i])
        if "target" in self.families:
            f += self._target(trace, i)
        if "source" in self.families:
            f += self._source_of(trace, i)
        for d in range(1, self.frames + 1):
            j = i - d
            if j < 0:
                f += [0.0, 0.0, 0.0, 0.0, 0.5]
            else:
                ext, _, agree = self.extras[trace.question_id][j]
                f += [trace.match_lens[j] / 3, trace.available[j] / 8, math.log1p(ext) / 4, agree, shadow_at(trace, j)]
        return f

    def _target(self, trace: Trace, i: int) -> list[float]:
        """Top probability and entropy (/ 8) of the target at the token it chose last, the lowest top p of the last four."""
        if i == 0:
            return [1.0, 0.0, 1.0]
        top, entropy = self.confidences[trace.question_id]
        return [top[i - 1], min(entropy[i - 1], 8.0) / 8.0, min(top[max(0, i - 4) : i])]

    def _source_of(self, trace: Trace, i: int) -> list[float]:
        key = (trace.question_id, i)
        if key not in self._source:
            context = np.asarray(trace.prompt_ids + trace.output_ids[:i])
            n_prompt = len(trace.prompt_ids)
            start, n, _ = ngram_search(context, 3)
            where = [0.0, 0.0, i / self.budget, math.log1p(n_prompt) / 8]
            if n:
                where[:2] = [float(start < n_prompt), math.log1p(len(context) - start) / 8]
            first = int(context[start]) if n and start < len(context) else None
            self._source[key] = where + self.token_class(first) + self.token_class(int(context[-1]))
        return self._source[key]


def token_classes(tokenizer):
    """token id -> [whitespace only, punctuation, leading space, digit, newline] of its text (None: all 0)."""
    memo: dict = {}

    def classes(token: int | None) -> list[float]:
        if token is None:
            return [0.0] * 5
        if token not in memo:
            text = tokenizer.decode([token])
            memo[token] = [float(text.strip() == ""), float(any(c in text for c in ".,;:!?()[]{}\"'`")),
                           float(text[:1] == " "), float(any(c.isdigit() for c in text)), float("\n" in text)]
        return memo[token]
    return classes


@torch.inference_mode()
def target_confidences(target, trace: Trace, temperature: float = 0.0) -> tuple[list[float], list[float]]:
    """(top probability, entropy) of the target's distribution (at `temperature`, 0: greedy's softmax) at each output
    position, from one teacher-forced forward; a greedy trace's tokens are the target's argmax there (checked), a
    sampled trace's have positive probability (checked)."""
    full = torch.tensor([trace.prompt_ids + trace.output_ids], device=target.device)
    n_prompt = len(trace.prompt_ids)
    logits = target.model(input_ids=full).logits[0, n_prompt - 1 : n_prompt - 1 + len(trace.output_ids)].float()
    logp = torch.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)
    chosen = torch.tensor(trace.output_ids)
    if temperature > 0:
        if not bool(torch.isfinite(logp.cpu().gather(1, chosen[:, None])).all()):
            raise SpecPilotError(f"trace {trace.question_id} holds a token this target cannot sample")
    elif not torch.equal(logp.argmax(-1).cpu(), chosen):
        raise SpecPilotError(f"trace {trace.question_id} is not this target's greedy output")
    return logp.max(-1).values.exp().tolist(), (-(logp.exp() * logp).sum(-1)).tolist()


def cached_confidences(target, traces: list[Trace], path: Path, temperature: float = 0.0) -> dict:
    """{question_id: (top p, entropy)} for the traces, computed once and kept at `path` (atomic writes)."""
    found = json.loads(path.read_text()) if path.exists() else {}
    missing = [t for t in traces if len(found.get(t.question_id, [[]])[0]) != len(t.output_ids)]
    for n, t in enumerate(missing, 1):
        found[t.question_id] = [[round(x, 5) for x in v] for v in target_confidences(target, t, temperature)]
        print(f"\rtarget confidences: {n}/{len(missing)} traces", end="", file=sys.stderr, flush=True)
        if n % 20 == 0 or n == len(missing):
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps(found))
    if missing:
        print(file=sys.stderr)
    return {q: tuple(v) for q, v in found.items()}


def fit_acceptance(traces: list[Trace], featurize, k_max: int, seed: int = 0):
    """P(m >= j), j = 1..k_max, from the inputs (the shadow taken at the previous position)."""
    x, y = [], []
    for t in traces:
        for i in range(len(t.output_ids)):
            if t.available[i]:
                x.append(featurize(t, i, shadow_at(t, i)))
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


def predictive_policy(predict, featurize, lam: float):
    def choose(trace, i, shadow, table):
        p = predict(featurize(trace, i, shadow))
        values = [1.0 - lam] + [1.0 + p[:k].sum() - lam * table[k] / table[0] for k in range(1, trace.available[i] + 1)]
        return int(np.argmax(values))
    return choose


def parse_families(text: str) -> list[str]:
    families = [f.strip() for f in text.split(",") if f.strip()] or ["match"]
    for f in families:
        frames = f.startswith("frames:") and f[7:].isdigit() and int(f[7:]) >= 1
        if f not in ("match", "target", "source") and not frames:
            raise SpecPilotError(f"--inputs takes match, target, source and frames:N (N >= 1), got '{f}'")
    return families


def ceiling_main(argv: list[str] | None = None) -> int:
    cfg = parse_config(CeilingConfig, argv, description=__doc__.splitlines()[0])
    cfg.device = artifact_key(cfg.device)  # 'cpu' -> this CPU's machine key
    families = parse_families(cfg.inputs)
    cost = CostModel.from_profile(load_profile(cfg.profile or profile_path(cfg.device, cfg.draft)))
    traces, meta = load_traces(cfg.traces or traces_path(cfg.draft))
    temperature = trace_temperature(meta)
    splits = meta.get("splits") or {}
    by_split = {s: [truncate(t, cfg.max_new_tokens) for t in traces if splits.get(t.question_id) == s]
                for s in ("train", "test", "ood", "outside")}
    if not by_split["train"]:
        raise SpecPilotError("the traces record no train split to fit on")
    everything = [t for ts in by_split.values() for t in ts]
    confidences, classes = None, None
    if "target" in families or "source" in families:
        from specpilot.decoding.models import load_target

        target = load_target(cfg.target, "float32", "cpu")
        if "source" in families:
            if target.tokenizer is None:
                raise SpecPilotError("--inputs source reads token texts: the target needs a tokenizer")
            classes = token_classes(target.tokenizer)
        if "target" in families:
            name = f"confidence-{slug(cfg.draft)}{temperature_suffix(temperature)}.json"
            confidences = cached_confidences(target, everything, Path(cfg.cache) / name, temperature)
    featurize = Featurizer(everything, families, confidences, classes, cfg.max_new_tokens)
    k_max = min(cost.k_max, traces[0].k_max)
    predict = fit_acceptance(by_split["train"], featurize, k_max)
    lam = max((1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.4),
              key=lambda v: speedup(by_split["train"], cost, predictive_policy(predict, featurize, v)))
    best_rule = max(((n, k) for n in (1, 2, 3) for k in range(1, k_max + 1)),
                    key=lambda r: speedup(by_split["train"], cost, lambda t, i, s, tab: r[1] if t.match_lens[i] >= r[0] else 0))
    mode = f"sampled at temperature {temperature:g}" if temperature > 0 else "greedy"
    print(f"one row, {cfg.device} cost profile, {cfg.draft} traces ({mode}), {cfg.max_new_tokens} tokens, inputs "
          f"{','.join(families)}; lam = {lam} and match:{best_rule[0]}:{best_rule[1]} tuned on the train split")
    print(f"{'split':<8}{'match rule':>12}{'predictive':>12}{'oracle':>9}")
    for split in ("train", "test", "ood", "outside"):
        ts = by_split[split]
        if not ts:
            continue
        rule = speedup(ts, cost, lambda t, i, s, tab: best_rule[1] if t.match_lens[i] >= best_rule[0] else 0)
        pred = speedup(ts, cost, predictive_policy(predict, featurize, lam))
        oracle = sum(plain_seconds(t, cost) for t in ts) / sum(oracle_schedule(t, cost, k_max)[0] for t in ts)
        print(f"{split:<8}{rule:>11.3f}x{pred:>11.3f}x{oracle:>8.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(ceiling_main))
