"""specpilot: a learned controller for the draft length k of speculative decoding, per hardware device.

One import name for the whole project. The subpackages live in the repository's top-level folders and are
mapped here by setuptools (`pyproject.toml`, `package-dir`):

- `specpilot.decoding`: the decoder library (models, sampling, verify, drafters, loop, length policies, LearnedK);
- `specpilot.env`: the Gymnasium environments (real loop and replay), reward, traces, oracle;
- `specpilot.bench`: profiling, benchmarks, reports, engine tables;
- `specpilot.distill`: training the draft head;
- `specpilot.agents`: PPO per device, warm start, export, the train command;
- `specpilot.policies`, `specpilot.profiles`, `specpilot.drafts`: the committed artifacts (package data).
"""
__version__ = "0.2.0"

import os as _os

_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isdir(_os.path.join(_root, "decoding")):
    # a source checkout on sys.path without an install (PYTHONPATH=., as scripts/gpu_check.sh sets): the
    # subpackages are the checkout's folders, exactly as the editable install maps them
    __path__.append(_root)  # noqa: F821 (a package's __path__)
