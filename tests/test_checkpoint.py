"""decoding.paths.Checkpoint: a killed run's finished units come back on --resume, a torn last line is dropped
(and does not corrupt the next append), and a file from other settings is refused."""
import pytest

from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.paths import Checkpoint


def test_resume_reads_finished_units_and_drops_a_torn_tail(tmp_path):
    path = tmp_path / "run.checkpoint.jsonl"
    first = Checkpoint(path, {"a": 1}, resume=False)
    assert first.rows == []
    first.append({"unit": 0})
    first.append({"unit": 1})
    with path.open("a") as f:
        f.write('{"unit": 2, "tor')  # a kill in the middle of a write
    again = Checkpoint(path, {"a": 1}, resume=True)
    assert again.rows == [{"unit": 0}, {"unit": 1}]
    again.append({"unit": 2})  # lands on a line of its own, not glued to the torn text
    assert Checkpoint(path, {"a": 1}, resume=True).rows == [{"unit": 0}, {"unit": 1}, {"unit": 2}]


def test_without_resume_or_file_a_run_starts_over(tmp_path):
    path = tmp_path / "c.jsonl"
    Checkpoint(path, {"a": 1}, resume=False).append({"unit": 0})
    assert Checkpoint(path, {"a": 1}, resume=False).rows == []  # no --resume: a fresh file
    assert Checkpoint(tmp_path / "none.jsonl", {"a": 1}, resume=True).rows == []  # nothing to resume: fresh


def test_other_settings_or_a_corrupt_middle_line_are_refused(tmp_path):
    path = tmp_path / "c.jsonl"
    Checkpoint(path, {"a": 1}, resume=False).append({"unit": 0})
    with pytest.raises(SpecPilotError, match="from another cross-fit"):
        Checkpoint(path, {"a": 2}, resume=True, what="cross-fit")
    path.write_text(path.read_text() + "garbage\n" + '{"unit": 1}\n')
    with pytest.raises(SpecPilotError, match="line 3 is not JSON"):
        Checkpoint(path, {"a": 1}, resume=True)
    keep = Checkpoint(tmp_path / "d.jsonl", {}, resume=False)
    keep.remove()
    assert not keep.path.exists()
