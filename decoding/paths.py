"""Where the project keeps its files: one place for the naming conventions every command shares.

Artifacts (cost profiles, traces, tuned rules, policies, draft heads) are looked up in three roots, first
match wins (`find_artifact`):
1. the working directory (`profiles/`, `policies/`, `drafts/` below it: a source checkout, or a user's own);
2. the user folder, `$SPECPILOT_HOME` or else platformdirs' user data folder for "specpilot"
   (`~/.local/share/specpilot` on Linux): where commands write by default outside a source checkout;
3. the installed package's data (`specpilot.policies`, `specpilot.profiles`, `specpilot.drafts`): the
   committed artifacts, found through importlib.resources.
Paths are recorded relative to the working directory when they lie below it, never a machine's absolute path.
"""
from __future__ import annotations

import importlib.resources
import json
import os
import re
import tempfile
from pathlib import Path

from platformdirs import user_data_dir

from .embedded import EMBEDDED_ALIASES, EMBEDDED_NAME, LLAMA_CPP_PREFIX
from .errors import SpecPilotError

PROFILES = Path("profiles")
POLICIES = Path("policies")
DRAFTS = Path("drafts")
KINDS = (PROFILES.name, POLICIES.name, DRAFTS.name)


def user_dir() -> Path:
    """The user folder: $SPECPILOT_HOME, else platformdirs' user data folder of "specpilot"."""
    return Path(os.environ.get("SPECPILOT_HOME") or user_data_dir("specpilot")).expanduser()


def package_dir(kind: str) -> Path | None:
    """The installed package data folder of `kind` ('profiles', 'policies', 'drafts'), or None."""
    try:
        return Path(str(importlib.resources.files(f"specpilot.{kind}")))
    except (ModuleNotFoundError, TypeError):
        return None


def search_roots(kind: str) -> list[Path]:
    """The folders of `kind` in lookup order: working directory, user folder, package data (each once)."""
    roots, seen = [], set()
    for root in (Path(kind), user_dir() / kind, package_dir(kind)):
        if root is not None and root.resolve() not in seen:
            seen.add(root.resolve())
            roots.append(root)
    return roots


def find_artifact(path: str | Path) -> Path:
    """A relative artifact path ('policies/KEY/DRAFT/policy.json') in the first root that holds it; the path as
    given when none does (or when it is absolute or not below an artifact folder), so that errors name it."""
    path = Path(path)
    if path.is_absolute() or not path.parts or path.parts[0] not in KINDS:
        return path
    for root in search_roots(path.parts[0]):
        found = root.joinpath(*path.parts[1:])
        if found.exists():
            return found
    return path


def output_dir(kind: str) -> Path:
    """Where a command writes a `kind` folder by default: `kind` in the working directory when that folder is
    there (a source checkout, or a user's own), else in the user folder (`user_dir`)."""
    return Path(kind) if Path(kind).is_dir() else user_dir() / kind


def slug(text: str) -> str:
    """'ngram:3' -> 'ngram-3': a file-name-safe, lower-case form of a draft or device name."""
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()


def target_key(target: str | None) -> str | None:
    """The file-name key of a target in its artifacts' names: None for the embedded target (the project's own
    artifacts carry no target in their names), else a slug of the model's name: 'meta-llama/Llama-3.1-8B' ->
    'llama-3-1-8b', 'random-init:configs/small-target' -> 'random-small-target', '/m/tiny.gguf' -> 'tiny'; llama.cpp's
    'llama.cpp:embedded' -> 'llamacpp', 'llama.cpp:/m/tiny.gguf' -> 'llamacpp-tiny'."""
    if target is None:
        return None
    name = str(target).split(" [")[0].strip()  # without the kernel mark the loader adds
    if name.startswith(LLAMA_CPP_PREFIX):  # the engine is part of the key: torch and llama.cpp artifacts never mix
        inner = target_key(name[len(LLAMA_CPP_PREFIX):] or None)
        return "llamacpp" + (f"-{inner}" if inner else "")
    if name in EMBEDDED_ALIASES or name == EMBEDDED_NAME:
        return None
    kind, sep, rest = name.partition(":")
    if sep and kind in ("random", "random-init"):
        return "random-" + slug(Path(rest).name)
    return slug(Path(name).name.removesuffix(".gguf")) or "target"


def pair_name(draft_name: str, target: str | None = None) -> str:
    """The (target, draft) pair's name in artifact paths: 'ngram-3' for the embedded target's, else 'TARGET-ngram-3'
    (acceptance traces, tuned rules and policies belong to the pair)."""
    key = target_key(target)
    return f"{key}-{slug(draft_name)}" if key else slug(draft_name)


def traces_path(draft_name: str, temperature: float = 0.0, target: str | None = None) -> Path:
    """profiles/traces-PAIR.json: the greedy acceptance traces recorded with this target and draft (`pair_name`);
    traces-PAIR-tT.json those of sampled decoding at temperature T."""
    return find_artifact(PROFILES / f"traces-{pair_name(draft_name, target)}{temperature_suffix(temperature)}.json")


def rules_path(device_key: str, draft_name: str, temperature: float = 0.0, root: str | Path | None = None,
               target: str | None = None) -> Path:
    """policies/DEVICE/PAIR/rules.json: the rules tuned on greedy traces; rules-tT.json on sampled ones at T (found
    in the lookup roots, or below `root`: where a command writes them, see `output_dir`)."""
    return policy_dir(device_key, draft_name, root, target) / f"rules{temperature_suffix(temperature)}.json"


