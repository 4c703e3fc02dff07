"""Every policy by its name, wherever a policy is named (generate, `custom_generate`, the benchmark): `parse_policy`.

The hand-made rules (`rule_spec.parse_rule`), the exported RL policy (`learned`, `learned-mlp`,
`learned-idle-counters`: `learned.LearnedK`) and the engine rules tuned on the train split (`best-rule`: per batch
size the best of them; `rule:FAMILY`: one family's best), read from `policies/DEVICE/PAIR/rules.json`
(scripts/tune_rules.py)."""
from __future__ import annotations

from pathlib import Path

from .config import warn
from .errors import SpecPilotError
from .hardware import artifact_key, is_cpu_key
from .learned import LearnedK, idle_counters
from .paths import POLICIES, read_json_file, rules_path, search_roots, temperature_suffix
from .policies import DEFAULT_K_MAX, LengthPolicy, PerBatchK
from .rule_spec import parse_rule


def is_tuned_rule(text: str) -> bool:
    """`best-rule` or `rule:FAMILY`."""
    name, _, arg = text.strip().partition(":")
    return (name == "best-rule" and not arg) or (name == "rule" and bool(arg))


def tuned_rules_file(device_key: str, draft: str, temperature: float = 0.0, target: str | None = None) -> Path:
    """The rules tuned for this machine key and (target, draft) pair at this temperature; on a CPU without its own,
    another CPU's, with a one-line warning (as a learned policy is found: `learned.default_policy_path`)."""
    own = rules_path(device_key, draft, temperature, target=target)
    if own.exists() or not is_cpu_key(device_key):
        return own
    others = [p for root in search_roots(POLICIES.name)
              for p in sorted(root.glob(f"cpu-*/{own.parent.name}/rules{temperature_suffix(temperature)}.json"))]
    if others:
        warn(f"no tuned rules for this machine ({device_key}); using {others[0].parent.parent.name}'s, tuned on "
             f"another CPU's costs: tune them here with python scripts/tune_rules.py --device cpu --draft {draft}")
        return others[0]
    return own


def tuned_rule(text: str, k_max: int = DEFAULT_K_MAX, device: str | None = None, draft: str | None = None,
               target: str | None = None, temperature: float = 0.0, path: str | Path | None = None) -> PerBatchK:
    """`best-rule` / `rule:FAMILY` as a policy: per batch size the spelling tuned on the train split (a rules.json's
    `best_rule`, or `best[FAMILY]`), the entry of the largest listed size <= the live rows deciding. vLLM's
    `batch-table` reads the table the tuning recorded beside it (`batch_table`: {batch size: k})."""
    if not draft:
        raise SpecPilotError(f"policy '{text}' is tuned per draft: name the draft (--draft)")
    key = artifact_key(device or "auto")
    path = Path(path) if path else tuned_rules_file(key, draft, temperature, target)
    rules = read_json_file(path, "tuned rules", f"run: python scripts/tune_rules.py --device {key} --draft {draft}",
                           keys=("draft", "best_rule", "best"))
    if rules.get("draft") != draft:
        raise SpecPilotError(f"rules {path} were tuned for draft '{rules.get('draft')}', not '{draft}'")
    if float(rules.get("temperature") or 0.0) != float(temperature):
        raise SpecPilotError(f"rules {path} were tuned for temperature {float(rules.get('temperature') or 0.0):g}, "
                             f"not {float(temperature):g} (scripts/tune_rules.py --temperature)")
    family = text.strip().partition(":")[2]
    by_batch = rules["best_rule"] if text.strip() == "best-rule" else rules["best"].get(family)
    if by_batch is None:
        raise SpecPilotError(f"rules {path} have no family '{family}'; tuned: {', '.join(rules['best'])}")
    table = {int(b): int(k) for b, k in (rules.get("batch_table") or {}).items()}
    made: dict[int, LengthPolicy] = {}
    for batch, spec in by_batch.items():
        if spec == "batch-table":
            if int(batch) not in table:
                raise SpecPilotError(f"rules {path} pick vLLM's batch-table at {batch} rows but record no table; "
                                     f"retune them: python scripts/tune_rules.py --device {key} --draft {draft}")
            spec = f"static:{table[int(batch)]}"
        made[int(batch)] = parse_rule(spec, k_max, draft=draft)
    policy = PerBatchK(made, text.strip())
    policy.table = {int(b): spec for b, spec in by_batch.items()}
    policy.path = str(path)
    return policy


def parse_policy(text: str, k_max: int = DEFAULT_K_MAX, temperature: float = 0.0, rules: str | Path | None = None,
                 **learned_kwargs) -> LengthPolicy:
    """Build a policy from its name (`rule_spec.POLICY_HELP`). `learned_kwargs` go to `LearnedK.load` (device, draft,
    target, allow_device_mismatch, replay); a tuned rule reads device, draft and target from them, `temperature`
    and `rules` (a rules.json to read instead of the machine's own)."""
    name, _, arg = text.strip().partition(":")
    if name in ("engine", "engine-lookup", "engine-specpilot"):  # llama-cpp-python's own decoding, as a benchmark row
        from .llama_cpp import engine_policy

        inner = parse_policy(arg, k_max, temperature, rules, **learned_kwargs) if name == "engine-specpilot" and arg else None
        return engine_policy(text, inner)
    if name in ("learned", "learned-mlp", "learned-idle-counters"):
        policy = LearnedK.load(arg or None, defer=name != "learned-mlp", **learned_kwargs)
        return policy.pin_counters(idle_counters(policy)) if name == "learned-idle-counters" else policy
    if is_tuned_rule(text):
        return tuned_rule(text, k_max, learned_kwargs.get("device"), learned_kwargs.get("draft"),
                          learned_kwargs.get("target"), temperature, rules)
    return parse_rule(text, k_max, draft=learned_kwargs.get("draft"))
