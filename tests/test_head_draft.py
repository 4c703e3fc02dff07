"""The trained draft head: lossless decoding with it, distillation learns, a killed run resumes exactly."""
from __future__ import annotations

import gzip
import json

import pytest
import torch
from conftest import RandomK, plain_greedy, tiny_llama, tiny_target

from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.head_draft import (
    DraftHead,
    HeadConfig,
    HeadDrafter,
    load_head,
    save_head,
    target_signature,
)
from specpilot.decoding.loop import generate
from specpilot.decoding.models import load_draft, load_target
from specpilot.decoding.policy_spec import parse_policy
from specpilot.distill import corpus, head_training
from specpilot.distill.distill_cli import DistillConfig, distill


def random_head(model, vocab_ids, seed=0) -> DraftHead:
    torch.manual_seed(seed)
    h = model.config.hidden_size
    cfg = HeadConfig(hidden_size=h, intermediate_size=48, blocks=1, vocab_ids=vocab_ids,
                     target_vocab_size=model.config.vocab_size, target_signature=target_signature(model))
    return DraftHead(cfg).to(model.dtype).eval()


@pytest.mark.parametrize("policy", ["static:3", "static:8", "heuristic", "confidence:0.3"])
def test_head_draft_greedy_lossless(tiny_pair, policy):
    model, _ = tiny_pair
    draft = HeadDrafter(random_head(model, list(range(0, 64, 2))), model)  # half the vocabulary only
    for prompt in ([5, 9, 13, 2, 7], [1, 2, 3, 1, 2, 3, 1, 2], [42]):
        result = generate(tiny_target(model), draft, parse_policy(policy), prompt, 30)
        assert result.token_ids == plain_greedy(model, prompt, 30)


def test_head_draft_random_k_with_eos(tiny_pair):
    model, _ = tiny_pair
    prompt = [3, 1, 4, 1, 5]
    eos = plain_greedy(model, prompt, 30)[9]
    reference = plain_greedy(model, prompt, 30, eos=eos)
    draft = HeadDrafter(random_head(model, list(range(64))), model)
    result = generate(tiny_target(model, eos=eos), draft, RandomK(seed=3), prompt, 30)
    assert result.token_ids == reference


def test_head_draft_sampling_proposals_live_on_sub_vocabulary(tiny_pair):
    from specpilot.decoding.sampling import Sampling

    model, _ = tiny_pair
    sub = list(range(10, 40))
    draft = HeadDrafter(random_head(model, sub), model)
    hidden = torch.randn(1, model.config.hidden_size, dtype=model.dtype)
    out = draft.propose(torch.tensor([1, 2, 3]), 4, Sampling(temperature=1.0), torch.Generator().manual_seed(0),
                        target_hidden=hidden)
    assert out.probs.shape == (4, 64)
    assert torch.allclose(out.probs.sum(-1), torch.ones(4, dtype=out.probs.dtype))
    outside = [i for i in range(64) if i not in sub]
    assert float(out.probs[:, outside].abs().max()) == 0.0
    assert all(int(t) in sub for t in out.tokens)


def test_head_refuses_other_target_and_corrupt_files(tiny_pair, tmp_path):
    model, _ = tiny_pair
    head = random_head(model, list(range(64)))
    folder = save_head(head, tmp_path / "head")
    HeadDrafter(load_head(folder), model)  # its own target: fine
    with pytest.raises(SpecPilotError, match="trained for another target"):
        HeadDrafter(load_head(folder), tiny_llama(seed=5))
    with pytest.raises(SpecPilotError, match="vocab"):
        HeadDrafter(load_head(folder), tiny_llama(vocab=80))
    (folder / "draft_head.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(SpecPilotError, match="corrupt draft head weights"):
        load_head(folder)
    with pytest.raises(SpecPilotError, match="no draft head"):
        load_head(tmp_path / "missing")


def _prompt_file(tmp_path):
    texts = ["hello there", "write a poem", "add two numbers", "abc abc abc", "tell me a story", "count to ten",
             "what is 2+2", "name a color", "say hi", "list three fruits", "sort these: c b a", "repeat after me"]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"category": "c", "split": "train", "turns": [t]}) + "\n" for t in texts))
    return str(path)


def _cfg(tiny_model_dirs, tmp_path, name, **kw) -> DistillConfig:
    base = dict(target=tiny_model_dirs["target"], out=str(tmp_path / name), work_dir=str(tmp_path / f"work-{name}"),
                prompts=_prompt_file(tmp_path), synthetic_prompts=0, max_new_tokens=24, gen_batch=4, vocab=128,
                blocks=1, intermediate_size=64, depth=3, steps=60, batch_size=32, lr=1e-2, checkpoint_every=10,
                device="cpu", track=False, progress=False, val_fraction=0.2, corpus_tokens=512)
    base.update(kw)
    return DistillConfig(**base)


