"""Shared fixtures: tiny random-init Llama models (config only, instant) and the embedded target."""
from __future__ import annotations

import contextlib
import os
import random
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# the user folder of specpilot.decoding.paths: a test never reads or writes the real one
os.environ["SPECPILOT_HOME"] = tempfile.mkdtemp(prefix="specpilot-home-")
torch.set_num_threads(1)  # tiny models: threads only add contention (and CI has 2 cores)

from specpilot.decoding.hardware import cpu_key  # noqa: E402
from specpilot.decoding.models import Target  # noqa: E402

CPU_KEY = cpu_key()
"""This machine's key: where a command run with --device cpu writes its policy (OUT/CPU_KEY/DRAFT)."""

COMMITTED_CPU_KEY = sorted(p.name for p in (Path(__file__).resolve().parents[1] / "policies").glob("cpu-*"))[0]
"""The key of a CPU a committed CPU policy was trained on (the first by name; not necessarily this machine's)."""

TINY_VOCAB = 64


def tiny_llama(vocab: int = TINY_VOCAB, seed: int = 0, layers: int = 2, window: int = 512, dtype=torch.float64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=window,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharper distributions than the default init, so greedy argmax gaps are wide
        model.lm_head.weight.mul_(25.0)
    return model.to(dtype).eval()


def perturbed_copy(model, scale: float, seed: int = 1):
    """A draft that agrees with the model often but not always."""
    import copy

    torch.manual_seed(seed)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(scale * p.std() * torch.randn_like(p))
    return draft.eval()


def tiny_target(model, eos: int | None = None) -> Target:
    return Target(model=model, tokenizer=None, name="tiny", eos_ids=frozenset() if eos is None else frozenset({eos}))


@torch.no_grad()
def plain_greedy(model, prompt: list[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
    """Reference: the target's own greedy decoding, full recompute every token (no cache at all)."""
    ids = list(prompt)
    out = []
    for _ in range(max_new_tokens):
        token = int(model(torch.tensor([ids], device=model.device)).logits[0, -1].argmax())
        out.append(token)
        ids.append(token)
        if token == eos:
            break
    return out


class RandomK:
    """A length policy that picks k at random in [0, k_max + 3] (beyond the budget too)."""

    name = "random"
    stop = None

    def __init__(self, k_max: int = 8, seed: int = 0):
        self.k_max = k_max
        self.rng = random.Random(seed)

    def reset(self):
        pass

    def choose_k(self, obs):
        return self.rng.randint(0, self.k_max + 3)

    def update(self, step):
        pass


@pytest.fixture(scope="session")
def tiny_pair():
    target = tiny_llama()
    return target, perturbed_copy(target, 0.15)


@pytest.fixture(scope="session")
def embedded_target():
    from specpilot.decoding.models import load_target

    return load_target("embedded", dtype="float32", device="cpu")


def byte_tokenizer(shift: int = 0):
    """A real fast tokenizer with 256 byte tokens + <eos> (offline); `shift` permutes the ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    alphabet = sorted(alphabet)
    alphabet = alphabet[shift:] + alphabet[:shift]
    vocab = {"<eos>": 0, **{ch: i + 1 for i, ch in enumerate(alphabet)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    return fast


def save_tiny_model(folder, seed=0, window=512, shift=0):
    model = tiny_llama(vocab=257, seed=seed, window=window, dtype=torch.float32)
    model.config.eos_token_id = 0
    model.generation_config.eos_token_id = 0
    model.save_pretrained(folder)
    byte_tokenizer(shift).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-models")
    return {
        "target": save_tiny_model(root / "target", seed=0),
        "draft": save_tiny_model(root / "draft", seed=0),  # same weights: full acceptance
        "other_tokenizer": save_tiny_model(root / "other", seed=1, shift=7),
        "short_window": save_tiny_model(root / "short", seed=0, window=16),
    }


def stretch_traces(k: int, n: int = 8, length: int = 36):
    """Hand-made acceptance traces: stretches of 6 positions where prompt lookup matches 3 tokens and all k drafts
    are right, alternating with stretches where it matches 1 token and every draft is wrong (row q shifted by 2q)."""
    from specpilot.env.oracle import Trace

    out = []
    for q in range(n):
        good = [((i + 2 * q) // 6) % 2 == 0 for i in range(length)]
        out.append(Trace(f"t{q}", "c", list(range(10)), list(range(100 + q, 100 + q + length)),
                         [k if g else 0 for g in good], [k] * length, match_lens=[3 if g else 1 for g in good], k_max=k))
    return out


@contextlib.contextmanager
def repeatable_measurements(monkeypatch, k_max: int):
    """For gymnasium's check_env, which steps twice from one seed and wants the same observation: a real env's are
    measured (step seconds, the hardware monitor's counters), so the loop's clock ticks 1 ms a reading and the
    counters are held fixed. Yields the observation builder to make the env with."""
    from types import SimpleNamespace

    from specpilot.decoding import loop
    from specpilot.decoding.hardware import neutral_counters
    from specpilot.decoding.observation import ObservationBuilder
    from specpilot.env.replay_env import FixedMonitor

    ticks = iter(range(10**12))
    with monkeypatch.context() as patch:
        patch.setattr(loop, "time", SimpleNamespace(perf_counter=lambda: next(ticks) * 1e-3))
        yield ObservationBuilder(k_max, monitor=FixedMonitor(neutral_counters()))
