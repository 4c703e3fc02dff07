"""The llama.cpp engine (decoding/llama_cpp.py): the one loop over llama-cpp-python's decode and KV cache.

Lossless means the engine's own output: a verify of k+1 tokens must give the logits k+1 one-token steps give
(bit for bit, so greedy tokens match llama-cpp-python's plain `generate` token for token), and sampled output
follows the target's law with the power to catch a broken verifier. Skipped where llama-cpp-python is not
installed (`python scripts/install_llama.py`; CI installs it).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_sampling import expected_noise, verify_broken_no_residual

from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.paths import pair_name, target_key

SPEC = "llama.cpp:embedded"


def test_llama_cpp_artifacts_never_share_a_key_with_the_torch_loops():
    """Keyed by engine: the embedded target's torch artifacts carry no key, llama.cpp's carry `llamacpp`."""
    assert target_key("embedded") is None and target_key(SPEC) == "llamacpp"
    assert target_key("llama.cpp:/m/tiny.gguf") == "llamacpp-tiny" != target_key("/m/tiny.gguf")
    assert target_key("llama.cpp:embedded [SmolLM2 Q4_1]") == "llamacpp"  # the loaded target's name
    assert pair_name("ngram:3", SPEC) == "llamacpp-ngram-3" != pair_name("ngram:3", "embedded")


@pytest.fixture(scope="module")
def target():
    pytest.importorskip("llama_cpp")
    from specpilot.decoding.models import load_target

    return load_target(SPEC)


PROMPTS = [  # (text, chat): code to edit (lookup drafts well), an answer that ends with EOS early, chat
    ("Rename the variable x to total and return the whole code:\n\ndef add_all(numbers):\n    x = 0\n"
     "    for n in numbers:\n        x = x + n\n    return x\n", True),
    ("What is the capital of France? Answer in one word.", True),
    ("Tell me about the moon.", True),
    ("def fibonacci(n):\n", False),
]


def encoded(target):
    return [target.encode(text, chat=chat) for text, chat in PROMPTS]


def test_a_verify_gives_the_logits_of_one_token_steps_bit_for_bit(target):
    """The identity the engine reaches (decoding/llama_build.py, no flash attention): a forward of 6 tokens over
    the cache gives at each position the logits of 6 one-token decodes, exactly; cropping the cache and
    decoding again gives them again."""
    for prompt in encoded(target)[:3]:
        cache = target.new_cache()
        target.model(torch.tensor([prompt]), cache)
        start = cache.get_seq_length()
        fed = prompt[-3:] + prompt[:3]
        chunk = target.model(torch.tensor([fed]), cache).logits[0]
        cache.crop(start)
        steps = torch.cat([target.model(torch.tensor([[t]]), cache).logits[0] for t in fed])
        assert chunk.shape == steps.shape == (6, target.vocab_size)
        assert torch.equal(chunk, steps)
        assert cache.get_seq_length() == start + 6


class RandomK:
    """A length policy that drafts a random k per step (0-6): rejections, crops and bonus tokens everywhere."""

    name, k_max, stop = "random", 6, None

    def __init__(self, seed):
        self.g = torch.Generator().manual_seed(seed)

    def reset(self):
        pass

    def choose_k(self, obs):
        return int(torch.randint(0, 7, (1,), generator=self.g))

    def update(self, step):
        pass


def test_greedy_loop_equals_llama_cpps_own_plain_greedy_token_for_token(target):
    """The loop over llama.cpp (n-gram draft, fixed and random k) gives exactly what llama-cpp-python's own
    greedy `generate` gives, including a row that ends with EOS before its budget."""
    from specpilot.decoding.drafters import NgramDrafter
    from specpilot.decoding.llama_cpp import engine_generate
    from specpilot.decoding.loop import generate
    from specpilot.decoding.policies import StaticK

    budget, ended_early, accepted = 48, 0, 0
    for i, prompt in enumerate(encoded(target)):
        plain, _ = engine_generate(target.model.llm, prompt, budget, target.eos_ids)
        ended_early += len(plain) < budget and plain[-1] in target.eos_ids
        for policy in (StaticK(0), StaticK(4), RandomK(i)):
            out = generate(target, NgramDrafter(3), policy, prompt, budget)
            assert out.token_ids == plain, (i, policy.name)
            accepted += sum(s.accepted for s in out.steps)
    assert ended_early >= 1 and accepted > 20  # EOS before the budget was exercised, and drafts were kept


def test_the_llama_cpp_target_refuses_what_it_cannot_do_in_one_line(target, tmp_path):
    from specpilot.decoding.drafters import NgramDrafter
    from specpilot.decoding.loop import generate
    from specpilot.decoding.models import load_target
    from specpilot.decoding.policies import StaticK

    with pytest.raises(SpecPilotError, match="one row at a time"):
        generate(target, NgramDrafter(3), StaticK(2), [[1, 2, 3], [4, 5, 6]], 4)
    with pytest.raises(SpecPilotError, match="no hidden states"):
        target.model(torch.tensor([[1, 2]]), target.new_cache(), output_hidden_states=True)
    with pytest.raises(SpecPilotError, match="an existing file"):
        load_target("llama.cpp:" + str(tmp_path / "missing.gguf"))
    with pytest.raises(SpecPilotError, match="runs on the CPU"):
        load_target(SPEC, device="cuda")


@pytest.mark.slow
def test_sampled_output_follows_the_targets_law_and_a_broken_verifier_does_not(target, monkeypatch):
    """Temperature 1, top-k 4, k = 2 from the n-gram draft on "A B C A B" (it proposes " C", which the target gives
    about 0.5): the first two tokens over 1000 runs through `generate` follow the target's exact joint law (by
    enumeration, from llama.cpp's own logits); with the classic bug (resample from p, not the residual) the same
    runs miss it by more than twice the tolerance."""
    import specpilot.decoding.loop
    from specpilot.decoding.drafters import NgramDrafter
    from specpilot.decoding.loop import generate
    from specpilot.decoding.policies import StaticK
    from specpilot.decoding.sampling import Sampling, probs_from_logits

    sampling = Sampling(temperature=1.0, top_k=4)
    prompt = target.tokenizer("A B C A B")["input_ids"]
    assert len(prompt) == 5 and prompt[1] == prompt[4]  # the lookup matches and proposes prompt[2]

    def law_after(ids):
        return probs_from_logits(target.model(torch.tensor([ids]), target.new_cache()).logits[0, -1], sampling).double()

    first = law_after(prompt)
    assert 0.3 < float(first[prompt[2]]) < 0.7  # rejections and residuals both matter
    exact = {}  # (first token, second token) -> probability: 4 x 4 cells under top-k 4
    for a in torch.nonzero(first).flatten().tolist():
        second = law_after(prompt + [a])
        exact.update({(a, b): float(first[a] * second[b]) for b in torch.nonzero(second).flatten().tolist()})

    def observed(seed0, n):
        counts, accepted = {}, 0
        for run in range(n):
            out = generate(target, NgramDrafter(3), StaticK(2), prompt, 2, sampling, seed=seed0 + run)
            pair = tuple(out.token_ids)
            counts[pair] = counts.get(pair, 0) + 1 / n
            accepted += out.steps[0].accepted
        return counts, accepted

    def tv(law):
        return 0.5 * sum(abs(law.get(c, 0.0) - exact.get(c, 0.0)) for c in law.keys() | exact.keys())

    n = 1000
    law, accepted = observed(0, n)
    assert 0 < accepted < n  # accepted and rejected proposals both ran
    assert law.keys() <= exact.keys()  # nothing outside the target's support
    tolerance = 1.6 * expected_noise(torch.tensor(list(exact.values())), n)
    assert tv(law) < tolerance, (tv(law), tolerance)
    monkeypatch.setattr(specpilot.decoding.loop, "verify_sampling", verify_broken_no_residual)
    broken, _ = observed(10**6, n)
    assert tv(broken) > 2 * tolerance, (tv(broken), tolerance)


def test_the_build_names_each_instruction_set_by_the_cpus_flags_and_keeps_amx_and_batched_kernels_off():
    """scripts/install_llama.py's CMAKE_ARGS: x86 SIMD options on exactly where /proc/cpuinfo lists them (no native
    detection, which picked AMX and crashed on a KVM Xeon), the kernels that would round a verify differently off;
    the pinned version is the extra's."""
    import tomllib
    from pathlib import Path

    from specpilot.decoding.llama_build import LLAMA_CPP_PYTHON, cmake_args, cpu_flags

    flags = cpu_flags("processor : 0\nflags\t\t: fpu sse avx avx2 fma f16c amx_tile\n")
    assert flags == {"fpu", "sse", "avx", "avx2", "fma", "f16c", "amx_tile"}
    args = cmake_args(flags, "x86_64").split()
    for on in ("GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C"):
        assert f"-D{on}=ON" in args
    for off in ("GGML_AVX512", "GGML_AVX512_VNNI", "GGML_NATIVE", "GGML_AMX_TILE", "GGML_LLAMAFILE", "GGML_CPU_REPACK"):
        assert f"-D{off}=OFF" in args
    arm = cmake_args(set(), "aarch64")
    assert "GGML_AVX" not in arm and "AMX" not in arm and "-DGGML_LLAMAFILE=OFF" in arm
    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["llama"] == [LLAMA_CPP_PYTHON]


