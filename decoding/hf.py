"""The project's loop inside transformers' `generate`, one argument away:

    from specpilot.decoding.hf import specpilot_generate
    out = model.generate(**inputs, custom_generate=specpilot_generate, draft="ngram", policy="learned",
                         max_new_tokens=64)

transformers prepares the inputs and the generation config as for any decoding, then hands the loop to
`specpilot_generate`: the one `speculative_step` loop of `specpilot.decoding.loop` with the caller's model as the
target, any drafter of the project (`ngram[:N]`, `default`: the trained head, or a drafter object) and any length
policy (`learned`, `static:K`, `heuristic`, ... or a policy object). It honours the generation config's
`max_new_tokens` / `max_length`, EOS and pad ids, `do_sample` / `temperature` / `top_k` / `top_p`, a left-padded
batch with its `attention_mask`, and `return_dict_in_generate` (the output's `sequences`, and the speculation's
statistics as `output.speculation`). What it cannot honour (beams, other logits processors or stopping criteria,
transformers' own drafting options) is a one-line error.

The same loop ships as a Hub-style folder (`CUSTOM_GENERATE_REPO/custom_generate/generate.py`):
`model.generate(..., custom_generate=str(CUSTOM_GENERATE_REPO), trust_remote_code=True)`; that route also passes
`streamer=` through (transformers 5.x drops `streamer` before it reaches a callable: pass `specpilot_streamer=` to
the callable instead).

For transformers' own assisted loop (`prompt_lookup_num_tokens=` or `assistant_model=` users), the block
`with policy_in_assisted_generation(model, "learned"):` sets its number of draft tokens per step from the policy.

The caller's model is left as it was: `kernels="small-rows"` (opt-in) runs its linear layers through the
project's CPU product (`SmallRowLinear`) for this call only and restores them after it, even on an error.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from .drafters import NgramDrafter
from .errors import SpecPilotError
from .hardware import device_of
from .loop import BatchView, Row, StepResult, generate
from .models import SmallRowLinear, Target, load_draft, use_small_row_gemm
from .observation import ObservationBuilder
from .policies import LengthPolicy
from .policy_spec import parse_policy
from .sampling import Sampling
from .threads import THREAD_MODES, ThreadGovernor

CUSTOM_GENERATE_REPO = Path(__file__).with_name("hub")
"""A folder in the Hub's `custom_generate` layout (`custom_generate/generate.py`), for `custom_generate=str(...)`."""

SUPPORTED_PROCESSORS = frozenset({"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper"})
"""The logits processors the loop applies itself (Sampling): any other one it cannot honour."""
SUPPORTED_STOPPING = frozenset({"MaxLengthCriteria", "EosTokenCriteria"})
"""The stopping criteria the loop applies itself (the budget, EOS)."""
KERNELS = (None, "small-rows")


def _check_config(config, logits_processor, stopping_criteria, model_kwargs: dict) -> None:
    """One-line errors for what the project's loop does not do."""
    if getattr(config, "num_beams", 1) not in (None, 1) or getattr(config, "num_return_sequences", 1) not in (None, 1):
        raise SpecPilotError("specpilot_generate decodes one sequence per prompt: num_beams and num_return_sequences "
                             "must be 1")
    if getattr(config, "prompt_lookup_num_tokens", None) or model_kwargs.get("assistant_model") is not None:
        raise SpecPilotError("specpilot_generate drafts with its own drafter: drop prompt_lookup_num_tokens / "
                             "assistant_model and pass draft='ngram' (or 'default', or a drafter)")
    other = sorted({type(p).__name__ for p in logits_processor or []} - SUPPORTED_PROCESSORS)
    if other:
        raise SpecPilotError(f"specpilot_generate applies temperature, top-k and top-p only; it cannot honour "
                             f"{', '.join(other)} (unset the option that adds it)")
    stops = sorted({type(c).__name__ for c in stopping_criteria or []} - SUPPORTED_STOPPING)
    if stops:
        raise SpecPilotError(f"specpilot_generate stops at max_new_tokens and EOS only; it cannot honour {', '.join(stops)}")


