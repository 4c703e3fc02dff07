"""The project's loop inside transformers' `generate` (`custom_generate`): token-identical to transformers' own
greedy decoding on the embedded model (one prompt, a left-padded batch of prompts of different lengths, EOS before
the budget; the n-gram draft and the trained head; the callable and the Hub folder), the target's law when
sampling (with the power to catch a broken verifier), the caller's model left as it was, bad arguments as one-line
errors."""
from __future__ import annotations

import pytest
import torch
import transformers
from test_sampling import (
    V_SHARP,
    exact_two_token_distribution,
    expected_noise,
    sharp_pair,
    total_variation,
    verify_broken_no_residual,
)

from specpilot.decoding.drafters import ModelDrafter
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.hf import CUSTOM_GENERATE_REPO, specpilot_generate
from specpilot.decoding.models import load_model
from specpilot.decoding.sampling import Sampling

PROMPTS = ["Write a Python function that reverses a string.",
           "Answer with one word, yes or no: is water wet?",
           "Translate to French: the cat sleeps on the mat, and the dog sleeps on the mat too."]


@pytest.fixture(scope="module")
def hf():
    model, tokenizer, _ = load_model(None)
    tokenizer.padding_side = "left"
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in PROMPTS]
    return model, tokenizer, texts


def plain(model, inputs, **kwargs):
    return model.generate(**inputs, do_sample=False, **kwargs)


@pytest.mark.embedded
@pytest.mark.parametrize("draft,policy", [("ngram", "learned-idle-counters"), ("ngram", "static:4"), ("default", "static:2"),
                                          # the head's policy: k and a stop level per step (its counters pinned to
                                          # the idle profile's, so that what it drafts does not hang on this
                                          # machine's load: a loaded machine may rightly be told k = 0 throughout)
                                          ("default", "learned-idle-counters"),
                                          ("ngram", "best-rule"), ("default", "best-rule")])  # the tuned engine rules
