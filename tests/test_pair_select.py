"""`--draft auto`: the recorded choice of a device's draft, its errors, and the prompts the choice may read."""
import json
import types
import zlib

import pytest

from specpilot.agents.pair_select import PairConfig, choice_prompts
from specpilot.agents.select import held_out
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.models import load_draft, resolve_draft
from specpilot.decoding.paths import draft_choice_path


def test_auto_reads_the_recorded_choice(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPECPILOT_HOME", str(tmp_path / "home"))
    with pytest.raises(SpecPilotError, match="train_policy.py --device cpu-x --draft auto"):
        resolve_draft("auto", "cpu-x")
    path = draft_choice_path("cpu-x", None, tmp_path / "policies")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"draft": "hybrid"}))
    assert resolve_draft("auto", "cpu-x") == "hybrid"
    assert resolve_draft("ngram:3", "cpu-x") == "ngram:3"  # any other spelling as given
    # the choice is keyed by the target, as policies are: llama.cpp's is another file
    with pytest.raises(SpecPilotError, match="no draft chosen"):
        resolve_draft("auto", "cpu-x", "llama.cpp:embedded")
    path.write_text(json.dumps({"draft": "auto"}))
    with pytest.raises(SpecPilotError, match="cannot be 'auto'"):
        resolve_draft("auto", "cpu-x")


def test_a_head_on_a_target_without_hidden_states_is_a_clear_error():
    target = types.SimpleNamespace(hidden_states=False, name="llama.cpp:embedded")
    for spec in ("default", "hybrid"):
        with pytest.raises(SpecPilotError, match="hidden states"):
            load_draft(spec, target)
    with pytest.raises(SpecPilotError, match="resolve it first"):
        load_draft("auto", target)


def test_choice_prompts_are_held_out_and_never_a_heads_own():
    cfg = PairConfig()
    taught = set()

    def distilled_on(question_id, category):  # a head that learned from every other held-out prompt
        seen = zlib.crc32(question_id.encode()) % 2 == 0
        if seen:
            taught.add(question_id)
        return seen

    head = types.SimpleNamespace(distilled_on=distilled_on)
    prompts = choice_prompts(cfg, [head, object()])
    ids = [p.question_id for p in prompts]
    assert ids and not set(ids) & taught
    assert set(ids) <= held_out(ids, cfg.holdout)
    assert len({p.category for p in prompts}) == len(prompts)  # one per category
    with pytest.raises(SpecPilotError, match="raise --holdout"):
        choice_prompts(cfg, [types.SimpleNamespace(distilled_on=lambda q, c: True)])
