"""reports/ppo.md's arithmetic (bench/ppo_report.py) on runs whose speeds are known: the paired ratios per load and
batch size, their mean over loads, the targets' verdicts, and a run whose tokens differ from plain decoding's."""
from __future__ import annotations

import json

import pytest

from specpilot.bench.ppo_report import ordered_cells, ppo_report_main, token_mismatches

SPEED = {"none": 10.0, "warm": 12.0, "replay": 12.0, "real": 12.3, "learned": 12.6, "learned-idle-counters": 12.0, "best-rule": 11.0}
"""tokens/s of each policy; under a load every policy runs at half its speed."""


def runs(repeats: int = 3, wobble: float = 0.01) -> list[dict]:
    out = []
    for load, slow in (("none", 1.0), ("compute", 0.5), ("memory", 0.5)):
        for b in (1, 4):
            for r in range(repeats):
                drift = 1.0 + wobble * r  # the machine drifts between repeats: the paired ratio does not
                for policy, speed in SPEED.items():
                    out.append({"policy": policy, "batch_size": b, "batch_index": 0, "question_ids": ["q"], "repeat": r,
                                "new_tokens": 48 * b, "seconds": 48 * b / (speed * slow * drift), "steps": 1,
                                "drafted": 0, "accepted": 0, "policy_s": 0.0, "ks": [], "token_ids": [[1, 2, 3]],
                                "category": "c", "load": load})
    return out


def write(tmp_path, split: str, data: list[dict]):
    meta = {"split": split, "prompts": 1, "max_new_tokens": 48, "batch_sizes": [1, 4], "loads": ["none", "compute", "memory"],
            "repeats": 3, "hardware": "cpu", "device": "cpu-test", "policies": {}}
    path = tmp_path / f"{split}.json"
    path.write_text(json.dumps({"meta": meta, "runs": data}))
    return path


def test_the_report_pairs_the_phases_and_judges_the_targets(tmp_path):
    test, ood = write(tmp_path, "test", runs()), write(tmp_path, "ood", runs())
    report = tmp_path / "ppo.md"
    assert ppo_report_main(["--results", f"{test},{ood}", "--warm", "warm", "--replay", "replay", "--real", "real", "--report", str(report)]) == 0
    doc = json.loads(report.with_suffix(".json").read_text())
    t = doc["tables"]["test"]
    assert t["ratios"]["committed/warm"]["compute B=1"]["ratio"] == pytest.approx(12.6 / 12.0)
    assert t["ratios"]["committed/rule"]["none B=4"]["ratio"] == pytest.approx(12.6 / 11.0)
    assert t["speedup"]["rule"]["memory B=1"]["ratio"] == pytest.approx(1.1)
    assert t["mean_over_loads"]["committed/warm"]["B=1"] == pytest.approx(1.05)
    assert t["ratios"]["real/warm"]["none B=4"]["ratio"] == pytest.approx(12.3 / 12.0)
    verdicts = {name: ok for name, _, ok in doc["targets"]}
    assert verdicts["exported / warm start >= 1.03 at B=1, mean over loads"] is True
    assert verdicts["exported / best rule >= 1.05 at B=1 (compute)"] is True
    assert verdicts["pinned counters lose >= 3% at B=1 (memory): exported / pinned >= 1.03"] is True
    assert "every run token-identical" in report.read_text() and report.with_suffix(".png").exists()


def test_an_exported_policy_that_is_the_warm_start_gets_no_ratio_to_itself(tmp_path):
    """When the held-out selection kept the warm start, the exported policy and the warm start are one policy: one
    row, no 1.000 ratio passed off as a measurement, and the first target says why it is not met."""
    test = write(tmp_path, "test", runs())
    report = tmp_path / "ppo.md"
    assert ppo_report_main(["--results", str(test), "--warm", "learned", "--replay", "replay", "--real", "real",
                            "--report", str(report)]) == 0
    doc = json.loads(report.with_suffix(".json").read_text())
    t = doc["tables"]["test"]
    assert "committed" not in t["speedup"] and "committed/warm" not in t["ratios"]
    assert t["ratios"]["replay/warm"]["none B=1"]["ratio"] == pytest.approx(12.0 / 12.6)
    assert t["ratios"]["real/rule"]["none B=1"]["ratio"] == pytest.approx(12.3 / 11.0)
    first = doc["targets"][0]
    assert first[1] == "1 (the exported policy is the warm start)" and first[2] is False
    assert {name: ok for name, _, ok in doc["targets"]}["exported / best rule >= 1.05 at B=1 (compute)"] is True
    assert "The exported policy is the warm start" in report.read_text()


def test_a_run_whose_tokens_differ_from_plain_decoding_is_counted():
    data = runs()
    assert token_mismatches(data) == {p: 0 for p in SPEED if p != "none"}
    broken = next(r for r in data if r["policy"] == "learned" and r["load"] == "memory")
    broken["token_ids"] = [[1, 2, 4]]
    assert token_mismatches(data)["learned"] == 1


def test_cells_read_in_the_loads_order_then_by_batch_size():
    assert ordered_cells(["memory B=1", "none B=4", "compute B=16", "compute B=4", "none B=1"]) == \
        ["none B=1", "none B=4", "compute B=4", "compute B=16", "memory B=1"]


def test_a_run_not_finished_reads_as_its_complete_repeats(tmp_path):
    """A checkpoint (the benchmark's OUT/checkpoint.jsonl): its complete repeats only, so every ratio pairs the same
    batches; the page says it is partial."""
    data = runs()
    signature = {"policies": sorted(SPEED), "prompts": ["q"], "batch_sizes": [1, 4], "max_new_tokens": 48, "repeats": 3,
                 "loads": ["none", "compute", "memory"]}
    lines = [json.dumps({"signature": signature})]
    for r in range(3):
        for load in ("none", "compute", "memory"):
            for b in (1, 4):
                if r == 2 and load == "memory" and b == 4:
                    continue  # the run stopped here
                cell = [x for x in data if x["repeat"] == r and x["load"] == load and x["batch_size"] == b]
                lines.append(json.dumps({"repeat": r, "load": load, "batch": 0 if b == 1 else 1, "runs": cell}))
    checkpoint = tmp_path / "checkpoint.jsonl"
    checkpoint.write_text("\n".join(lines) + "\n")
    report = tmp_path / "ppo.md"
    assert ppo_report_main(["--results", f"ood={checkpoint}", "--warm", "warm", "--replay", "replay", "--real", "real",
                            "--report", str(report)]) == 0
    doc = json.loads(report.with_suffix(".json").read_text())
    assert doc["meta"]["ood"]["repeats"] == 2 and doc["meta"]["ood"]["partial"] == "2 of 3 repeats (from the checkpoint)"
    assert len(doc["tables"]["ood"]["ratios"]["committed/warm"]["memory B=4"]["per_repeat"]) == 2
    assert "partial: 2 of 3 repeats" in report.read_text()


def test_the_page_names_the_phase_of_each_batch_size(tmp_path):
    """With --exported, the page says which phase's network the exported policy runs at which batch size."""
    test = write(tmp_path, "test", runs())
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"weights": "w", "selection": {"by_batch": {"1": "replay", "4": "warm-start"}}}))
    report = tmp_path / "ppo.md"
    assert ppo_report_main(["--results", str(test), "--warm", "warm", "--replay", "replay", "--real", "real",
                            "--exported", str(policy), "--report", str(report)]) == 0
    assert "B >= 1 replay, B >= 4 warm-start" in report.read_text()
    assert json.loads(report.with_suffix(".json").read_text())["by_batch"] == {"1": "replay", "4": "warm-start"}
