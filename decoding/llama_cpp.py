"""The target run by llama.cpp (llama-cpp-python): a GGUF model decoded natively, no dequantisation.

`LlamaCppTarget` is a `Target` whose `model` answers the loop's forward call (`model(input_ids=..., cache=...)`
-> `.logits`, a (1, n, vocab) float32 tensor) by one `llama_decode` of the n tokens over llama.cpp's own KV
cache, and whose cache crops rejected drafts with `llama_memory_seq_rm`. So the one loop (decoding/loop.py:
`speculative_step`, `generate`), its drafters, rules, observations, the Gymnasium env and the benchmark run on
llama.cpp unchanged. One row at a time (llama.cpp's batch of sequences is not wired).

Identity: a verify of k+1 tokens must round as k+1 one-token steps do. llama-cpp-python is built for that
(decoding/llama_build.py: no llamafile sgemm, no repacked weights) and the context runs without flash
attention (its CPU kernel splits the KV range of a one-token query across threads); one thread count for the
one-token and the batched decode, following the free cores (`llama_threads_governor`; the logits do not depend on
it). tests/test_llama_cpp.py checks the logits bit for bit and the tokens against llama-cpp-python's own greedy
`generate`; every load checks the identity once (`verify_rounds_as_steps`).

Needs the optional extra: `python scripts/install_llama.py` (builds llama-cpp-python for this CPU).
"""
from __future__ import annotations

import ctypes
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from .errors import SpecPilotError
from .target import Target, eos_ids_of
from .threads import ThreadGovernor

LOGITS_ALL_UP_TO = 64
"""A forward of at most this many tokens returns logits at every position (a verify); a longer one (a prefill)
only at its last, so that prefill does not pay for a vocabulary-wide output per prompt token."""


def import_llama_cpp():
    """The llama_cpp module, or a one-line error that says how to install it."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise SpecPilotError("the llama.cpp engine needs llama-cpp-python: run `python scripts/install_llama.py` "
                             f"(builds it for this CPU, ~4 min) ({exc})") from exc
    return llama_cpp


class LlamaCache:
    """llama.cpp's KV cache of sequence 0, seen as the loop's cache: its length and a crop."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self.length = 0
        llm._ctx.kv_cache_seq_rm(-1, 0, -1)

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, n: int) -> None:
        """Keep the first `n` positions (negative: drop the last -n), as transformers' DynamicCache.crop."""
        keep = self.length + n if n < 0 else n
        if keep < self.length:
            self.llm._ctx.kv_cache_seq_rm(0, keep, -1)
            self.length = keep

    def batch_select_indices(self, index) -> None:
        if len(index) != 1:
            raise SpecPilotError("the llama.cpp engine decodes one row at a time")


@dataclass
class LlamaForward:
    """The loop's forward call over a llama-cpp-python `Llama`: decode the fed tokens at the cache's end."""

    llm: object
    config: SimpleNamespace = field(default_factory=SimpleNamespace)
    _specpilot_cache_kwarg: str = "cache"

    def __post_init__(self) -> None:  # read once: each is a call into the library
        self.n_ctx, self.n_vocab, self.n_batch = int(self.llm.n_ctx()), int(self.llm.n_vocab()), int(self.llm.n_batch)
        self._array_types: dict[int, type] = {}
        self.decodes = 0
        """Forward calls so far: a `LlamaOutput` reads the buffer only while it is the latest."""

    def __call__(self, input_ids: torch.Tensor, cache: LlamaCache, use_cache: bool = True,
                 output_hidden_states: bool = False, attention_mask=None, position_ids=None):
        if attention_mask is not None or input_ids.shape[0] != 1:
            raise SpecPilotError("the llama.cpp engine decodes one row at a time (no batches)")
        if output_hidden_states:
            raise SpecPilotError("the llama.cpp engine gives no hidden states: use a draft that needs none (ngram)")
        tokens = input_ids[0].tolist()
        n = len(tokens)
        llm = self.llm
        all_logits = n <= LOGITS_ALL_UP_TO
        if cache.length + n > self.n_ctx:
            raise SpecPilotError(f"the context ({cache.length} + {n} tokens) exceeds llama.cpp's n_ctx {self.n_ctx}")
        for at in range(0, n, self.n_batch):  # a long prefill in chunks of llama.cpp's batch (logits of the last)
            chunk = tokens[at:at + self.n_batch]
            llm._batch.set_batch(batch=chunk, n_past=cache.length, logits_all=all_logits)
            llm._ctx.decode(llm._batch)
            cache.length += len(chunk)
        self.decodes += 1
        return LlamaOutput(self, n if all_logits else 1, self.decodes)

    def _floats(self, n: int) -> type:
        """ctypes' float array type of n elements, made once per n (np.ctypeslib.as_array makes one per call)."""
        kind = self._array_types.get(n)
        if kind is None:
            kind = self._array_types[n] = ctypes.c_float * n
        return kind

    def live_logits(self, rows: int) -> np.ndarray:
        """(rows, vocab) view of llama.cpp's logits buffer: valid until the next decode."""
        pointer = self.llm._ctx.get_logits()
        flat = np.frombuffer(self._floats(rows * self.n_vocab).from_address(ctypes.addressof(pointer.contents)),
                             dtype=np.float32)
        return flat.reshape(rows, self.n_vocab)