def temperature_suffix(temperature: float) -> str:
    """'' for greedy decoding, '-tT' for sampling at temperature T: the file-name mark of sampled traces and rules."""
    return f"-t{temperature:g}" if temperature > 0 else ""


def profile_path(device_key: str, draft_name: str | None = None, target: str | None = None) -> Path:
    """profiles/DEVICE-PAIR.json when that target and draft have their own profile (`pair_name`), else
    profiles/DEVICE.json (in the first root that holds it, see `find_artifact`). Another target than the embedded
    one never falls back to DEVICE.json unless it is that target's own (a profile records its target)."""
    if draft_name:
        own = find_artifact(PROFILES / f"{device_key}-{pair_name(draft_name, target)}.json")
        if own.exists() or target_key(target):
            return own
    return find_artifact(PROFILES / f"{device_key}.json")


def load_profile_path(device_key: str, draft_name: str, load: str, target: str | None = None) -> Path:
    """profiles/load/DEVICE-PAIR-load-LOAD.json: the cost profile measured beside a background load
    (profile_device.py --background-load LOAD --out profiles/load), in the first root that holds it. The hybrid
    drafter's steps cost what the head's do (the same verify pass with hidden states, the same head tokens;
    env/sources.py prices the lookup's), so without a profile of its own it reads the default head's."""
    own = find_artifact(PROFILES / "load" / f"{device_key}-{pair_name(draft_name, target)}-load-{load}.json")
    if draft_name == "hybrid" and not own.exists():
        head = load_profile_path(device_key, "default", load, target)
        return head if head.exists() else own
    return own


def policy_dir(device_key: str, draft_name: str, root: str | Path | None = None, target: str | None = None) -> Path:
    """ROOT/DEVICE/PAIR: where a device's policy for one target and drafter (`pair_name`; and its run, its rules, its
    engine tables) lives. Without a root: the first of the lookup roots that holds it (`find_artifact`), else
    policies/ in the working directory."""
    if root is None:
        return find_artifact(POLICIES / device_key / pair_name(draft_name, target))
    return Path(root) / device_key / pair_name(draft_name, target)


def draft_choice_path(device_key: str, target: str | None = None, root: str | Path | None = None) -> Path:
    """ROOT/DEVICE/auto/choice.json (TARGET-auto for another target): the draft `--draft auto` decodes with on this
    device, chosen by agents/pair_select.py (without a root: the first lookup root that holds it)."""
    return policy_dir(device_key, "auto", root, target) / "choice.json"


def relative(path: str | Path) -> str:
    """A path as a report should record it: relative to the working directory when it lies below it."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write `text` to `path` through a temporary file beside it and one rename: a reader (or a kill)
    sees the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_text_file(path: str | Path, what: str = "file", hint: str = "") -> str:
    """The UTF-8 text of a file; missing, unreadable or not UTF-8 is a one-line SpecPilotError naming `what`."""
    path = Path(path)
    if not path.is_file():
        raise SpecPilotError(f"{what} not found: {path}" + (f" ({hint})" if hint else ""))
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise SpecPilotError(f"{what} {path} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except OSError as exc:
        raise SpecPilotError(f"cannot read {what} {path}: {exc.strerror}") from None


class Checkpoint:
    """A JSONL file of finished units of a long run, each line flushed to disk before the next unit starts, so that
    a kill loses at most the unit in progress. The first line holds the run's signature (its settings): resuming
    from a file written by other settings is refused, in one line. A torn last line (a kill mid-write) is dropped."""

    def __init__(self, path: str | Path, signature: dict, resume: bool, what: str = "run"):
        self.path = Path(path)
        self.rows: list[dict] = []
        """The finished units read back when resuming (empty on a fresh start)."""
        if resume and self.path.exists():
            lines = self.path.read_text().splitlines()
            try:
                head = json.loads(lines[0]) if lines else {}
            except json.JSONDecodeError:
                head = {}
            if head.get("signature") != json.loads(json.dumps(signature, default=str)):
                raise SpecPilotError(f"--resume: {self.path} is from another {what} (other settings); "
                                     "run the same command, or delete it to start over")
            for n, line in enumerate(lines[1:], 2):
                try:
                    self.rows.append(json.loads(line))
                except json.JSONDecodeError:
                    if n == len(lines):
                        break
                    raise SpecPilotError(f"--resume: {self.path} line {n} is not JSON; delete the file to start over") from None
            # rewrite without a torn tail, so that the next append starts on a line of its own
            atomic_write_text(self.path, "".join(json.dumps(x) + "\n" for x in [head] + self.rows))
        else:
            atomic_write_text(self.path, json.dumps({"signature": signature}, default=str) + "\n")

    def append(self, row: dict) -> None:
        """One finished unit as one line, on disk before this returns."""
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def remove(self) -> None:
        """Once the run's results are written, the checkpoint has nothing they lack."""
        self.path.unlink(missing_ok=True)


def read_json_file(path: str | Path, what: str = "JSON file", hint: str = "", keys: tuple[str, ...] = ()) -> dict:
    """A JSON object from a file, with `keys` present; anything else is a one-line SpecPilotError."""
    text = read_text_file(path, what, hint)
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise SpecPilotError(f"corrupt {what} {path}: {exc}") from None
    if not isinstance(data, dict):
        raise SpecPilotError(f"corrupt {what} {path}: not a JSON object")
    missing = [k for k in keys if k not in data]
    if missing:
        raise SpecPilotError(f"corrupt {what} {path}: missing {', '.join(missing)}")
    return data
