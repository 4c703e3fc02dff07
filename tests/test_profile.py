"""Cost profiles: through the real loop, and of random-init shapes (no weights) as for GPUs."""
from __future__ import annotations

import json

from conftest import tiny_llama


def test_profile_random_init_shapes(tmp_path, capsys):
    from bench.profile_cli import profile_main

    shape = tmp_path / "shape"
    tiny_llama(vocab=300, window=4096, dtype=__import__("torch").float32).config.save_pretrained(shape)
    assert profile_main(["--device", "cpu", "--target-config", str(shape), "--draft-config", str(shape), "--k-max", "3",
                         "--context-lens", "16,128", "--repeats", "2", "--batch-sizes", "1,3", "--no-progress",
                         "--out", str(tmp_path / "p")]) == 0
    profile = json.loads((tmp_path / "p" / "cpu.json").read_text())
    assert profile["shapes"] == {"target": str(shape), "draft": str(shape)}
    assert profile["context_lens"] == [16, 128] and len(profile["verify_s"][1]) == 4
    assert all(s > 0 for row in profile["verify_s"] for s in row) and all(d > 0 for d in profile["draft_s_per_token"])
    assert (tmp_path / "p" / "cpu.png").stat().st_size > 1000
    # batch sizes: a batch of 3 rows verifying k tokens each, and the draft LM's batched cost
    assert profile["batch_sizes"] == [1, 3] and len(profile["batch_verify_s"]) == 2
    assert len(profile["batch_verify_s"][1]) == 4 and all(d > 0 for d in profile["batch_draft_s_per_token"])
    assert "traces" not in capsys.readouterr().out  # no weights, no acceptance traces