def test_a_forwards_argmax_is_its_logits_argmax_and_a_later_decode_makes_both_unreadable(target):
    """The loop's greedy verify reads the argmax straight off llama.cpp's buffer (no copy of the logits): the same
    tokens as the copied logits' argmax, and a result read after the next decode (which overwrites the buffer) is
    an error, not stale numbers."""
    cache = target.new_cache()
    prompt = encoded(target)[0]
    target.model(torch.tensor([prompt[:-4]]), cache)
    out = target.model(torch.tensor([prompt[-4:]]), cache)
    tokens = out.greedy_tokens
    assert tokens.shape == (1, 4) and (tokens == out.logits.argmax(-1).numpy()).all()
    late = target.model(torch.tensor([prompt[-3:]]), cache)  # three more positions: a new buffer's contents
    with pytest.raises(SpecPilotError, match="overwritten"):
        late_read = target.model(torch.tensor([prompt[-2:]]), cache)
        late.greedy_tokens
    assert late_read.logits.shape == (1, 2, target.vocab_size)
    assert (out.logits.argmax(-1).numpy() == tokens).all()  # copied before the later decodes: kept, readable


def test_the_identity_check_tells_a_build_that_rounds_a_verify_differently(target, monkeypatch):
    """This build passes the load-time check; a forward whose batched logits move by one ulp fails it."""
    from specpilot.decoding.llama_cpp import verify_rounds_as_steps

    assert verify_rounds_as_steps(target)
    forward = type(target.model).__call__

    def off_when_batched(self, input_ids, cache, **kwargs):
        out = forward(self, input_ids, cache, **kwargs)
        if input_ids.shape[1] > 1:
            return SimpleNamespace(logits=torch.nextafter(out.logits, torch.full_like(out.logits, float("inf"))))
        return out

    monkeypatch.setattr(type(target.model), "__call__", off_when_batched)
    assert not verify_rounds_as_steps(target)


