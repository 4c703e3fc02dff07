"""NgramIndex: prompt lookup's search from an incremental n-gram index equals the full scan (ngram_search)."""
from __future__ import annotations

import time

import numpy as np
import torch

from specpilot.decoding.drafters import NgramDrafter, NgramIndex, match_statistics, ngram_search


def test_index_search_equals_the_full_scan_as_the_sequence_grows():
    rng = np.random.default_rng(0)
    for max_n, min_n, vocab in ((3, 1, 6), (4, 2, 3), (1, 1, 5)):
        tokens = rng.integers(0, vocab, 700)  # past the buffer's first doubling
        index = NgramIndex(max_n, min_n)
        length = 0
        while length < len(tokens):
            before, length = length, min(len(tokens), length + int(rng.integers(1, 6)))  # a step confirms 1-5 tokens
            index.extend(tokens[before:length])
            assert np.array_equal(index.tokens, tokens[:length])
            start, n, hits = index.search()
            want = ngram_search(tokens[:length], max_n, min_n)
            assert (start, n) == want[:2] and np.array_equal(hits, want[2]), length


def test_drafter_lookups_and_stats_equal_the_scan_across_sequences():
    """The live drafter (its index per row, rebuilt for a new, shorter sequence) proposes and reports what the full
    scan says, row by row."""
    rng = np.random.default_rng(1)
    drafter = NgramDrafter(3)
    for sequence in range(3):
        tokens = torch.tensor(rng.integers(0, 5, 120 - 30 * sequence))
        drafter.reset(tokens[:10])
        for length in range(10, tokens.shape[0], 3):
            context = tokens[:length]
            proposal, n = drafter.lookup(context, 4)
            start, want_n, _ = ngram_search(context.numpy(), 3)
            assert n == want_n and torch.equal(proposal, context[start : start + 4])
            assert drafter.match_stats(context) == match_statistics(context.numpy(), 3)


def test_search_cost_does_not_grow_with_the_context():
    """One step's lookup at 20,000 tokens of context costs about what it costs at 1,000 (the full scan grows
    linearly): indexing is paid once per token, as it arrives."""
    rng = np.random.default_rng(2)
    tokens = torch.tensor(rng.integers(0, 2000, 20_100))

    def step_seconds(length: int) -> float:
        drafter = NgramDrafter(3)
        drafter.lookup(tokens[:length], 8)  # the prompt, indexed once
        t0 = time.perf_counter()
        for extra in range(1, 51):
            drafter.lookup(tokens[: length + extra], 8)
        return (time.perf_counter() - t0) / 50

    short, long = min(step_seconds(1000) for _ in range(3)), min(step_seconds(20_000) for _ in range(3))
    assert long < 3 * short + 20e-6, (short, long)


def test_lookup_cost_command_writes_a_row_per_context_length(tmp_path, capsys):
    import json

    from specpilot.bench.lookup_cost import lookup_cost_main
    from specpilot.decoding.config import run_cli
    from specpilot.env.oracle import Trace

    trace = Trace("q", "c", list(range(40)), [1, 2, 3] * 20, [0] * 60, [0] * 60, k_max=8, ngram_n=3)
    path = tmp_path / "traces.json"
    path.write_text(json.dumps({"meta": {"draft": "ngram:3"}, "traces": [trace.__dict__]}))
    args = ["--traces", str(path), "--context-lens", "50,300", "--steps", "3", "--repeats", "1", "--out", str(tmp_path)]
    assert lookup_cost_main(args) == 0
    rows = json.loads((tmp_path / "lookup_cost.json").read_text())["rows"]
    assert [r["context"] for r in rows] == [50, 300] and all(r["indexed_us"] > 0 and r["scan_us"] > 0 for r in rows)
    assert "full scan us" in capsys.readouterr().out
    assert run_cli(lookup_cost_main, args + ["--draft", "default"]) == 2