class LlamaOutput:
    """One forward's result, read off llama.cpp's logits buffer when asked: `greedy_tokens` (the argmax per
    position, all a greedy verify needs: no copy of rows x 49,152 floats) or `logits` (copied once, then kept).
    Either must be asked before the target's next decode (which overwrites the buffer): later, an error."""

    hidden_states = None

    def __init__(self, forward: LlamaForward, rows: int, decode: int) -> None:
        self._forward, self._rows, self._decode = forward, rows, decode
        self._logits: torch.Tensor | None = None

    def _live(self) -> np.ndarray:
        if self._forward.decodes != self._decode:
            raise SpecPilotError("llama.cpp's logits of this forward were overwritten by a later decode: read them first")
        return self._forward.live_logits(self._rows)

    @property
    def logits(self) -> torch.Tensor:
        """(1, rows, vocab) float32, a copy."""
        if self._logits is None:
            self._logits = torch.from_numpy(self._live().copy())[None]
        return self._logits

    @property
    def greedy_tokens(self) -> np.ndarray:
        """(1, rows) the argmax at each position (the first maximum, as torch's)."""
        if self._logits is not None:
            return self._logits.numpy().argmax(axis=-1)
        return self._live().argmax(axis=-1)[None]


class LlamaCppTarget(Target):
    """A GGUF target decoded by llama.cpp; the tokenizer is transformers' (same ids, the chat template)."""

    max_rows = 1
    hidden_states = False

    def new_cache(self) -> LlamaCache:
        return LlamaCache(self.model.llm)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def context_window(self) -> int:
        return self.model.n_ctx

    @property
    def vocab_size(self) -> int:
        return self.model.n_vocab


