"""LearnedK: the exported RL policy, loaded with numpy only (no SB3, no Gymnasium).

Files: `policy.json` (format version, ordered feature names, normalisation, layers, action -> k map,
device, provenance) and `policy.safetensors` (the MLP weights). The decision is an argmax over the
logits of a small MLP on the normalised observation: a few microseconds on a CPU.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from safetensors.numpy import load_file

from .config import warn
from .errors import SpecPilotError
from .hardware import HW_FEATURES, artifact_key, counters_by_name, is_cpu_key
from .observation import FEATURES
from .paths import POLICIES, pair_name, profile_path, read_json_file, search_roots, target_key
from .policies import ActionTable, LengthPolicy, at_or_below, batch_of
from .rule_spec import parse_rule

if TYPE_CHECKING:
    from .drafters import StopRule

FORMAT_VERSION = 1
MIN_FEATURE_STD = 0.02
"""A feature whose standard deviation in training was below this is pinned (held at its training mean).
The features are O(1) (ratios, fractions, logs of milliseconds): below 0.02 a feature did not vary."""


def pinned_mask(var) -> np.ndarray:
    """Which features are pinned, from their training variances (the one rule of training and inference)."""
    return np.sqrt(np.asarray(var, dtype=np.float64)) < MIN_FEATURE_STD


def default_policy_path(device_key: str, draft: str | None = None, target: str | None = None) -> Path:
    """policies/<device>/<pair>/policy.json (one policy per machine key, target and drafter: `paths.pair_name`) in the
    first lookup root that holds one (working directory, user folder, package data: `specpilot.decoding.paths`). On a
    CPU without a policy of its own, another CPU's policy for that pair, with a one-line warning."""
    name = pair_name(draft, target) if draft else "*"
    roots = search_roots(POLICIES.name)
    for root in roots:
        found = sorted((root / device_key).glob(f"{name}/policy.json"))
        if found:
            return found[0]
    if is_cpu_key(device_key):
        others = [p for root in roots for p in sorted(root.glob(f"cpu-*/{name}/policy.json"))]
        if others:
            warn(f"no policy for this machine ({device_key}); using {others[0].parent.parent.name}'s, profiled on "
                 f"another CPU: train one here with python scripts/train_policy.py --device cpu")
            return others[0]
    raise SpecPilotError(
        f"no learned policy for device '{device_key}'" + (f" and draft '{draft}'" if draft else "")
        + f" (looked for policies/{device_key}/{name}/policy.json); train one with: "
        f"python scripts/train_policy.py --device {device_key}" + (f" --draft {draft}" if draft else "")
        + (f" --target {target}" if target_key(target) else "")
    )


def idle_counters(policy: "LearnedK") -> np.ndarray:
    """The hardware counters recorded with the cost profile of the policy's device and drafter (profiles/DEVICE-DRAFT.json,
    measured on an otherwise idle machine): what `learned-idle-counters` pins the policy's counters to."""
    path = profile_path(str(policy.meta["device"]), policy.meta.get("draft"))
    profile = read_json_file(path, "cost profile", keys=("hardware",))
    if not profile.get("hardware"):
        raise SpecPilotError(f"{path} records no hardware counters to pin the policy's to")
    return counters_by_name(profile["hardware"], profile.get("hardware_features"))


REQUIRED_KEYS = ("k_max", "action_to_k", "normalization", "activation", "layers")
_ACTIVATIONS = {"tanh": np.tanh, "relu": lambda x: np.maximum(x, 0.0)}


