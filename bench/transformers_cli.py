"""Speculative decoding inside transformers, measured: `python scripts/transformers_report.py`.

One process, one row (B = 1), every policy on the same prompts, interleaved (the order rotated per prompt and
repeat), each timed as the whole `model.generate` call a user makes, every output checked token for token against
transformers' plain greedy `generate`. Rows:
- `hf:plain`: transformers' greedy `generate` (the baseline);
- `hf:prompt-lookup:N`: transformers' prompt lookup, at its default N = 10 (`PromptLookupCandidateGenerator`'s
  `num_output_tokens`, `max_matching_ngram_size` 2) and at the N tuned on the train split (fastest of
  `--lookup-grid` on the train prompts, timed the same way; the test split is never tuned on);
- `hf:prompt-lookup+learned`: transformers' prompt lookup with its number of draft tokens per step set by the learned
  policy (`specpilot.decoding.hf.policy_in_assisted_generation`);
- `sp:POLICY` through `custom_generate=specpilot_generate` (the project's loop on the caller's model): `none` (the
  project's plain loop), `learned`, `best-rule` (tuned on the train split); and the same with `+small-rows`, the
  opt-in CPU kernel (`kernels="small-rows"`), whose gain is a faster plain step, not speculation: so speedups are
  given over `hf:plain` and over the project's plain loop of the same kernels.
Assisted generation with a draft model (`assistant_model=`, its `num_assistant_tokens_schedule`s) has no row: the
embedded SmolLM2-135M has no smaller sibling with its tokenizer that is offline here.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from tqdm import tqdm

from specpilot.decoding.config import parse_config, parse_ints
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.hf import policy_in_assisted_generation, specpilot_generate
from specpilot.decoding.models import Target, load_draft, load_model
from specpilot.decoding.policy_spec import parse_policy
from specpilot.decoding.prompts import load_prompts, per_category
from specpilot.decoding.paths import atomic_write_text

from .benchmark import paired_ratio
from .benchmark_cli import _tuned_rule
from .report import provenance_line, source_commit

DEFAULT_LOOKUP = 10
"""transformers' PromptLookupCandidateGenerator default num_output_tokens."""


@dataclass
class TransformersReportConfig:
    """Speculative decoding inside transformers' generate: its plain and prompt-lookup decoding beside the project's
    loop through custom_generate (learned policy, best tuned rule), one row, paired repeats."""

    device: str = "cpu"
    """Machine key whose learned policy and tuned rules are used (cpu: this CPU's)."""
    split: str = "test"
    """Prompts measured: test | ood | outside (never tuned on)."""
    per_category: int = 2
    """Prompts per category (0 = all of the split)."""
    max_new_tokens: int = 48
    """Tokens per prompt."""
    repeats: int = 3
    """Paired repeats (each runs every policy on every prompt)."""
    lookup_grid: str = "1,2,3,4,6,8,10"
    """prompt_lookup_num_tokens values tuned on the train split."""
    tune_per_category: int = 1
    """Train prompts per category the lookup length is tuned on."""
    kernels: bool = True
    """Also run the project's loop with its opt-in CPU kernel (`+small-rows` rows)."""
    report: str = "reports/transformers.md"
    """The report page (its JSON and nothing else beside it)."""
    progress: bool = True
    """Show a progress bar."""


def _chat_inputs(tokenizer, prompt) -> dict:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(text, return_tensors="pt")


def _runners(model, cfg: TransformersReportConfig, lookup_tuned: int, learned, rule) -> dict:
    """{row name: fn(inputs) -> sequences}, every one a full `model.generate` call."""
    greedy = {"do_sample": False, "max_new_tokens": cfg.max_new_tokens}

    def lookup(n):
        return lambda inputs: model.generate(**inputs, **greedy, prompt_lookup_num_tokens=n)

    def assisted_learned(inputs):
        with policy_in_assisted_generation(model, learned):
            return model.generate(**inputs, **greedy, prompt_lookup_num_tokens=DEFAULT_LOOKUP)

    def ours(policy, kernels=None):
        return lambda inputs: model.generate(**inputs, **greedy, custom_generate=specpilot_generate, draft="ngram",
                                             policy=policy, kernels=kernels)

    runners = {"hf:plain": lambda inputs: model.generate(**inputs, **greedy),
               f"hf:prompt-lookup:{DEFAULT_LOOKUP}": lookup(DEFAULT_LOOKUP)}
    if lookup_tuned != DEFAULT_LOOKUP:
        runners[f"hf:prompt-lookup:{lookup_tuned}"] = lookup(lookup_tuned)
    runners["hf:prompt-lookup+learned"] = assisted_learned
    for suffix, kernels in [("", None)] + ([("+small-rows", "small-rows")] if cfg.kernels else []):
        runners[f"sp:none{suffix}"] = ours("none", kernels)
        runners[f"sp:learned{suffix}"] = ours(learned, kernels)
        runners[f"sp:best-rule{suffix}"] = ours(rule, kernels)
    return runners


