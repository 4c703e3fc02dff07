"""An interrupted real-loop benchmark resumes from its checkpoint: the finished batches are not run again, the
result is the uninterrupted run's, a torn last line is dropped and a checkpoint of another plan is refused."""
import json

import pytest

import specpilot.bench.benchmark as benchmark
from specpilot.bench.benchmark import run_batch_benchmark
from specpilot.bench.benchmark_cli import benchmark_main
from specpilot.decoding.config import run_cli
from specpilot.decoding.drafters import NgramDrafter
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.policies import StaticK
from specpilot.decoding.prompts import Prompt

PROMPTS = [Prompt("p0", "c", "Count from one to ten: one, two, three,"), Prompt("p1", "c", "Repeat after me: red blue red blue")]


def _plan(target, checkpoint, resume=False, tokens=6):
    policies = {"none": StaticK(0), "static:2": StaticK(2)}
    return run_batch_benchmark(target, NgramDrafter(3), policies, PROMPTS, [1, 2], tokens, 2, progress=False,
                               checkpoint=checkpoint, resume=resume)


def _by_key(runs):
    return {(r.policy, r.batch_size, r.batch_index, r.repeat): r.token_ids for r in runs}


@pytest.mark.slow  # (10-30 s of real decoding; CI runs it, the default suite keeps under 8 min)
def test_an_interrupted_benchmark_resumes_where_it_stopped(embedded_target, tmp_path, monkeypatch):
    full = _by_key(_plan(embedded_target, tmp_path / "full.jsonl"))
    assert len(full) == 12  # 2 repeats x (2 batches of one + 1 of two) x 2 policies

    path = tmp_path / "ck.jsonl"
    real_run_one, calls = benchmark._run_one, []

    def interrupted(*args, **kwargs):
        calls.append(args[3])
        if len(calls) == 5:  # the third batch's first policy: two batches (4 runs) are done
            raise KeyboardInterrupt
        return real_run_one(*args, **kwargs)

    monkeypatch.setattr(benchmark, "_run_one", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _plan(embedded_target, path)
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and "signature" in json.loads(lines[0])
    with path.open("a") as f:
        f.write('{"repeat": 0, "load": "none", "bat')  # a kill in the middle of a write

    calls.clear()
    monkeypatch.setattr(benchmark, "_run_one", lambda *a, **k: (calls.append(a[3]), real_run_one(*a, **k))[1])
    resumed = _plan(embedded_target, path, resume=True)
    assert len(calls) == 8  # only the 8 runs of the 4 unfinished batches
    assert _by_key(resumed) == full  # the same runs, the same tokens

    with pytest.raises(SpecPilotError, match="from another benchmark"):
        _plan(embedded_target, path, resume=True, tokens=5)


def test_the_command_resumes_and_removes_its_checkpoint_when_done(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": p.question_id, "category": p.category, "split": "test",
                                           "turns": [p.text]}) + "\n" for p in PROMPTS))
    out = tmp_path / "out"
    args = ["--device", "cpu", "--draft", "ngram", "--prompts", str(prompts), "--policies", "none,static:1",
            "--max-new-tokens", "4", "--out", str(out), "--no-progress", "--resume"]
    out.mkdir()
    (out / "checkpoint.jsonl").write_text(json.dumps({"signature": {"policies": ["other"]}}) + "\n")
    assert run_cli(benchmark_main, args) == 2
    assert "from another benchmark" in capsys.readouterr().err
    (out / "checkpoint.jsonl").unlink()
    assert run_cli(benchmark_main, args) == 0  # nothing to resume: runs everything
    assert (out / "results.json").exists() and not (out / "checkpoint.jsonl").exists()


def test_the_order_warning_fires_exactly_when_some_policy_misses_a_position():
    """Brute force over the benchmark's own rotation: for every batch size (its J consecutive batches in the plan,
    after `start` batches of smaller sizes) count how often each policy runs in each position over R repeats;
    `order_imbalance` must warn exactly when those counts are unequal."""
    for policies in range(2, 6):
        names = [f"p{i}" for i in range(policies)]
        for repeats in range(1, 8):
            for start in range(3):
                for batches in range(1, 8):
                    counts = {}
                    for r in range(repeats):
                        for j in range(start, start + batches):
                            for pos, name in enumerate(benchmark.policy_order(names, r, j)):
                                counts[(name, pos)] = counts.get((name, pos), 0) + 1
                    balanced = len(set(counts.values())) == 1 and len(counts) == policies * policies
                    message = benchmark.order_imbalance(repeats, [batches], [4], policies)
                    assert (message is None) == balanced, (policies, repeats, start, batches)
    assert "use --repeats 5" in benchmark.order_imbalance(3, [8, 1], [1, 8], 5)
    assert "batch size 8 " in benchmark.order_imbalance(3, [10, 1], [1, 8], 5)


@pytest.mark.slow  # (10-30 s of real decoding; CI runs it, the default suite keeps under 8 min)
def test_each_load_settles_before_its_first_timed_batch(embedded_target, monkeypatch):
    """After a background load starts (each repeat switches loads), an untimed plain decode runs before the first
    timed batch: without it the first policy of a load ran 13-43% slower than in its other batches."""
    import contextlib

    import specpilot.env.load as load_module

    events = []

    @contextlib.contextmanager
    def fake_load(kind):
        events.append(("load", kind))
        yield []

    real_generate, real_run_one = benchmark.generate, benchmark._run_one
    monkeypatch.setattr(load_module, "background_load", fake_load)
    monkeypatch.setattr(benchmark.time, "sleep", lambda s: events.append(("sleep", s)))
    monkeypatch.setattr(benchmark, "generate", lambda *a, **k: (
        events.append(("settle", a[2].name)) if a[4] == benchmark.SETTLE_TOKENS else None, real_generate(*a, **k))[1])
    monkeypatch.setattr(benchmark, "_run_one", lambda *a, **k: (events.append(("run", a[-1])), real_run_one(*a, **k))[1])
    policies = {"none": StaticK(0), "static:2": StaticK(2)}
    run_batch_benchmark(embedded_target, NgramDrafter(3), policies, PROMPTS, [1], 4, 2, progress=False,
                        loads=["none", "compute"])
    starts = [i for i, e in enumerate(events) if e[0] == "load"]
    assert [events[i][1] for i in starts] == ["none", "compute", "compute", "none"]  # the order rotates per repeat
    for i in starts:
        assert events[i + 1][0] == "sleep" and events[i + 2] == ("settle", "static:0")
        assert events[i + 3] == ("run", events[i][1])