def _eos_ids(config) -> list[int]:
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    if isinstance(eos, torch.Tensor):
        eos = eos.tolist()
    return [int(e) for e in ([eos] if isinstance(eos, int) else eos)]


def _sampling(config) -> Sampling:
    if not getattr(config, "do_sample", False):
        return Sampling()
    return Sampling(temperature=float(config.temperature if config.temperature is not None else 1.0),
                    top_k=int(config.top_k or 0), top_p=float(config.top_p if config.top_p is not None else 1.0))


def _drafter(draft, target: Target):
    if draft is None or isinstance(draft, str) and draft in ("", "none"):
        return None
    if not isinstance(draft, str):
        return draft  # a drafter object (the project's protocol)
    if draft.startswith("ngram") or draft in ("default", "head", "hybrid"):
        return load_draft(draft, target)
    raise SpecPilotError(f"draft='{draft}': specpilot_generate takes ngram, ngram:N, default (the trained head), hybrid (both) or a "
                         "drafter object (a draft LM: specpilot.decoding.drafters.ModelDrafter)")


def _policy(policy, drafter, target: Target, k_max: int | None, temperature: float = 0.0) -> LengthPolicy:
    if isinstance(policy, LengthPolicy):
        return policy
    # a learned policy is refused for another drafter than it was trained with (its acceptance features differ);
    # a tuned rule (best-rule) is read for this drafter and temperature
    kwargs = {"device": device_of(str(target.device))[0], "draft": getattr(drafter, "name", None)}
    return parse_policy(str(policy), **({"k_max": k_max} if k_max else {}), temperature=temperature, **kwargs)


@contextlib.contextmanager
def kernels_for(model, kernels: str | None):
    """The project's CPU kernels on `model` for the duration of the block (opt-in), undone after it."""
    if kernels not in KERNELS:
        raise SpecPilotError(f"kernels={kernels!r}: one of {', '.join(map(repr, KERNELS))}")
    # swapped only where the caller has not swapped it already (then it stays as the caller left it)
    swapped = (kernels == "small-rows" and model.device.type == "cpu"
               and not any(isinstance(m, SmallRowLinear) for m in model.modules()))
    if swapped:
        use_small_row_gemm(model)
    try:
        yield
    finally:
        if swapped:
            use_small_row_gemm(model, on=False)