def test_the_draft_model_inside_llama_cpp_python_is_lossless_and_reads_each_rounds_acceptance(target):
    """`Llama(..., draft_model=SpecPilotDraftModel(policy))`: llama-cpp-python's own speculation with k from a
    policy (random here, 0-6 per round) gives plain greedy's tokens, and the acceptance the draft model infers
    from the next call equals, round by round, the drafted tokens' agreement with the plain output."""
    from specpilot.decoding.drafters import NgramDrafter
    from specpilot.decoding.llama_cpp import engine_generate, open_llama
    from specpilot.decoding.llama_draft import SpecPilotDraftModel

    class Recording(NgramDrafter):
        def propose(self, context, k, *args, **kwargs):
            out = super().propose(context, k, *args, **kwargs)
            self.seen.append((len(context), out.tokens.tolist()))
            return out

    drafter = Recording(3)
    model = SpecPilotDraftModel(RandomK(1), drafter, max_new_tokens=48)
    llm = open_llama(target.model.config.gguf, n_ctx=4096, draft_model=model)
    checked = kept_total = 0
    for prompt in encoded(target)[:3]:
        plain, _ = engine_generate(target.model.llm, prompt, 48, target.eos_ids)
        drafter.seen = []
        out, _ = engine_generate(llm, prompt, 48, target.eos_ids)
        assert out == plain
        full = prompt + plain
        drafted = [(length, tokens) for length, tokens in drafter.seen if tokens]
        rounds = [(k, kept) for k, kept in model.log.rounds if k]  # a round of k = 0 drafts nothing
        assert len(drafted) - 1 <= len(rounds) <= len(drafted)  # the last round's outcome comes with no next call
        for (length, tokens), (k, kept) in zip(drafted, rounds):
            truth = full[length:length + len(tokens)]
            agree = next((i for i, (a, b) in enumerate(zip(tokens, truth)) if a != b), min(len(tokens), len(truth)))
            assert (k, kept) == (len(tokens), agree)
            checked += k > 0
            kept_total += kept
    assert checked >= 8 and kept_total > 0


