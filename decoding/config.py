"""Config dataclasses whose attribute docstrings become the CLI help: one source for both."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
import textwrap
import typing
from typing import Callable

from .errors import SpecPilotError


@dataclasses.dataclass
class ReplayInputs:
    """The fields of every replay command (no model runs): whose cost profile, traces, rules and policy it reads."""

    device: str = "cpu"
    """Machine key of the cost profile, traces, tuned rules and policy: cpu (this CPU's key), or a key such as a100."""
    draft: str = "ngram:3"
    """The draft: its traces (profiles/traces-DRAFT.json), tuned rules and policy (policies/DEVICE/DRAFT/)."""


@dataclasses.dataclass
class ModelOptions:
    """The fields of every command that loads the target: where and how it runs."""

    device: str = "auto"
    """Device: auto | cpu | cuda[:N] | a device key such as h100 (must be present)."""
    dtype: str = "auto"
    """Model dtype: auto (fp32 on CPU, bf16 on GPU) | float32 | bfloat16 | float16."""
    gemm: str = "auto"
    """CPU fp32 matrix products: auto (small-rows on the CPUs of decoding.models.SMALL_ROW_CPUS, else linear) | linear (torch's) | small-rows
    (decoding.models.SmallRowLinear, W @ x^T for 1-4 rows, one padded to two: cheaper plain steps and verify passes
    of 1-3 drafted tokens on this CPU; `python -m specpilot.bench.gemm` times both)."""
    threads: str = "auto"
    """CPU threads: auto (before each target pass torch's threads are set to the cores other processes leave free, as
    the hardware monitor reads them: beside one busy core two threads were ~10x slower than one: python -m specpilot.bench.threads) | fixed
    (torch's own count throughout)."""
    allow_device_mismatch: bool = False
    """Let a learned policy trained on another device run."""


def field_docs(cls) -> dict[str, str]:
    """{field name: the docstring written under it} for a dataclass."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, after in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
                    docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def build_parser(cls, description: str | None = None) -> argparse.ArgumentParser:
    """An argparse parser with one --flag per field (underscores become dashes)."""
    parser = argparse.ArgumentParser(description=description or (cls.__doc__ or "").strip().splitlines()[0])
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        help_text = docs.get(f.name, "").replace("%", "%%")  # argparse formats help with %: "55%" would crash --help
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        kind = hints[f.name]
        args = typing.get_args(kind)
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
            continue
        base = next((a for a in args if a is not type(None)), kind) if args else kind
        if typing.get_origin(kind) is list:
            parser.add_argument(flag, type=args[0], action="append", default=list(default), help=f"{help_text} (repeatable)")
        elif typing.get_origin(kind) is typing.Literal:
            parser.add_argument(flag, choices=list(args), default=default, help=f"{help_text} (default: {default})")
        else:
            parser.add_argument(flag, type=base, default=default, help=f"{help_text} (default: {default})")
    return parser


def parse_config(cls, argv=None, description: str | None = None):
    namespace = build_parser(cls, description).parse_args(argv)
    return cls(**vars(namespace))


def parse_ints(text: str, flag: str, minimum: int = 1) -> list[int]:
    """'1,2,4' -> [1, 2, 4]; anything else (empty, non-integers, values < minimum) is a one-line error naming the flag."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpecPilotError(f"{flag} must be comma-separated integers, got '{text}'") from None
    if not values or min(values) < minimum:
        raise SpecPilotError(f"{flag} must list integers >= {minimum}, got '{text}'")
    return values


def at_least(minimum: int, **flags: int) -> None:
    """Each value >= minimum, else a one-line error naming its flag: at_least(1, repeats=0) -> '--repeats must be >= 1'."""
    for name, value in flags.items():
        if value < minimum:
            raise SpecPilotError(f"--{name.replace('_', '-')} must be >= {minimum}, got {value}")


def warn(message: str | None) -> None:
    """One 'warning:' line on stderr (nothing for None)."""
    if message:
        print(f"warning: {message}", file=sys.stderr)


def run_cli(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Run a CLI main: a SpecPilotError becomes a one-line message and exit code 2, no traceback."""
    try:
        return main(argv)
    except SpecPilotError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
