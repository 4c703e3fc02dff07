"""The target model with what the decoding loop needs to know about it (one engine's model or another's)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import SpecPilotError


@dataclass
class Target:
    """The target model with what the loop needs to know about it."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    eos_ids: frozenset[int] = field(default_factory=frozenset)
    threads: Any = None
    """A ThreadGovernor (decoding/threads.py) the loop applies before each target pass; None = torch's count as set."""
    max_rows = None
    """The most rows one forward decodes (None: any batch; llama.cpp's: 1)."""
    hidden_states = True
    """Whether a forward gives the hidden states a draft head reads (llama.cpp's does not)."""

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def context_window(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 0)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    def new_cache(self):
        """An empty KV cache for the model (transformers' DynamicCache; another engine brings its own)."""
        from transformers import DynamicCache  # transformers loads in seconds: only when a model runs

        return DynamicCache(config=self.model.config)

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Token ids of a prompt, optionally wrapped in the chat template as one user turn. A model without
        a tokenizer (random init, `random:CONFIG`) reads the prompt's UTF-8 bytes as ids (mod its vocab)."""
        if not prompt or not prompt.strip():
            raise SpecPilotError("the prompt is empty")
        tok = self.tokenizer
        if tok is None:
            return [b % self.vocab_size for b in prompt.encode("utf-8")]
        if chat:
            if not getattr(tok, "chat_template", None):
                raise SpecPilotError(f"--chat: the tokenizer of {self.name} has no chat template")
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
        else:
            ids = tok(prompt)["input_ids"]
        return [int(t) for t in (ids[0] if ids and isinstance(ids[0], list) else ids)]

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return " ".join(str(i) for i in ids)
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def eos_ids_of(model, tokenizer) -> frozenset[int]:
    ids = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is None:
            continue
        ids.update([value] if isinstance(value, int) else value)
    return frozenset(int(i) for i in ids)