def _timed(fn, inputs) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    with torch.no_grad():
        out = fn(inputs)
    return time.perf_counter() - t0, out


def _interleaved(runners: dict, prompts: list, inputs: list, repeats: int, reference: list, progress: bool) -> list[dict]:
    """Every runner on every prompt in each repeat, the order rotated by (repeat + prompt); each output checked
    against the reference (transformers' plain greedy)."""
    names = list(runners)
    rows = []
    bar = tqdm(total=repeats * len(prompts) * len(names), desc="transformers", disable=not progress, file=sys.stderr)
    for r in range(repeats):
        for j, (prompt, x) in enumerate(zip(prompts, inputs)):
            shift = (r + j) % len(names)
            for name in names[shift:] + names[:shift]:
                seconds, out = _timed(runners[name], x)
                rows.append({"policy": name, "repeat": r, "question_id": prompt.question_id, "category": prompt.category,
                             "seconds": seconds, "identical": bool(torch.equal(out, reference[j]))})
                bar.update()
    bar.close()
    return rows


def _tune_lookup(model, cfg: TransformersReportConfig, tokenizer) -> tuple[int, dict]:
    """The fastest prompt_lookup_num_tokens of the grid on train prompts (one pass, interleaved): (N, seconds by N)."""
    prompts = per_category(load_prompts(None, "train"), cfg.tune_per_category)
    inputs = [_chat_inputs(tokenizer, p) for p in prompts]
    greedy = {"do_sample": False, "max_new_tokens": cfg.max_new_tokens}
    reference = [model.generate(**x, **greedy) for x in inputs]
    runners = {f"{n}": (lambda n: lambda x: model.generate(**x, **greedy, prompt_lookup_num_tokens=n))(n)
               for n in parse_ints(cfg.lookup_grid, "--lookup-grid")}
    rows = _interleaved(runners, prompts, inputs, 1, reference, cfg.progress)
    total = {n: sum(r["seconds"] for r in rows if r["policy"] == n) for n in runners}
    return int(min(total, key=total.get)), {int(n): round(s, 3) for n, s in total.items()}


def summarize(rows: list[dict], baselines: list[str]) -> dict:
    """Per row: total seconds per repeat, speedup over each baseline paired within each repeat [95%, t], and
    whether every output was token-identical to transformers' greedy."""
    names = list(dict.fromkeys(r["policy"] for r in rows))
    repeats = sorted({r["repeat"] for r in rows})
    time_of = {(n, k): sum(r["seconds"] for r in rows if r["policy"] == n and r["repeat"] == k) for n in names for k in repeats}
    table = {}
    for n in names:
        cell = {"seconds_per_repeat": [round(time_of[n, k], 4) for k in repeats],
                "identical": all(r["identical"] for r in rows if r["policy"] == n)}
        for base in baselines:
            per = [time_of[base, k] / time_of[n, k] for k in repeats]
            mean, interval = paired_ratio(per)
            cell[f"over {base}"] = {"per_repeat": [round(x, 4) for x in per], "ratio": round(mean, 4),
                                    "interval": [round(x, 4) for x in interval] if interval else None}
        table[n] = cell
    return table


def _cell(c: dict) -> str:
    return f"{c['ratio']:.3f}" + (f" [{c['interval'][0]:.3f}, {c['interval'][1]:.3f}]" if c["interval"] else "")