def test_short_distillation_learns_and_decodes_losslessly(tiny_model_dirs, tmp_path):
    cfg = _cfg(tiny_model_dirs, tmp_path, "head")
    out = distill(cfg)
    history = json.loads((tmp_path / "work-head" / "history.json").read_text())
    losses = [h["loss"] for h in history]
    assert len(losses) == 60
    assert sum(losses[-10:]) / 10 < 0.7 * sum(losses[:10]) / 10
    assert history[-1]["train/top1_step1"] > history[0]["train/top1_step1"]
    target = load_target(tiny_model_dirs["target"], dtype="float32", device="cpu")
    draft = load_draft(str(out), target)
    assert isinstance(draft, HeadDrafter)
    prompt = target.encode("tell me a story", chat=True)
    result = generate(target, draft, parse_policy("static:4"), prompt, 20)
    assert result.token_ids == plain_greedy(target.model, prompt, 20, eos=0)
    assert result.stats.accept_rate > 0.0
    trained = draft.head.cfg.trained
    assert draft.head.cfg.feature_layers == [0, 1, -1]  # 'auto' on a two-layer target: low, middle, last
    accepted = [trained[f"val/accepted_k{k}"] for k in range(1, 9)]
    assert accepted == sorted(accepted) and accepted[-1] <= 8  # a longer draft never keeps fewer tokens
    assert accepted[0] == pytest.approx(trained["val/top1_step1"], abs=1e-3)  # k = 1 keeps its depth-1 agreement
    assert trained["cost"]["draft_token_ms"] > 0 and trained["cost"]["plain_step_ms"] > 0
    assert (tmp_path / "work-head" / "history.png").stat().st_size > 0  # the training curve
    answered = {json.loads(line)["id"] for line in (tmp_path / "work-head" / "generations.jsonl").read_text().splitlines()}
    assert answered and trained["prompt_ids"] == sorted(answered)  # what a policy for it must not be tuned on


def test_a_head_on_the_last_layer_alone_and_greedy_labels_still_trains(tiny_model_dirs, tmp_path):
    out = distill(_cfg(tiny_model_dirs, tmp_path, "last", feature_layers="-1", soft_labels=1, steps=20))
    target = load_target(tiny_model_dirs["target"], dtype="float32", device="cpu")
    draft = load_draft(str(out), target)
    assert draft.head.cfg.feature_layers == [-1] and draft.head.fuse is None
    prompt = target.encode("say hi", chat=True)
    assert generate(target, draft, parse_policy("static:3"), prompt, 12).token_ids == plain_greedy(target.model, prompt, 12, eos=0)
    with pytest.raises(SpecPilotError, match="feature-layers"):
        distill(_cfg(tiny_model_dirs, tmp_path, "bad", feature_layers="0,7"))


def test_killed_distillation_resumes_to_the_same_head(tiny_model_dirs, tmp_path, monkeypatch):
    whole = distill(_cfg(tiny_model_dirs, tmp_path, "whole", steps=30))
    real_unroll, calls = head_training.unroll, {"n": 0}

    def dying_unroll(*args, **kw):
        calls["n"] += args[-1] != 0.0  # training calls only (evaluation passes feature_weight 0)
        if calls["n"] == 21:
            raise KeyboardInterrupt
        return real_unroll(*args, **kw)

    monkeypatch.setattr(head_training, "unroll", dying_unroll)
    cfg = _cfg(tiny_model_dirs, tmp_path, "resumed", steps=30)
    with pytest.raises(SpecPilotError, match="interrupted at step 20"):
        distill(cfg)
    monkeypatch.setattr(head_training, "unroll", real_unroll)
    resumed = distill(cfg)
    history = json.loads((tmp_path / "work-resumed" / "history.json").read_text())
    assert [h["step"] for h in history] == list(range(1, 31))
    a, b = load_head(whole).state_dict(), load_head(resumed).state_dict()
    assert all(torch.allclose(a[name], b[name]) for name in a)


def test_a_new_work_folder_starts_from_the_shipped_answers(tmp_path, monkeypatch):
    """The embedded target's answers ship gzipped (the slow stage): an empty work folder starts from them, one that has
    answers keeps its own, and another target generates its own."""
    import gzip

    shipped = tmp_path / "answers.jsonl.gz"
    with gzip.open(shipped, "wt") as sink:
        sink.write(json.dumps({"id": "q1", "prompt_ids": [1, 2], "answer_ids": [3, 0]}) + "\n")
    monkeypatch.setattr(corpus, "SHIPPED_ANSWERS", shipped)
    path = tmp_path / "work" / "generations.jsonl"
    path.parent.mkdir()
    assert not corpus.seed_answers(DistillConfig(target="other"), path) and not path.exists()
    assert corpus.seed_answers(DistillConfig(), path)
    assert json.loads(path.read_text())["answer_ids"] == [3, 0]
    path.write_text("")
    assert not corpus.seed_answers(DistillConfig(), path) and path.read_text() == ""