def default_threads() -> int:
    """llama.cpp's thread count: the cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def open_llama(gguf: str | Path, n_ctx: int = 0, threads: int | None = None, **kwargs):
    """A llama-cpp-python `Llama` over `gguf` with the numerics the identity needs (no flash attention, the same
    thread count for one-token and batched decodes). `n_ctx` 0: the model's training context (8192 for the
    embedded SmolLM2). `kwargs` go to `Llama` (draft_model= for its speculation)."""
    llama_cpp = import_llama_cpp()
    path = Path(gguf).expanduser()
    if not path.is_file():
        raise SpecPilotError(f"GGUF file not found: {gguf}")
    threads = threads or default_threads()
    if kwargs.get("draft_model") is not None:
        # llama-cpp-python 0.3.36 keeps every position's logits with a draft model but sizes its score buffer by the
        # logits_all argument: a prompt longer than n_batch crashes in `eval` unless it is set
        kwargs.setdefault("logits_all", True)
    try:
        return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                               n_threads_batch=threads, flash_attn=False, verbose=False, **kwargs)
    except ValueError as exc:
        raise SpecPilotError(f"llama.cpp could not load {path}: {exc}") from exc


def llama_threads_governor(llm) -> ThreadGovernor:
    """A ThreadGovernor (decoding/threads.py) over llama.cpp's context threads: before each decode of the loop they
    follow the cores a co-running load leaves free (2 threads beside a 1-core load decoded 10x slower here,
    reports/llama-cpp.md). The logits do not depend on the count (tests/test_llama_cpp.py)."""
    llama_cpp = import_llama_cpp()
    most = int(llm.n_threads)

    def set_threads(n: int) -> None:
        llama_cpp.llama_set_n_threads(llm._ctx.ctx, n, n)

    return ThreadGovernor(most=most, set_threads=set_threads, threads=most)


def llama_target(gguf: Path, tokenizer, name: str, n_ctx: int = 0, threads: int | None = None,
                 follow_free_cores: bool = True) -> LlamaCppTarget:
    """The target of one GGUF file run by llama.cpp; `tokenizer`: transformers' (the same ids, the chat template).
    `models.load_target("llama.cpp:...")` resolves the file and the tokenizer and calls this. `follow_free_cores`:
    its threads follow the free cores (`llama_threads_governor`; `--threads fixed`: False)."""
    llm = open_llama(gguf, n_ctx=n_ctx, threads=threads)
    model = LlamaForward(llm, SimpleNamespace(max_position_embeddings=int(llm.n_ctx()), gguf=str(gguf)))
    eos = eos_ids_of(None, tokenizer) | {int(llm.token_eos())}
    target = LlamaCppTarget(model=model, tokenizer=tokenizer, name=name, eos_ids=frozenset(eos),
                            threads=llama_threads_governor(llm) if follow_free_cores else None)
    if not verify_rounds_as_steps(target):
        warnings.warn("this llama-cpp-python build's batched decode does not round as one-token steps (built without "
                      "`python scripts/install_llama.py`?): speculative greedy output may differ from plain", stacklevel=2)
    return target


def verify_rounds_as_steps(target: LlamaCppTarget, tokens: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)) -> bool:
    """Whether a decode of 5 tokens gives the logits of 5 one-token decodes bit for bit (after a 3-token prefix):
    the identity a lossless verify needs. About 10 one-token decodes; the cache is left empty."""
    cache = target.new_cache()
    ids = [t % target.vocab_size for t in tokens]
    target.model(torch.tensor([ids[:3]]), cache)
    chunk = target.model(torch.tensor([ids[3:]]), cache).logits[0]
    cache.crop(3)
    steps = torch.cat([target.model(torch.tensor([[t]]), cache).logits[0] for t in ids[3:]])
    cache.crop(0)
    return torch.equal(chunk, steps)


def engine_generate(llm, prompt: list[int], max_new_tokens: int, eos_ids=frozenset()) -> tuple[list[int], float]:
    """llama-cpp-python's own greedy decoding (`Llama.generate`, temperature 0; a `Llama` opened with a
    `draft_model` speculates as that engine does): what a user of the engine gets, and its seconds. As in the
    loop (decoding/loop.py `start`), the prompt but its last token is decoded first, untimed: the seconds are those
    of the new tokens (the engine's prefix cache then decodes only the last prompt token)."""
    llm.reset()
    if len(prompt) > 1:
        llm.eval(prompt[:-1])
    out: list[int] = []
    t0 = time.perf_counter()
    # reset=True with the cache holding prompt[:-1]: the engine's prefix match keeps it and decodes the last token
    for token in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        if not out and llm.n_tokens != len(prompt):
            raise SpecPilotError("llama-cpp-python decoded the prompt twice (its prefix cache was not reused)")
        out.append(int(token))
        if token in eos_ids or len(out) >= max_new_tokens:
            break
    return out, time.perf_counter() - t0


@dataclass
class EngineDecoding:
    """A benchmark row that is llama-cpp-python's own decoding, not the loop: `engine` (plain `Llama.generate`),
    `engine-lookup:N` (its `LlamaPromptLookupDecoding`, `num_pred_tokens` N, default 10, as its README shows) or
    `engine-specpilot:POLICY` (its speculation with k from a specpilot policy, SpecPilotDraftModel). Greedy, one
    row, a llama.cpp target; a draft model runs on a second `Llama` of the same GGUF (llama-cpp-python keeps every
    position's logits when one is set). Both draft models are in decoding/llama_draft.py."""

    num_pred_tokens: int = 0
    name: str = "engine"
    k_max: int = 0
    stop = None
    draft_model: object = None
    """`engine-specpilot:POLICY`: a SpecPilotDraftModel (decoding/llama_draft.py) instead of the prompt lookup."""
    _llm: object = None

    def reset(self) -> None:
        pass

    def choose_k(self, obs) -> int:
        return 0

    def update(self, step) -> None:
        pass

    def run_engine(self, target, prompt: list[int], max_new_tokens: int) -> tuple[list[int], float, list]:
        """(tokens, seconds, [(k, accepted) per drafted round]) of this engine decoding `prompt`."""
        if not isinstance(target, LlamaCppTarget):
            raise SpecPilotError(f"policy '{self.name}' is llama.cpp's own decoding: it needs --target llama.cpp:...")
        if target.threads is not None:  # the engine's own thread count, not what the loop's governor last set
            target.threads.restore()
        if not self.num_pred_tokens and self.draft_model is None:
            tokens, seconds = engine_generate(target.model.llm, prompt, max_new_tokens, target.eos_ids)
            return tokens, seconds, []
        if self._llm is None:
            from .llama_draft import CountingLookup

            draft = self.draft_model if self.draft_model is not None else CountingLookup(self.num_pred_tokens)
            self._llm = open_llama(target.model.config.gguf, n_ctx=target.context_window, draft_model=draft)
        if self.draft_model is not None:  # its observation's budget is the run's
            self.draft_model.max_new_tokens = max_new_tokens
        tokens, seconds = engine_generate(self._llm, prompt, max_new_tokens, target.eos_ids)
        return tokens, seconds, list(self._llm.draft_model.log.rounds)  # a new prompt restarted the log


def engine_policy(text: str, inner=None) -> EngineDecoding:
    """`engine`, `engine-lookup[:N]` or `engine-specpilot:POLICY` (`inner`: that policy, built by policy_spec)."""
    name, _, arg = text.strip().partition(":")
    if name == "engine" and not arg:
        return EngineDecoding()
    if name == "engine-specpilot" and inner is not None:
        from .llama_draft import SpecPilotDraftModel  # the loop's drafter and observations

        return EngineDecoding(name=text.strip(), draft_model=SpecPilotDraftModel(inner))
    if name == "engine-lookup":
        try:
            n = int(arg or 10)
        except ValueError:
            n = 0
        if n >= 1:
            return EngineDecoding(num_pred_tokens=n, name=f"engine-lookup:{n}")
    raise SpecPilotError(f"'{text}': llama.cpp's own decoding is `engine`, `engine-lookup:N` (N >= 1) or "
                         "`engine-specpilot:POLICY`")
