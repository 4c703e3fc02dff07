"""agents.fit_check's split: a seeded quarter of the train split held out, and extra traces that repeat a train prompt
or miss the file are one-line errors (the arms that add the extras to the fit run only in the full command)."""
from __future__ import annotations

import pytest
from conftest import stretch_traces

from specpilot.agents.fit_check import fit_check_main, holdout_split
from specpilot.decoding.errors import SpecPilotError


def test_seeded_held_out_quarter_and_extras_that_repeat_a_train_prompt():
    train = stretch_traces(2, n=12)
    extra = stretch_traces(2, n=5)
    for i, t in enumerate(extra):
        t.question_id = f"synth-{40 + i:04d}"
    fit_on, val = holdout_split(train, extra, 0.25, seed=7)
    assert len(val) == 3 and len(fit_on) == 9
    assert {t.question_id for t in fit_on} | {t.question_id for t in val} == {t.question_id for t in train}
    assert [t.question_id for t in holdout_split(train, [], 0.25, seed=8)[1]] != [t.question_id for t in val]
    with pytest.raises(SpecPilotError, match="repeat 1 train prompts"):
        holdout_split(train, extra + [train[4]], 0.25, seed=7)


def test_missing_extra_traces_is_one_line_error(tmp_path):
    with pytest.raises(SpecPilotError):
        fit_check_main(["--extra-traces", str(tmp_path / "none.json")])