def test_llama_cpps_threads_follow_the_free_cores_and_the_logits_do_not_depend_on_them(target):
    """The loop's thread governor drives llama.cpp's context threads (beside a 1-core load, 2 fixed threads decoded
    10x slower, reports/llama-cpp.md): a monitor reading half the CPU taken sets one thread, and the logits are the
    two-thread ones bit for bit; restore() gives the count back."""
    import llama_cpp
    import numpy as np

    from specpilot.decoding.hardware import HW_FEATURES

    governor, ctx = target.threads, target.model.llm._ctx.ctx
    assert governor is not None and llama_cpp.llama_n_threads(ctx) == governor.most
    prompt = encoded(target)[2]

    def logits():
        cache = target.new_cache()
        target.model(torch.tensor([prompt]), cache)
        return target.model(torch.tensor([prompt[-4:]]), cache).logits

    class Busy:  # another process takes half the CPU time
        def read(self):
            reading = np.zeros(len(HW_FEATURES), dtype=np.float32)
            reading[HW_FEATURES.index("hw_cpu_other_util")] = 0.5
            return reading

    before = logits()
    saved, governor._monitor = governor._monitor, Busy()
    try:
        governor.cores = 2
        assert governor.apply() == 1 and llama_cpp.llama_n_threads(ctx) == 1
        assert torch.equal(logits(), before)
    finally:
        governor._monitor = saved
        governor.restore()
    assert llama_cpp.llama_n_threads(ctx) == governor.most


def test_llama_cpp_pythons_own_lookup_row_gives_plain_tokens_and_logs_its_rounds(target):
    """The benchmark's `engine-lookup:4` (llama-cpp-python's LlamaPromptLookupDecoding on a second `Llama`): with
    this build its output is plain greedy's, and its logged rounds add up: every round kept at most what it drafted,
    the code-editing prompt kept some, and the rounds' tokens (kept + the target's one) are at most the output."""
    from specpilot.decoding.llama_cpp import engine_generate, engine_policy

    row = engine_policy("engine-lookup:4")
    for i, prompt in enumerate(encoded(target)[:2]):
        plain, _ = engine_generate(target.model.llm, prompt, 48, target.eos_ids)
        out, seconds, rounds = row.run_engine(target, prompt, 48)
        assert out == plain and seconds > 0
        assert all(0 <= kept <= k <= 4 for k, kept in rounds)
        assert sum(kept + 1 for _, kept in rounds) <= len(out)
        if i == 0:
            assert sum(kept for _, kept in rounds) > 0