def specpilot_generate(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
                       draft="ngram", policy="learned", k_max: int | None = None, seed: int | None = None,
                       kernels: str | None = None, specpilot_streamer=None, threads: str = "auto", **model_kwargs):
    """transformers' `custom_generate` callable: decode `input_ids` (a batch, left-padded with its attention_mask
    in `model_kwargs`) with the project's speculative loop. `draft`, `policy`, `k_max`, `seed` (sampling; default:
    drawn from torch's global generator, so `torch.manual_seed` governs it), `kernels` and `specpilot_streamer`
    reach it as extra `generate` keyword arguments. `threads="auto"` (a model on the CPU): torch's threads follow the
    cores other processes leave free during the call (decoding/threads.py; beside one busy core two threads ran ~10x
    slower), and torch's count is back to the caller's after it; "fixed": torch's count as set. Returns the `sequences` tensor, or with
    `return_dict_in_generate` transformers' output with `sequences` and `.speculation` (the loop's statistics)."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    config = generation_config
    _check_config(config, logits_processor, stopping_criteria, model_kwargs)
    if input_ids.dim() != 2 or input_ids.shape[0] < 1:
        raise SpecPilotError(f"input_ids must be a (batch, length) tensor, got shape {tuple(input_ids.shape)}")
    batch, length = input_ids.shape
    mask = model_kwargs.get("attention_mask")
    mask = torch.ones_like(input_ids) if mask is None else mask
    prompts = [row[m.bool()].tolist() for row, m in zip(input_ids, mask)]
    max_length = getattr(config, "max_length", None)
    max_new = (max_length - length) if max_length else getattr(config, "max_new_tokens", None)
    if not max_new or max_new < 1:
        raise SpecPilotError(f"nothing to generate: max_new_tokens / max_length leave {max_new} tokens after the prompt")
    if specpilot_streamer is not None and batch > 1:
        raise SpecPilotError("a streamer streams one sequence: pass a batch of one prompt")
    eos = _eos_ids(config)
    pad = getattr(config, "pad_token_id", None)
    pad = int(pad) if pad is not None else (eos[0] if eos else 0)
    if threads not in THREAD_MODES:
        raise SpecPilotError(f"threads={threads!r}: expected one of {', '.join(THREAD_MODES)}")
    on_cpu = threads == "auto" and torch.device(getattr(model, "device", "cpu")).type == "cpu"
    governor = ThreadGovernor(most=torch.get_num_threads()) if on_cpu else None
    target = Target(model=model, tokenizer=None, name=str(getattr(model, "name_or_path", "") or type(model).__name__),
                    eos_ids=frozenset(eos), threads=governor)
    drafter = _drafter(draft, target)
    sampling = _sampling(config)
    length_policy = _policy(policy, drafter, target, k_max, sampling.temperature)
    if seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
    on_step = None
    if specpilot_streamer is not None:
        specpilot_streamer.put(input_ids.cpu())
        on_step = lambda step: specpilot_streamer.put(torch.tensor(step.new_tokens, dtype=torch.long))  # noqa: E731
    try:
        with kernels_for(model, kernels), torch.no_grad():
            result = generate(target, drafter, length_policy, prompts if batch > 1 else prompts[0], max_new,
                              sampling, seed=seed, on_step=on_step)
    finally:
        if governor is not None:
            governor.restore()  # the caller's thread count
    if specpilot_streamer is not None:
        specpilot_streamer.end()
    rows = result.token_ids if batch > 1 else [result.token_ids]
    width = max(len(r) for r in rows)
    new = torch.full((batch, width), pad, dtype=input_ids.dtype, device=input_ids.device)
    for i, r in enumerate(rows):
        new[i, : len(r)] = torch.tensor(r, dtype=input_ids.dtype)
    sequences = torch.cat([input_ids, new], dim=1)
    if not getattr(config, "return_dict_in_generate", False):
        return sequences
    out = GenerateDecoderOnlyOutput(sequences=sequences)
    out.speculation = {**result.stats.as_dict(), "policy": length_policy.name, "draft": getattr(drafter, "name", None),
                       "ks": [s.k for s in result.steps]}
    return out


def generate_from_folder(model, **arguments):
    """The Hub folder's entry (`custom_generate/generate.py`): transformers hands it every argument of `generate`
    unprepared; they go back through `generate` with the callable, `streamer` passed on as `specpilot_streamer`."""
    arguments.pop("custom_generate", None)
    streamer = arguments.pop("streamer", None)
    arguments = {k: v for k, v in arguments.items() if v is not None}
    return model.generate(custom_generate=specpilot_generate, specpilot_streamer=streamer, **arguments)


class _LoopView(BatchView):
    """What the observation builder reads of a DecodeState, for one sequence of transformers' assisted loop."""

    def __init__(self, input_ids: torch.Tensor, prompt_len: int, max_new_tokens: int, lookup: NgramDrafter):
        self.rows = [Row(input_ids[0], int(input_ids.shape[1]), prompt_len, max_new_tokens)]
        self.active, self.draft, self.batched = [0], lookup, False