def test_the_shipped_answers_are_the_embedded_targets_and_never_a_test_prompts():
    import gzip

    from specpilot.decoding.prompts import load_prompts

    rows = [json.loads(line) for line in gzip.open(corpus.SHIPPED_ANSWERS.parent /
                                                   "smollm2-135m-instruct-answers.jsonl.gz", "rt")]
    assert len(rows) >= 1000
    held = {p.question_id for split in ("test", "ood") for p in load_prompts(split=split)}
    assert not held & {r["id"] for r in rows}


def test_traces_of_prompts_a_head_learned_from_are_nobodys_train_split(tiny_pair, tmp_path):
    """The prompts whose answers a head was distilled on, and those of the synthetic generator it drew from, are
    marked `draft-train` when its traces load: no rule or policy is tuned on them (they flatter the head)."""
    from specpilot.decoding.head_draft import head_config_of, load_head_config, save_head
    from specpilot.env.oracle import load_draft_traces, load_traces, train_traces

    model, _ = tiny_pair
    made = random_head(model, list(range(64)))
    made.cfg.trained = {"prompt_ids": ["qa-01"], "config": {"synthetic_prompts": 10}}
    folder = save_head(made, tmp_path / "head")
    cfg = load_head_config(folder)
    assert cfg.distilled_on("qa-01", "qa") and not cfg.distilled_on("qa-02", "qa")
    assert cfg.distilled_on("synth_synthetic-qa-0003", "synth_qa") and cfg.distilled_on("synthetic-qa-0003", "qa")
    assert head_config_of("ngram:3") is None and head_config_of(str(folder)).trained == cfg.trained

    def trace(qid, category):
        return {"question_id": qid, "category": category, "prompt_ids": [1], "output_ids": [2], "matches": [0],
                "available": [1]}

    rows = [trace("qa-01", "qa"), trace("qa-02", "qa"), trace("synth_synthetic-qa-0003", "synth_qa"), trace("qa-09", "qa")]
    splits = {"qa-01": "train", "qa-02": "train", "synth_synthetic-qa-0003": "train", "qa-09": "test"}
    path = tmp_path / "traces.json"
    path.write_text(json.dumps({"meta": {"draft": str(folder), "k_max": 1, "max_new_tokens": 1, "splits": splits},
                                "traces": rows}))
    traces, meta = load_draft_traces(path, str(folder))
    assert [t.question_id for t in train_traces(traces, meta)] == ["qa-02"]
    assert meta["splits"]["qa-09"] == "test"  # other splits untouched
    raw, raw_meta = load_traces(path)  # the commands that read a file without the draft check get the same train split
    assert [t.question_id for t in train_traces(raw, raw_meta)] == ["qa-02"]
    made.cfg.trained = {}  # a head that records nothing it learned from: the whole train split stays
    save_head(made, folder)
    traces, meta = load_draft_traces(path, str(folder))
    assert len(train_traces(traces, meta)) == 3
    made.cfg.trained = {"prompt_ids": ["qa-01", "qa-02"], "config": {"synthetic_prompts": 10}}
    save_head(made, folder)
    traces, meta = load_draft_traces(path, str(folder))
    with pytest.raises(SpecPilotError, match="learned from every train-split trace"):
        train_traces(traces, meta)


def test_the_shipped_head_records_the_prompts_it_learned_from():
    from specpilot.decoding.head_draft import default_draft_folder, load_head_config

    rows = [json.loads(line) for line in gzip.open(corpus.SHIPPED_ANSWERS.parent /
                                                   "smollm2-135m-instruct-answers.jsonl.gz", "rt")]
    cfg = load_head_config(default_draft_folder())
    assert cfg.trained["prompt_ids"] == sorted(r["id"] for r in rows)


def test_draft_seen_groups_the_prompts_a_head_learned_from_and_sums_the_kept_tokens_by_hand():
    from specpilot.bench.draft_seen_cli import accepted_by_group
    from specpilot.env.oracle import Trace

    def trace(qid, category, matches):
        return Trace(qid, category, [1], [2] * len(matches), matches, [4] * len(matches))

    traces = [trace("qa-01", "qa", [3, 0]), trace("synth_x", "synth_qa", [1, 1, 5]), trace("qa-02", "qa", [0, 2]),
              trace("qa-09", "qa", [4])]
    splits = {"qa-01": "draft-train", "synth_x": "draft-train", "qa-02": "train", "qa-09": "test"}
    table = accepted_by_group(traces, splits, {"qa-01"}, [1, 2])
    assert table["learned from"] == {"prompts": 1, "k=1": 0.5, "k=2": 1.0}  # min(3, k) + min(0, k) over 2 positions
    assert table["same generator"] == {"prompts": 1, "k=1": 1.0, "k=2": round(4 / 3, 3)}
    assert table["train (kept)"] == {"prompts": 1, "k=1": 0.5, "k=2": 1.0} and table["test"]["k=2"] == 2.0
    assert "ood" not in table
