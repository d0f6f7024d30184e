"""The demo's comparison table (trainer.report.compare): the arithmetic each claim rests on,
against hand-computed values. The science table's statistics: tests/unit/test_science_stats.py."""

from __future__ import annotations

import json

import pytest

from tokenbridge.cli import UsageError
from trainer.report import compare


def summary(after: float, *, before: float = 1.5, teachers=None, secs: float = 10.0) -> dict:
    return {"bpb": {"student_before": before, "student_after": after, "teachers": teachers or {}},
            "eval_texts": 4, "eval_bytes": 1000, "steps_this_run": 20, "train_seconds": secs}  # fmt: skip


def test_gap_closed_is_the_share_of_the_student_teacher_gap():
    assert compare.gap_closed(1.5, 1.4, 1.0) == pytest.approx(0.2)
    assert compare.gap_closed(1.5, 0.9, 1.0) == pytest.approx(1.2)  # beat the teacher
    assert compare.gap_closed(1.5, 1.6, 1.0) == pytest.approx(-0.2)  # got worse
    assert compare.gap_closed(1.0, 0.9, 1.2) is None  # the teacher does not lead


def test_compare_renders_every_run_and_the_teacher(tmp_path):
    for name, s in {"kd": summary(1.3, teachers={"t": 1.0}), "ce": summary(1.4)}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(s))
    out = tmp_path / "cmp.md"
    assert compare.main([f"KD={tmp_path / 'kd'}", f"CE={tmp_path / 'ce'}", "--out", str(out)]) == 0
    text = out.read_text()
    assert "| KD | 20 | 10 | 1.3000 | -0.2000 | 40% |" in text
    assert "| CE | 20 | 10 | 1.4000 | -0.1000 | 20% |" in text
    assert "| teacher t (untrained reference) | - | - | 1.0000 |" in text


def test_compare_refuses_runs_on_different_eval_sets(tmp_path):
    other = summary(1.4)
    other["eval_bytes"] = 999
    with pytest.raises(UsageError, match="different held-out texts"):
        compare.render({"a": summary(1.3), "b": other})
    with pytest.raises(UsageError, match="different students"):
        compare.render({"a": summary(1.3), "b": summary(1.3, before=1.6)})
    assert compare.main([str(tmp_path / "nope")]) == 2