def markdown(doc: dict, command: str) -> str:
    t = doc["table"]
    lines = ["# Speculative decoding inside transformers' generate", "", provenance_line(doc["provenance"]), "",
             f"Regenerate with: `{command}`", "",
             f"target {doc['target']}; transformers {doc['transformers']}; {doc['prompts']} prompts ({doc['split']} split) x "
             f"{doc['repeats']} repeats; {doc['max_new_tokens']} new tokens; greedy; one row; each cell the whole "
             "`model.generate` call, every policy interleaved; speedup paired within each repeat, geometric mean "
             "[95%, Student's t]. `hf:prompt-lookup:N` at transformers' default N = 10 and at the N tuned on the train "
             f"split ({doc['lookup_tuned']}; train-split seconds by N: {doc['lookup_tuning']}).", "",
             "| row | identical to transformers' greedy | over hf:plain | over the project's plain loop |",
             "|---|---|---|---|"]
    for name, c in t.items():
        own = "sp:none+small-rows" if name.endswith("+small-rows") else "sp:none"
        lines.append(f"| {name} | {'yes' if c['identical'] else '**NO**'} | {_cell(c['over hf:plain'])} | "
                     + (_cell(c[f'over {own}']) if name.startswith("sp:") else "") + " |")
    lines += ["", "Targets (issue: learned through custom_generate over transformers' prompt lookup, both over hf:plain):", ""]
    for key, value in doc["targets"].items():
        lines.append(f"- {key}: {value:.3f}")
    return "\n".join(lines) + "\n"


def transformers_main(argv: list[str] | None = None) -> int:
    cfg = parse_config(TransformersReportConfig, argv)
    if cfg.repeats < 1 or cfg.max_new_tokens < 1:
        raise SpecPilotError("--repeats and --max-new-tokens must be >= 1")
    model, tokenizer, name = load_model(None)  # transformers' own path: nn.Linear, as a user loads it
    target = Target(model=model, tokenizer=tokenizer, name=name)
    draft = load_draft("ngram", target)
    device = cfg.device
    learned = parse_policy("learned", device=device, draft=draft.name)
    rule = _tuned_rule(SimpleNamespace(rules=None, profile=None, traces=None, max_new_tokens=cfg.max_new_tokens, k_max=8),
                       "best-rule", learned.meta.get("device", device), draft, SimpleNamespace(temperature=0.0))
    print("specpilot: tuning prompt_lookup_num_tokens on the train split", file=sys.stderr)
    lookup_tuned, tuning = _tune_lookup(model, cfg, tokenizer)
    prompts = per_category(load_prompts(None, cfg.split), cfg.per_category)
    inputs = [_chat_inputs(tokenizer, p) for p in prompts]
    greedy = {"do_sample": False, "max_new_tokens": cfg.max_new_tokens}
    reference = [model.generate(**x, **greedy) for x in inputs]
    runners = _runners(model, cfg, lookup_tuned, learned, rule)
    for fn in runners.values():  # warm-up, untimed
        fn({k: v[:, :16] for k, v in inputs[0].items()})
    rows = _interleaved(runners, prompts, inputs, cfg.repeats, reference, cfg.progress)
    baselines = ["hf:plain", "sp:none"] + (["sp:none+small-rows"] if cfg.kernels else [])
    table = summarize(rows, baselines)
    pl_default = table[f"hf:prompt-lookup:{DEFAULT_LOOKUP}"]["over hf:plain"]["ratio"]
    pl_tuned = table[f"hf:prompt-lookup:{lookup_tuned}"]["over hf:plain"]["ratio"]
    targets = {}
    for ours in ["sp:learned"] + (["sp:learned+small-rows"] if cfg.kernels else []):
        mine = table[ours]["over hf:plain"]["ratio"]
        targets[f"{ours} / hf:prompt-lookup:{DEFAULT_LOOKUP} (target >= 1.25)"] = mine / pl_default
        targets[f"{ours} / hf:prompt-lookup:{lookup_tuned} (target >= 1.10)"] = mine / pl_tuned
    import transformers

    doc = {"provenance": {"commit": source_commit(), "policy_weights": {"learned": learned.meta.get("weights")}},
           "target": name, "transformers": transformers.__version__, "split": cfg.split, "prompts": len(prompts),
           "repeats": cfg.repeats, "max_new_tokens": cfg.max_new_tokens, "lookup_tuned": lookup_tuned,
           "lookup_tuning": tuning, "best_rule": rule.table, "table": table, "targets": targets, "runs": rows}
    report = Path(cfg.report)
    atomic_write_text(report.with_suffix(".json"), json.dumps(doc, indent=1))
    page = markdown(doc, "python scripts/transformers_report.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    atomic_write_text(report, page)
    print(page)
    return 0