class PolicyCandidates:
    """transformers' candidate generator (prompt lookup's or an assistant model's) with its number of draft tokens
    set before every step by a length policy, which sees the project's observation of the sequence (acceptance
    history from transformers' `num_matches`, the measured draft and verify seconds, the context's n-gram match as
    prompt lookup `ngram:3` sees it, the hardware counters). k = 0 makes the step a plain one."""

    def __init__(self, base, policy: LengthPolicy, prompt_len: int, max_new_tokens: int):
        self.base, self.policy = base, policy
        self.prompt_len, self.max_new_tokens = prompt_len, max_new_tokens
        self.observer = ObservationBuilder(k_max=policy.k_max)
        self.lookup = NgramDrafter(3)
        self.ks: list[int] = []
        """The k of every step, as drafted."""
        self._started = False
        self._pending: tuple | None = None

    def __getattr__(self, name):
        return getattr(self.base, name)

    def _set_count(self, k: int) -> None:
        for attribute in ("num_output_tokens", "num_assistant_tokens"):
            if hasattr(self.base, attribute):
                setattr(self.base, attribute, k)

    def get_candidates(self, input_ids: torch.Tensor, **kwargs):
        if input_ids.shape[0] != 1:
            raise SpecPilotError("transformers' assisted generation decodes one sequence; so does its policy")
        view = _LoopView(input_ids, self.prompt_len, self.max_new_tokens, self.lookup)
        if not self._started:
            self.policy.reset()
            self.observer.reset(view)
            self._started = True
        k = int(self.policy.choose_k(self.observer.build(view)))
        t0 = time.perf_counter()
        if k <= 0:
            candidates, logits = input_ids, None
        else:
            self._set_count(k)
            candidates, logits = self.base.get_candidates(input_ids, **kwargs)
        drafted = int(candidates.shape[1] - input_ids.shape[1])
        if drafted > k:  # a generator that proposes more than it was told: keep the first k
            candidates = candidates[:, : input_ids.shape[1] + max(k, 0)]
            logits = logits[:, : max(k, 0)] if logits is not None else None
            drafted = max(k, 0)
        now = time.perf_counter()
        self._pending = (k, drafted, int(input_ids.shape[1]), now - t0, now)
        self.ks.append(drafted)
        return candidates, logits

    def update_candidate_strategy(self, input_ids: torch.Tensor, scores, num_matches: int) -> None:
        k, drafted, before, draft_s, verified_from = self._pending
        verify_s = time.perf_counter() - verified_from
        if drafted:
            self.base.update_candidate_strategy(input_ids, scores, num_matches)
        new = input_ids[0, before:].tolist()
        step = StepResult(k=drafted, k_requested=k, accepted=int(num_matches), new_tokens=new, draft_s=draft_s,
                          verify_s=verify_s, context_len=before)
        self.policy.update(step)
        self.observer.push(step)


@contextlib.contextmanager
def policy_in_assisted_generation(model, policy="learned", k_max: int | None = None):
    """Inside the block, transformers' own assisted generation on `model` (`prompt_lookup_num_tokens=`, or
    `assistant_model=`) takes its number of draft tokens per step from `policy` (a spelling or a LengthPolicy; the
    learned policy of this device for prompt lookup by default). Yields the list of PolicyCandidates the block's
    `generate` calls made (their `ks`).

    The route: transformers builds its candidate generator in `GenerationMixin._get_candidate_generator` (private,
    checked on transformers 5.x by tests/test_hf_generate.py); the block wraps what it returns, on this model only,
    and removes the wrapper after the block."""
    original = model._get_candidate_generator
    made: list[PolicyCandidates] = []
    target = Target(model=model, tokenizer=None, name=str(getattr(model, "name_or_path", "")))
    length_policy = policy if isinstance(policy, LengthPolicy) else _policy(policy, NgramDrafter(3), target, k_max)

    def wrapped(generation_config, input_ids, *args, **kwargs):
        base = original(generation_config, input_ids, *args, **kwargs)
        prompt_len = int(input_ids.shape[1])
        made.append(PolicyCandidates(base, length_policy, prompt_len, int(generation_config.max_length) - prompt_len))
        return made[-1]

    model._get_candidate_generator = wrapped
    try:
        yield made
    finally:
        del model._get_candidate_generator