class LearnedK(LengthPolicy):
    def __init__(self, meta: dict, weights: dict[str, np.ndarray], path: str = "", defer: bool = True):
        """`defer=False` ignores the policy's `defer` entry: the MLP decides at every batch size."""
        self.meta, self.path = meta, path
        self.name = "learned" if defer else "learned-mlp"
        self.k_max = int(meta["k_max"])
        self.defer: dict[int, LengthPolicy | None] = {}
        """{batch size: tuned rule, or None for the MLP} (meta `defer`, written by `python -m specpilot.agents.defer` and by
        train_policy.py where the train-split replay put the rule ahead of the fitted MLP): a batch of B rows is
        decided by the entry of the largest listed size <= B. Empty: the MLP decides everywhere."""
        self.deferred = 0
        """Decisions the rules of `defer` made."""
        if defer and meta.get("defer"):
            self.defer = _deferred_rules(meta["defer"], self.k_max, path)
        self.by_batch: dict[int, LearnedK | None] = {}
        """{batch size: the network deciding that batch, or None for this one} (meta `by_batch`, written where the
        held-out selection picked another training phase's network at some batch sizes: agents/select.py). A batch
        of B rows is decided by the entry of the largest listed size <= B; empty: this network everywhere."""
        if meta.get("by_batch"):
            self.by_batch = _batch_networks(meta, weights, path)
        # the features it reads, in its order: all of this version's, or (a policy exported before features were
        # added) a subset, taken from the observation by name
        self.features = list(meta.get("features") or FEATURES)
        self._columns = None if self.features == list(FEATURES) else np.array([FEATURES.index(f) for f in self.features])
        self.action_to_k = [int(k) for k in meta["action_to_k"]]
        self.action_to_stop = [float(v) for v in meta.get("action_to_stop") or [0.0] * len(self.action_to_k)]
        """Per action, the stop level inside the draft (`policies.ActionTable`; absent: 0, draft all k)."""
        self.action_to_source = meta.get("action_to_source")
        """Per action, the draft source (a hybrid drafter's policy; absent: the drafter's default)."""
        try:
            self.actions = ActionTable.of(self.action_to_k, self.action_to_stop, self.action_to_source)
        except SpecPilotError as exc:
            raise SpecPilotError(f"policy {path}: {exc}") from None
        norm = meta["normalization"]
        self.mean = np.asarray(norm["mean"], dtype=np.float64)
        self.inv_std = 1.0 / np.sqrt(np.asarray(norm["var"], dtype=np.float64) + float(norm["epsilon"]))
        # features that hardly varied in training are held at their training mean (as agents.ppo.PinnedVecNormalize
        # does in training): their weights never learned anything, and a ~0 std turns noise into a clipped input
        still = pinned_mask(norm["var"])
        self.pinned = [f for f, s in zip(self.features, still) if s]
        self.inv_std[still] = 0.0
        self.clip = float(norm["clip"])
        # the range each feature took in training (optional): inputs are clipped into it, so that an unseen
        # context length or prompt style reads as the nearest trained one, and the calls with an input
        # outside it are counted (`out_of_range`, `calls`)
        self.low = np.asarray(norm["low"], dtype=np.float64) if "low" in norm else None
        self.high = np.asarray(norm["high"], dtype=np.float64) if "high" in norm else None
        if self.low is not None:
            self.low[still], self.high[still] = -np.inf, np.inf
        self.calls = self.out_of_range = self.non_finite = 0
        self.clipped_by_feature = np.zeros(len(self.features), dtype=np.int64)
        """Per feature, the decisions in which that input was clipped (see `clipped_features`)."""
        self.strict = False
        """Raise on a non-finite observation instead of falling back to k = 0 (the tests set it)."""
        self._still = still
        self._pinned_at: tuple[np.ndarray, np.ndarray] | None = None
        """(columns, values) of `pin_counters`: inputs read as these values whatever the observation holds."""
        # one clip of the raw input does both: into the trained range and within +-clip standard deviations
        with np.errstate(divide="ignore"):
            bound = np.where(still, np.inf, self.clip / self.inv_std)
        self._lo, self._hi = self.mean - bound, self.mean + bound
        if self.low is not None:
            self._lo, self._hi = np.maximum(self._lo, self.low), np.minimum(self._hi, self.high)
        self.act = _ACTIVATIONS[meta["activation"]]
        # weights stored transposed (inputs @ W.T), contiguous: one matmul per layer per decision
        self.layers = [(np.ascontiguousarray(weights[f"{name}.weight"].astype(np.float64).T),
                        weights[f"{name}.bias"].astype(np.float64)) for name in meta["layers"]]
        self._prepare_layers()
        self.route: dict[int, LengthPolicy] = route_table(self.defer, self.by_batch, self)
        """{batch size: what decides a batch of that many live rows or more (up to the next size): a tuned rule of
        `defer`, else the network of `by_batch`, else this one}; built once at load from both tables, one lookup
        per decision. A network that decides here counts its calls and clipped inputs into this policy."""
        self._only = next(iter(self.route.values())) if len(self.route) == 1 else None

    def _prepare_layers(self) -> None:
        """The layers the decisions run: float32, as trained (the input normalised in float64 first, as SB3's
        VecNormalize does, then cast), and a pinned feature's clip bounds set to its training mean, so one
        clip of the raw input does all the input handling (float32 layers are faster: `decision_seconds`, printed
        by train_policy.py and agents.ensemble)."""
        self._run = [(np.ascontiguousarray(w.astype(np.float32)), b.astype(np.float32)) for w, b in self.layers]
        self._read = ~self._still
        self._read_weight = self._read.astype(np.float64)
        self._lo = np.where(self._still, self.mean, self._lo)
        self._hi = np.where(self._still, self.mean, self._hi)

    @classmethod
    def load(cls, path: str | Path | None = None, allow_device_mismatch: bool = False, device: str | None = None,
             draft: str | None = None, defer: bool = True, replay: bool = False, target: str | None = None) -> "LearnedK":
        """Load policy.json (+ policy.safetensors beside it); `path` may be either file or their folder.
        `defer=False`: the MLP alone, ignoring the policy's `defer` rules (see `LearnedK.defer`).
        `replay=True`: the policy will decide in a replay env (costs from a profile), not on the hardware, so a
        policy trained on a simulated profile loads without its warning.

        `draft`: the drafter it will run with; a policy trained with another drafter is refused (its
        acceptance features mean something else). `target`: the target's name (or --target spelling); without a
        path the pair's policy is looked up, and a policy trained for another target is refused."""
        here = artifact_key(device or "auto")
        path = Path(path) if path else default_policy_path(here, draft, target)
        if path.is_dir():
            path = path / "policy.json"
        if path.suffix == ".safetensors":
            path = path.with_suffix(".json")
        if not path.exists():
            raise SpecPilotError(f"policy file not found: {path}")
        try:
            meta = json.loads(path.read_text())
            if not isinstance(meta, dict):
                raise ValueError("not a JSON object")
        except (ValueError, UnicodeDecodeError) as exc:
            raise SpecPilotError(f"corrupt policy file {path}: {exc}") from None
        version = meta.get("format_version")
        if version != FORMAT_VERSION:
            raise SpecPilotError(f"policy {path} has format version {version}; this specpilot reads version {FORMAT_VERSION}")
        features = meta.get("features")
        unknown = sorted(set(features or []) - set(FEATURES))
        if not features or unknown or len(set(features)) != len(features):
            raise SpecPilotError(
                f"policy {path} was trained on other observation features (unknown {unknown[:4]}"
                f"{', or none listed' if not features else ''}{', or repeated' if features and not unknown else ''}); "
                "retrain it with this version")
        trained_on = str(meta.get("device"))
        if meta.get("simulated") and not replay:
            warn(f"policy {path} was trained on a SIMULATED profile of {trained_on}, not on measured costs: on real "
                 f"hardware profile and train it there (python scripts/train_policy.py --device {here})")
        if trained_on != here and is_cpu_key(trained_on) and is_cpu_key(here) and not allow_device_mismatch:
            warn(f"policy {path} was trained on {trained_on} ({meta.get('hardware_name')}), this machine is {here}: "
                 f"its costs are another CPU's (train one here with python scripts/train_policy.py --device cpu)")
        elif trained_on != here and not allow_device_mismatch:
            raise SpecPilotError(
                f"policy {path} was trained on device '{meta.get('device')}' ({meta.get('hardware_name')}), this is "
                f"'{here}'; retrain with --device {here} or pass --allow-device-mismatch"
            )
        trained_with = meta.get("draft")
        if draft is not None and trained_with and trained_with != draft:
            raise SpecPilotError(
                f"policy {path} was trained with draft '{trained_with}', not '{draft}'; use --draft matching it, "
                f"pass learned:PATH of a policy for '{draft}', or retrain with --draft"
            )
        trained_for = meta.get("target")
        if (target is not None and trained_for and not meta.get("simulated")
                and target_key(trained_for) != target_key(target)):
            raise SpecPilotError(
                f"policy {path} was trained for the target '{str(trained_for).split(' [')[0]}', not "
                f"'{str(target).split(' [')[0]}': its acceptance features mean that pair's; train one for this pair "
                f"(python scripts/train_policy.py --target T --draft D) or pass learned:PATH")
        missing = [key for key in REQUIRED_KEYS if key not in meta]
        if missing:
            raise SpecPilotError(f"policy file {path} lacks the keys {missing}: not a complete specpilot policy")
        weights_path = path.parent / meta["weights"] if "weights" in meta else path.with_suffix(".safetensors")
        try:
            weights = load_file(str(weights_path))
            policy = cls(meta, weights, str(path), defer=defer)
        except FileNotFoundError:
            raise SpecPilotError(f"policy weights not found: {weights_path}") from None
        except SpecPilotError:
            raise
        except Exception as exc:  # safetensors raises its own error types for truncated or foreign files
            raise SpecPilotError(f"corrupt or incompatible policy weights {weights_path}: {type(exc).__name__}: {exc}") from None
        policy._check_shapes()
        for sub in policy.by_batch.values():
            if sub is not None:
                sub._check_shapes()
        return policy

    def _check_shapes(self) -> None:
        width = len(self.features)
        if self.mean.shape != (width,):
            raise SpecPilotError(f"policy {self.path}: normalisation of {self.mean.shape[0]} features, {width} listed")
        for i, (wt, b) in enumerate(self.layers):
            if wt.ndim != 2 or wt.shape[0] != width or b.shape != (wt.shape[1],):
                raise SpecPilotError(f"policy {self.path}: layer {i} has shape {wt.T.shape}, expected (*, {width})")
            width = wt.shape[1]
        if width != len(self.action_to_k):
            raise SpecPilotError(f"policy {self.path}: {width} outputs but {len(self.action_to_k)} actions")

    def input_bounds(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(low, high, read) per feature of this policy, in its order: the bounds every input is clipped into
        (the trained range and +-clip standard deviations; a pinned feature's training mean) and which
        features it reads (not pinned). Copies."""
        return self._lo.copy(), self._hi.copy(), self._read.copy()

    def feature_scale(self) -> np.ndarray:
        """1 / the training std of each observation feature (FEATURES order); 0 for pinned or unread ones."""
        scale = np.zeros(len(FEATURES))
        scale[self._columns if self._columns is not None else slice(None)] = self.inv_std
        return scale

    def pin_counters(self, values: np.ndarray) -> "LearnedK":
        """An ablation: the hardware counters read as `values` (HW_FEATURES order, e.g. a profile's idle counters)
        whatever the machine's read, so the policy decides as if the machine were in that state."""
        columns = [i for i, f in enumerate(self.features) if f in HW_FEATURES]
        by_name = dict(zip(HW_FEATURES, np.asarray(values, dtype=np.float64)))
        self._pinned_at = (np.array(columns, dtype=np.int64), np.array([by_name[self.features[i]] for i in columns]))
        self.name += "-idle-counters"
        for sub in self.by_batch.values():
            if sub is not None:
                sub.pin_counters(values)
        return self

    def logits(self, obs: np.ndarray) -> np.ndarray:
        """Action logits for one observation (or a batch, shape (n, features)), each from the network that decides
        its batch size (`by_batch`)."""
        if self.by_batch:
            rows = np.atleast_2d(np.asarray(obs, dtype=np.float64))
            out = np.stack([(at_or_below(self.by_batch, batch_of(row)) or self)._logits(row) for row in rows])
            return out if np.ndim(obs) == 2 else out[0]
        return self._logits(obs)

    def _logits(self, obs: np.ndarray) -> np.ndarray:
        x = np.array(obs, dtype=np.float64)
        if self._columns is not None:
            x = x[..., self._columns]
        if self._pinned_at is not None:
            x[..., self._pinned_at[0]] = self._pinned_at[1]
        x = np.where(self._still, self.mean, x)  # a pinned feature may hold anything, NaN included
        return self._forward(np.minimum(np.maximum(x, self._lo), self._hi)).astype(np.float64)

    def _forward(self, x: np.ndarray) -> np.ndarray:
        """Logits (float32) of raw inputs already clipped into the bounds."""
        z = ((x - self.mean) * self.inv_std).astype(np.float32)
        last = len(self._run) - 1
        for i, (wt, b) in enumerate(self._run):
            z = z @ wt + b
            if i < last:
                z = self.act(z)
        return z

    def choose_k(self, obs: np.ndarray) -> int:
        """The k for one observation; with a recorded training range, counts the calls whose input had to be
        clipped into it (or beyond `clip` standard deviations).

        A non-finite input (NaN, inf) in a feature the policy reads raises in `strict` mode (tests); else the
        step drafts nothing (k = 0, never an arbitrary action) and `non_finite` counts it. A pinned feature
        is ignored, whatever it holds.

        The batch's entry of `route` decides: a tuned rule (`defer`) or a network (this one or `by_batch`'s)."""
        decider = self._only or at_or_below(self.route, batch_of(obs))
        if decider is self or isinstance(decider, LearnedK):
            k, self.stop, self.source = decider._decide(obs, self)
            return k
        self.deferred += 1
        k = decider.choose_k(obs)
        self.stop, self.source = decider.stop, getattr(decider, "source", None)
        return k

    def _decide(self, obs: np.ndarray, counts: "LearnedK") -> tuple[int, "StopRule | None", str | None]:
        """(k, stop rule, draft source) of this network for one observation; its calls, clipped and non-finite inputs are
        counted into `counts` (the policy that routed the decision here), whose `strict` applies."""
        x = np.asarray(obs, dtype=np.float64)
        if self._columns is not None:
            x = x[self._columns]
        if self._pinned_at is not None:
            x = x.copy()  # (an ablation: the copy's cost does not matter)
            x[self._pinned_at[0]] = self._pinned_at[1]
        counts.calls += 1
        clipped = np.minimum(np.maximum(x, self._lo), self._hi)
        # one reduction answers both checks: NaN or inf when an input is not finite, > 0 when a read one was clipped
        moved = float(np.abs(clipped - x) @ self._read_weight)
        if moved != 0.0:
            if not math.isfinite(moved):
                bad = ~np.isfinite(x) & ~self._still
                if bad.any():
                    if counts.strict:
                        names = [f for f, b in zip(self.features, bad) if b]
                        raise SpecPilotError(f"learned policy got a non-finite observation in {names[:4]}")
                    counts.non_finite += 1
                    return 0, None, None
                x = np.where(self._still, self.mean, x)  # only pinned features held NaN / inf: ignored
                clipped = np.minimum(np.maximum(x, self._lo), self._hi)
                moved = float(np.abs(clipped - x) @ self._read_weight)
            if self.low is not None and moved > 0.0:
                counts.out_of_range += 1
                counts.clipped_by_feature += (clipped != x) & self._read
        action = int(np.argmax(self._forward(clipped)))
        return (*self.actions.decode(action), self.actions.source(action))

    def reset(self) -> None:
        for rule in self.defer.values():
            if rule is not None:
                rule.reset()

    def update(self, step) -> None:
        for rule in self.defer.values():
            if rule is not None:
                rule.update(step)

    def clipped_features(self) -> dict[str, int]:
        """{feature: decisions in which it was clipped into the trained range}, most often clipped first (the
        features behind `out_of_range`: an unseen context length reads as the longest trained one)."""
        order = np.argsort(-self.clipped_by_feature, kind="stable")
        return {self.features[i]: int(self.clipped_by_feature[i]) for i in order if self.clipped_by_feature[i]}

    def decision_seconds(self, calls: int = 2000) -> float:
        """Mean seconds of one choose_k on a typical (training-mean) observation."""
        obs = np.zeros(len(FEATURES), dtype=np.float32)
        obs[self._columns if self._columns is not None else slice(None)] = self.mean
        self.choose_k(obs)
        t0 = time.perf_counter()
        for _ in range(calls):
            self.choose_k(obs)
        return (time.perf_counter() - t0) / calls


def route_table(defer: dict[int, LengthPolicy | None], by_batch: dict[int, "LearnedK | None"],
                network: "LearnedK") -> dict[int, LengthPolicy]:
    """One table from the two a policy records: at every size either lists, the rule `defer` gives the batch, else
    the network `by_batch` gives it, else `network`. `at_or_below` on it equals both lookups in turn (each table's
    sizes are among its sizes, so the largest listed size <= B of either is found below the merged one)."""
    sizes = sorted(set(defer) | set(by_batch)) or [1]
    return {b: (at_or_below(defer, b) if defer else None) or (at_or_below(by_batch, b) if by_batch else None) or network
            for b in sizes}


def _batch_networks(meta: dict, weights: dict[str, np.ndarray], path: str) -> dict[int, "LearnedK | None"]:
    """{batch size: LearnedK or None} from a policy's `by_batch` entry ({"1": {"phase": "real"}, "4": {"phase":
    "warm-start", "layers": [...], "normalization": {...}}, ...}: an entry without layers is the policy's own network)."""
    networks = {}
    for batch, entry in meta["by_batch"].items():
        try:
            size = int(batch)
        except (TypeError, ValueError):
            size = 0
        if size < 1 or not isinstance(entry, dict) or ("layers" in entry) != ("normalization" in entry):
            raise SpecPilotError(f"policy {path}: by_batch entry {batch!r} is not (batch size >= 1: "
                                 "{phase[, layers, normalization]})")
        if "layers" not in entry:
            networks[size] = None
            continue
        missing = [f"{name}.{part}" for name in entry["layers"] for part in ("weight", "bias")
                   if f"{name}.{part}" not in weights]
        if missing:
            raise SpecPilotError(f"policy {path}: by_batch entry {batch!r}: the weights lack {missing[:2]}")
        sub_meta = {**meta, "layers": entry["layers"], "normalization": entry["normalization"], "by_batch": None,
                    "defer": None}
        networks[size] = LearnedK(sub_meta, weights, path, defer=False)
    return dict(sorted(networks.items()))


def _deferred_rules(defer: dict, k_max: int, path: str) -> dict[int, LengthPolicy | None]:
    """{batch size: rule policy or None} from a policy's `defer` entry ({"1": null, "8": "match:2:3", ...})."""
    rules = {}
    for batch, spec in defer.items():
        try:
            size = int(batch)
        except (TypeError, ValueError):
            size = 0
        if size < 1 or not (spec is None or isinstance(spec, str)) or str(spec).startswith("learned"):
            raise SpecPilotError(f"policy {path}: defer entry {batch!r}: {spec!r} is not (batch size >= 1: rule or null)")
        try:
            rules[size] = None if spec is None else parse_rule(spec, k_max)
        except SpecPilotError as exc:
            raise SpecPilotError(f"policy {path}: defer entry {batch!r}: {exc}") from None
    return dict(sorted(rules.items()))
