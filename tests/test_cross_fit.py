"""agents.cross_fit: every train prompt is scored once, by a policy whose training never saw it; a recipe's
dropped categories are left out of training, not out of scoring; a recipe learned on other prompts beats its
base where the features decide."""
import pytest

from specpilot.agents.cross_fit import cross_fit, fold_of, recipe_filter
from specpilot.agents.improve import as_policy, improve_policy
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.policies import StaticK
from specpilot.env.oracle import CostModel, Trace
from specpilot.env.replay_env import replay_evaluate

K = 4


def _traces(per_category: int = 4, length: int = 36) -> list[Trace]:
    """Two categories; stretches where prompt lookup matches 3 tokens and every draft is right, alternating
    with stretches where it matches 1 and every draft is wrong (as in tests/test_improve.py)."""
    out = []
    for c, category in enumerate(("a", "b")):
        for q in range(per_category):
            good = [((i + 2 * q + c) // 6) % 2 == 0 for i in range(length)]
            out.append(Trace(f"{category}{q}", category, list(range(10)), list(range(100 + q, 100 + q + length)),
                             [K if g else 0 for g in good], [K] * length, match_lens=[3 if g else 1 for g in good], k_max=K))
    return out


def _cost() -> CostModel:
    return CostModel([0, 10000], [[0.1] + [0.18] * K] * 2, [0.0, 0.0])


def test_folds_score_every_prompt_once_by_a_policy_that_never_saw_it():
    traces = _traces()
    where = fold_of(traces)
    assert [where[f"a{q}"] for q in range(4)] == [0, 1, 2, 3] and [where[f"b{q}"] for q in range(4)] == [0, 1, 2, 3]
    scored, fits = [], []

    def train_fold(fit_on):
        fits.append({t.question_id for t in fit_on})
        return len(fits) - 1

    def score(policy, held, b):
        scored.append((policy, {t.question_id for t in held}))
        return 1.0, 1.0

    results = cross_fit(traces, ["all", "-b"], 2, train_fold, score, [1])
    assert set(results) == {"all", "-b"} and results["all"]["min"] == 1.0
    all_ids = {t.question_id for t in traces}
    for recipe in range(2):
        mine = scored[recipe * 2:(recipe + 1) * 2]
        assert sorted(q for _, held in mine for q in held) == sorted(all_ids)  # each prompt scored once
        for policy, held in mine:
            assert not held & fits[policy]  # never by a policy trained on it
    assert all(not any(q.startswith("b") for q in fits[i]) for i in (2, 3))  # -b: b left out of training...
    assert any(q.startswith("b") for _, held in scored[2:] for q in held)  # ...not out of scoring
    with pytest.raises(SpecPilotError, match="--recipes"):
        recipe_filter("b")


def test_a_recipe_learned_on_other_prompts_beats_its_base_where_the_features_decide():
    traces, cost = _traces(), _cost()
    base = StaticK(1)  # drafts one token everywhere: wasted at match 1, too little at match 3

    def train_fold(fit_on):
        layers, norm, _ = improve_policy(base, fit_on, cost, K, None, [1], {1: len(fit_on)}, 36, 1, [32, 32], "tanh",
                                         150, seed=0, progress=False)
        return as_policy(layers, norm, "tanh", K)

    def score(policy, held, b):
        got = replay_evaluate({"learned": policy, "base": base}, held, cost, K, None, b, 36)
        return got["learned"]["speedup"], got["base"]["speedup"]

    results = cross_fit(traces, ["all"], 2, train_fold, score, [1])
    assert results["all"]["ratio"][1] > 1.2


def test_an_interrupted_run_resumes_with_the_missing_folds_only():
    traces = _traces()
    trained = []

    def train_fold(fit_on):
        trained.append(frozenset(t.question_id for t in fit_on))
        return len(fit_on)

    def score(policy, held, b):
        return 1.0 + policy / 100 + len(held) / 1000, 1.0

    whole = cross_fit(traces, ["all", "-b"], 2, train_fold, score, [1, 2])
    fits_whole, trained[:] = list(trained), []
    kept = {}

    def dies_after_three(fit_on):
        if len(trained) == 3:
            raise KeyboardInterrupt
        return train_fold(fit_on)

    with pytest.raises(KeyboardInterrupt):
        cross_fit(traces, ["all", "-b"], 2, dies_after_three, score, [1, 2],
                  on_fold=lambda recipe, f, row: kept.__setitem__((recipe, f), row))
    assert sorted(kept) == [("-b", 0), ("all", 0), ("all", 1)]
    trained[:] = []
    resumed = cross_fit(traces, ["all", "-b"], 2, train_fold, score, [1, 2], done=kept)
    assert trained == fits_whole[3:]  # only the fold that had not ended is trained again
    assert resumed == whole