def test_one_prompt_is_token_identical_to_transformers_greedy(hf, draft, policy):
    model, tokenizer, texts = hf
    inputs = tokenizer(texts[0], return_tensors="pt")
    expected = plain(model, inputs, max_new_tokens=32)
    out = model.generate(**inputs, do_sample=False, max_new_tokens=32, custom_generate=specpilot_generate, draft=draft,
                         policy=policy, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.speculation["policy"] == policy
    assert sum(out.speculation["ks"]) > 0  # it did speculate: the identity covers drafted and verified tokens


@pytest.mark.embedded
def test_a_left_padded_batch_with_eos_before_the_budget_is_token_identical(hf):
    model, tokenizer, texts = hf
    inputs = tokenizer(texts, return_tensors="pt", padding=True)
    assert (inputs["attention_mask"] == 0).any()  # prompts of different lengths: left padding
    expected = plain(model, inputs, max_new_tokens=40)
    eos = model.generation_config.eos_token_id
    new = expected[:, inputs["input_ids"].shape[1]:]
    assert (new == eos).any(dim=1).sum() >= 1 and new.shape[1] == 40  # one row ends early, another runs to the budget
    for draft, policy in (("ngram", "static:3"), ("ngram", "learned"), ("default", "static:1")):
        got = model.generate(**inputs, do_sample=False, max_new_tokens=40, custom_generate=specpilot_generate,
                             draft=draft, policy=policy)
        assert torch.equal(got, expected), (draft, policy)


@pytest.mark.embedded
def test_the_hub_folder_runs_the_same_loop_and_passes_the_streamer(hf):
    model, tokenizer, texts = hf
    inputs = tokenizer(texts[2], return_tensors="pt")
    expected = plain(model, inputs, max_new_tokens=24)

    class Collect(transformers.generation.streamers.BaseStreamer):
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.flatten().tolist())

        def end(self):
            self.ended = True

    streamer = Collect()
    got = model.generate(**inputs, do_sample=False, max_new_tokens=24, custom_generate=str(CUSTOM_GENERATE_REPO),
                         trust_remote_code=True, draft="ngram", policy="static:3", streamer=streamer)
    assert torch.equal(got, expected)
    assert streamer.ended and streamer.chunks[0] == inputs["input_ids"][0].tolist()
    assert sum(streamer.chunks[1:], []) == expected[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.mark.embedded
def test_the_callers_model_is_left_as_it_was(hf):
    model, tokenizer, texts = hf
    before = [type(m) for m in model.modules()], model.config._attn_implementation
    inputs = tokenizer(texts[0], return_tensors="pt")
    expected = plain(model, inputs, max_new_tokens=12)
    got = model.generate(**inputs, do_sample=False, max_new_tokens=12, custom_generate=specpilot_generate,
                         policy="static:3", kernels="small-rows")
    assert torch.equal(got, expected)  # the CPU kernel swap is the same arithmetic (to summation order) ...
    assert ([type(m) for m in model.modules()], model.config._attn_implementation) == before  # ... and undone

    def boom(*args, **kwargs):
        raise RuntimeError("draft failed")

    class Broken:
        name = "broken"
        needs_hidden = False
        propose = propose_batch = boom

        def reset(self, *args):
            pass

    with pytest.raises(RuntimeError, match="draft failed"):
        model.generate(**inputs, do_sample=False, max_new_tokens=12, custom_generate=specpilot_generate,
                       draft=Broken(), policy="static:3", kernels="small-rows")
    assert [type(m) for m in model.modules()] == before[0]  # undone on an error too


@pytest.mark.embedded
@pytest.mark.parametrize("kwargs,message", [
    ({"num_beams": 2}, "num_beams and num_return_sequences must be 1"),
    ({"repetition_penalty": 1.3}, "cannot honour RepetitionPenaltyLogitsProcessor"),
    ({"prompt_lookup_num_tokens": 5}, "drop prompt_lookup_num_tokens"),
    ({"draft": "bogus-model"}, "draft='bogus-model'"),
    ({"policy": "static:99"}, "outside [0, k_max"),
    ({"kernels": "fast"}, "kernels='fast'"),
    ({"draft": "ngram:2", "policy": "learned"}, "and draft 'ngram:2'"),  # no policy for that pair anywhere
])
def test_bad_arguments_are_one_line_errors(hf, kwargs, message):
    model, tokenizer, texts = hf
    inputs = tokenizer(texts[0], return_tensors="pt")
    args = {"do_sample": False, "max_new_tokens": 4, "custom_generate": specpilot_generate, "policy": "static:2", **kwargs}
    with pytest.raises(SpecPilotError) as error:
        model.generate(**inputs, **args)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_sampling_through_generate_follows_the_targets_law_and_a_broken_verifier_does_not(monkeypatch):
    """do_sample with temperature and top-k, through transformers' generate: the first two tokens follow the target's
    exact law (by enumeration); with the classic verifier bug (resample from p, not the residual) they miss it by
    more than twice the tolerance."""
    import specpilot.decoding.loop

    target_model, draft_model = sharp_pair()
    prompt = [1, 2, 3, 1, 2]
    exact = exact_two_token_distribution(target_model, prompt, Sampling(temperature=1.0, top_k=5))
    n = 600
    tolerance = 1.6 * expected_noise(exact, n)

    def law(seed0: int) -> torch.Tensor:
        counts = torch.zeros(V_SHARP, V_SHARP, dtype=torch.float64)
        drafter = ModelDrafter(draft_model, "d", V_SHARP)
        for s in range(n):
            out = target_model.generate(input_ids=torch.tensor([prompt]), do_sample=True, temperature=1.0, top_k=5,
                                        top_p=1.0, max_new_tokens=2, pad_token_id=0, custom_generate=specpilot_generate,
                                        draft=drafter, policy="static:2", seed=seed0 + s)
            a, b = out[0, len(prompt):].tolist()
            counts[a, b] += 1
        return counts / n

    assert total_variation(law(0), exact) < tolerance
    monkeypatch.setattr(specpilot.decoding.loop, "verify_sampling", verify_broken_no_residual)
    assert total_variation(law(10**6), exact) > 2 * tolerance


def test_the_transformers_version_is_one_this_entry_point_was_checked_with():
    """`specpilot_generate` relies on how generate hands a callable its arguments (checked on 5.x: extra keyword
    arguments reach it by its signature, `streamer` does not); another major version must be checked again."""
    major = int(transformers.__version__.split(".")[0])
    assert major == 5, transformers.__version__


@pytest.mark.embedded
def test_transformers_assisted_loop_takes_its_draft_length_from_the_policy(hf):
    """Inside `policy_in_assisted_generation`, transformers' own prompt lookup drafts exactly what the policy asks
    each step (static:2: never more than 2, and 2 where the lookup finds that much; static:0: nothing), stays
    token-identical to plain greedy decoding, and the model is unpatched after the block."""
    from specpilot.decoding.hf import policy_in_assisted_generation

    model, tokenizer, texts = hf
    inputs = tokenizer(texts[2], return_tensors="pt")
    expected = plain(model, inputs, max_new_tokens=32)
    for spelling in ("static:2", "learned", "static:0"):
        with policy_in_assisted_generation(model, spelling) as made:
            got = plain(model, inputs, max_new_tokens=32, prompt_lookup_num_tokens=10)
        assert torch.equal(got, expected), spelling
        assert len(made) == 1 and "_get_candidate_generator" not in vars(model)
        ks = made[0].ks
        if spelling == "static:2":
            assert max(ks) == 2 and set(ks) <= {0, 1, 2}
        if spelling == "static:0":
            assert set(ks) == {0}
    with policy_in_assisted_generation(model, "static:2"):
        pass
    assert "_get_candidate_generator" not in vars(model)


def test_the_transformers_report_pairs_speedups_within_each_repeat():
    """bench.transformers_cli.summarize: per repeat the baseline's total seconds over the row's (the same prompts in
    the same pass), their geometric mean with a t interval; one output unlike transformers' greedy marks the row."""
    from specpilot.bench.transformers_cli import summarize

    seconds = {"hf:plain": [2.0, 3.0, 2.0], "sp:none": [1.6, 2.4, 1.6], "sp:learned": [1.0, 1.5, 1.25]}
    rows = [{"policy": name, "repeat": r, "question_id": q, "seconds": s / 2, "identical": not (name == "sp:learned"
                                                                                                 and r == 2 and q == "b")}
            for name, per in seconds.items() for r, s in enumerate(per) for q in ("a", "b")]
    table = summarize(rows, ["hf:plain", "sp:none"])
    cell = table["sp:learned"]["over hf:plain"]
    assert cell["per_repeat"] == [2.0, 2.0, 1.6]
    assert cell["ratio"] == pytest.approx((2.0 * 2.0 * 1.6) ** (1 / 3), abs=1e-4) and cell["interval"][0] < cell["ratio"]
    assert table["sp:learned"]["over sp:none"]["per_repeat"] == [1.6, 1.6, 1.28]
    assert table["sp:learned"]["identical"] is False and table["sp:none"]["identical"] is True
    assert table["hf:plain"]["over hf:plain"]["interval"] == [1.0, 1.0]


@pytest.mark.embedded
def test_torch_threads_follow_the_free_cores_during_the_call_and_come_back(hf, monkeypatch):
    """threads="auto": with other processes holding one of two cores the loop decodes on one thread (the same tokens as
    transformers' greedy), and torch's count is the caller's again after the call; "fixed" leaves it alone."""
    import numpy as np

    import specpilot.decoding.threads as threads
    from specpilot.decoding.hardware import HW_FEATURES
    from specpilot.decoding.policies import StaticK

    class Busy:
        def read(self):
            values = np.zeros(len(HW_FEATURES), dtype=np.float32)
            values[HW_FEATURES.index("hw_cpu_other_util")] = 0.5
            return values

    class Watch(StaticK):  # a policy that sees torch's thread count at every decision
        seen: list = []

        def choose_k(self, obs):
            self.seen.append(torch.get_num_threads())
            return super().choose_k(obs)

    monkeypatch.setattr(threads, "shared_monitor", lambda device: Busy())
    monkeypatch.setattr(threads, "cpu_cores", lambda: 2)
    model, tokenizer, texts = hf
    inputs = tokenizer(texts[0], return_tensors="pt")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        expected = plain(model, inputs, max_new_tokens=8)
        for mode, during in (("auto", 1), ("fixed", 2)):
            policy = Watch(2)
            policy.seen = []
            got = model.generate(**inputs, do_sample=False, max_new_tokens=8, custom_generate=specpilot_generate,
                                 policy=policy, threads=mode)
            assert torch.equal(got, expected) and set(policy.seen[1:]) == {during}, mode
            assert torch.get_num_threads() == 2
        with pytest.raises(SpecPilotError, match="threads='many'"):
            model.generate(**inputs, max_new_tokens=2, custom_generate=specpilot_generate, policy="static:2", threads="many")
    finally:
        torch.set_num_threads(before)
