"""Cost profiles: through the real loop, and of random-init shapes (no weights) as for GPUs."""
from __future__ import annotations

import json

from conftest import CPU_KEY, tiny_llama


def test_profile_random_init_shapes(tmp_path, capsys):
    from specpilot.bench.profile_cli import profile_main

    shape = tmp_path / "shape"
    tiny_llama(vocab=300, window=4096, dtype=__import__("torch").float32).config.save_pretrained(shape)
    assert profile_main(["--device", "cpu", "--target-config", str(shape), "--draft-config", str(shape), "--k-max", "3",
                         "--context-lens", "16,128", "--repeats", "2", "--batch-sizes", "1,3", "--no-progress",
                         "--out", str(tmp_path / "p")]) == 0
    profile = json.loads((tmp_path / "p" / f"{CPU_KEY}.json").read_text())
    assert profile["shapes"] == {"target": str(shape), "draft": str(shape)}
    assert profile["context_lens"] == [16, 128] and len(profile["verify_s"][1]) == 4
    assert all(s > 0 for row in profile["verify_s"] for s in row) and all(d > 0 for d in profile["draft_s_per_token"])
    assert (tmp_path / "p" / f"{CPU_KEY}.png").stat().st_size > 1000
    # batch sizes: a batch of 3 rows verifying k tokens each, and the draft LM's batched cost
    assert profile["batch_sizes"] == [1, 3] and len(profile["batch_verify_s"]) == 2
    assert len(profile["batch_verify_s"][1]) == 4 and all(d > 0 for d in profile["batch_draft_s_per_token"])
    assert "traces" not in capsys.readouterr().out  # no weights, no acceptance traces


def test_profile_grid_is_what_the_cost_model_reads(tmp_path, capsys):
    """--grid-context-lens: every batch size timed at every one of those context lengths (all rows that
    long), in the simulated profiles' grid layout; the replay's cost model then prices a batch step from that
    cell, not from the one-row context curve scaled by batch."""
    import numpy as np

    from specpilot.bench.profile_cli import profile_main
    from specpilot.decoding.config import run_cli
    from specpilot.env.oracle import CostModel

    shape = tmp_path / "shape"
    tiny_llama(vocab=300, window=4096, dtype=__import__("torch").float32).config.save_pretrained(shape)
    args = ["--device", "cpu", "--target-config", str(shape), "--k-max", "3", "--context-lens", "16,128", "--repeats", "2",
            "--no-progress", "--out", str(tmp_path / "p")]
    assert profile_main(args + ["--batch-sizes", "1,3", "--grid-context-lens", "16,512"]) == 0
    profile = json.loads((tmp_path / "p" / f"{CPU_KEY}.json").read_text())
    grid = profile["grid"]
    assert grid["batch_sizes"] == [1, 3] and grid["context_lens"] == [16, 512] and grid["measured"]
    assert np.asarray(grid["verify_s"]).shape == (2, 2, 4) and np.asarray(grid["draft_s_per_token"]).shape == (2, 2)
    cost = CostModel.from_profile(profile)
    bucket = 512 // cost.BUCKET * cost.BUCKET + cost.BUCKET // 2  # contexts are looked up mid-bucket, held at 512
    draft = grid["draft_s_per_token"][1][1]
    np.testing.assert_allclose(cost.step_costs(bucket, 3)[0], np.asarray(grid["verify_s"][1][1]) + draft * np.arange(4))
    assert cost.outside([3], 600) and not cost.outside([3], 500)
    assert "B=3" in capsys.readouterr().out
    assert run_cli(profile_main, args + ["--batch-sizes", "", "--grid-context-lens", "16,512"]) == 2
    assert "--grid-context-lens needs --batch-sizes" in capsys.readouterr().err


def test_context_fit_recovers_lines_through_noise_and_refits_from_the_medians(tmp_path, capsys):
    """fit_grid_in_context: cells on exact lines in the context come back unchanged; the same lines with a tenth's
    noise per cell come back closer to the lines than the noisy cells (over many draws); the medians are kept and
    a refit starts from them, so refitting twice is refitting once; --refit --context-fit none restores them."""
    import numpy as np

    from specpilot.bench.profile_cli import profile_main
    from specpilot.decoding.config import run_cli
    from specpilot.env.profile import fit_grid_in_context

    contexts = [64, 512, 1024, 2048]
    c = np.asarray(contexts, dtype=float)
    base = np.array([0.05, 0.09])[:, None, None] + 1e-5 * c[None, :, None] * np.arange(1, 4)[None, None, :]  # (b, c, k)
    exact = {"batch_sizes": [1, 2], "context_lens": contexts, "verify_s": base.tolist(),
             "draft_s_per_token": np.zeros((2, 4)).tolist(), "measured": True}
    np.testing.assert_allclose(fit_grid_in_context(exact)["verify_s"], base, rtol=1e-9)
    rng = np.random.default_rng(0)
    raw_err, fit_err = [], []
    for _ in range(200):
        noisy = base * np.exp(rng.normal(0, 0.1, base.shape))
        fitted = np.asarray(fit_grid_in_context({**exact, "verify_s": noisy.tolist()})["verify_s"])
        raw_err.append(np.abs(np.log(noisy / base)).mean())
        fit_err.append(np.abs(np.log(fitted / base)).mean())
    assert np.mean(fit_err) < 0.8 * np.mean(raw_err)
    falling = base[:, ::-1].copy()  # cost falling with the context: noise, held flat at each (b, k)'s mean
    flat = np.asarray(fit_grid_in_context({**exact, "verify_s": falling.tolist()})["verify_s"])
    np.testing.assert_allclose(flat, np.broadcast_to(falling.mean(axis=1, keepdims=True), falling.shape))
    two = {**exact, "context_lens": [64, 512], "verify_s": base[:, :2].tolist(), "draft_s_per_token": [[0, 0], [0, 0]]}
    assert fit_grid_in_context(two) is two  # two points: nothing to average
    noisy = (base * np.exp(rng.normal(0, 0.1, base.shape))).tolist()
    once = fit_grid_in_context({**exact, "verify_s": noisy})
    assert once["verify_s_measured"] == noisy and once["context_fit"] == "linear"
    assert fit_grid_in_context(once)["verify_s"] == once["verify_s"]
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"context_lens": [64], "verify_s": [[0.05, 0.06]], "draft_s_per_token": [0.0],
                                "grid": {**exact, "verify_s": noisy}}))
    assert profile_main(["--refit", str(path)]) == 0
    assert json.loads(path.read_text())["grid"]["verify_s"] == once["verify_s"]
    assert profile_main(["--refit", str(path), "--context-fit", "none"]) == 0
    assert json.loads(path.read_text())["grid"]["verify_s"] == noisy
    capsys.readouterr()
    assert run_cli(profile_main, ["--refit", str(path), "--context-fit", "cubic"]) == 2
    assert "--context-fit must be one of" in capsys.readouterr().err


def test_a_step_is_priced_as_the_loop_runs_it_when_a_change_of_shape_costs(monkeypatch):
    """An engine that rebuilds its graph when the batch shape changes (llama.cpp) makes a step's seconds depend on
    the step before. The profile prices a plain step after a plain one (as most come) and a drafting step with the
    rebuild it pays and the one it causes the plain step after it: exactly so for a fake loop with a fixed switch
    cost (a rotation of k, as timed before, charged every plain step the switch and no drafting step the second)."""
    from types import SimpleNamespace

    import specpilot.env.profile as profile

    plain, per_token, switch = 0.010, 0.003, 0.001
    last = {"k": None}

    def fake_step(state, k):
        seconds = plain + per_token * k + (switch if last["k"] is not None and last["k"] != k else 0.0)
        last["k"] = k
        return SimpleNamespace(verify_s=seconds)

    monkeypatch.setattr(profile, "speculative_step", fake_step)
    samples = profile._timed_steps(None, k_max=4, repeats=3)
    assert sorted(samples) == [0, 1, 2, 3, 4] and all(len(samples[k]) == 3 for k in range(1, 5))
    assert all(abs(s - plain) < 1e-12 for s in samples[0])  # no switch charged to a plain step after a plain one
    for k in range(1, 5):  # its own rebuild and the plain step's after it
        assert all(abs(s - (plain + per_token * k + 2 * switch)) < 1e-12 for s in samples[k])
    assert profile.steps_budget(4, 3) >= 3 * (1 + sum(1 + (k + 1) + 1 for k in range(1, 5))) + 4 + 2
