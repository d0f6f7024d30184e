"""The demo's comparison table (trainer.report.compare) and the science table's aggregation
(bench.science_table): the arithmetic each claim rests on, against hand-computed values."""

from __future__ import annotations

import json
import math

import pytest

from bench.science_table import mean_se, render, row_stats
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


def test_mean_se_matches_the_textbook_formula():
    m, se = mean_se([1.0, 2.0, 4.0])
    assert m == pytest.approx(7 / 3)
    sd = math.sqrt(sum((x - 7 / 3) ** 2 for x in (1, 2, 4)) / 2)
    assert se == pytest.approx(sd / math.sqrt(3))
    assert mean_se([1.25]) == (1.25, None)


def run(row: str, seed: int, after: float, *, lr=5e-5, suite=None, teachers=None) -> dict:
    evals = {"ood": {"text:x": {"value": after + 0.5, "stderr": 0.01}}}
    if suite:
        evals["suite"] = suite
    return {"row": row, "seed": seed, "lr": lr, "summary": summary(after, teachers=teachers),
            "evals": evals}  # fmt: skip


def test_science_table_goals_follow_the_numbers():
    suite = {"gsm8k_bpb": {"value": 0.70, "stderr": 0.01}}
    base_suite = {"gsm8k_bpb": {"value": 0.65, "stderr": 0.01}}
    payload = {
        "lr": 5e-5,
        "rows": {"ce": "CE only", "xtoken": "xtoken forward", "trl_gold": "TRL"},
        "baselines": {"student": {"suite": base_suite}},
        "runs": [
            run("ce", 0, 1.40), run("ce", 1, 1.42),
            run("xtoken", 0, 1.30, suite=suite, teachers={"t": 1.0}), run("xtoken", 1, 1.32),
            run("trl_gold", 0, 1.45), run("trl_gold", 1, 1.47),
            run("ce", 0, 1.50, lr=1e-4),
        ],
    }  # fmt: skip
    s = row_stats([r for r in payload["runs"] if r["row"] == "xtoken"])
    assert s["in"][0] == pytest.approx(1.31) and s["in"][1] == pytest.approx(0.01)
    text = render(payload)
    # best KD 1.31 vs CE 1.41: 0.10 over an SE of the difference of sqrt(2) * 0.01
    assert f"{0.1 / math.sqrt(2 * 1e-4):.1f} standard errors" in text
    assert "goal >= 2: **met**" in text
    assert "best KD 38%, CE-only 18%" in text and "goal >= 40%: **missed**" in text
    assert "+0.1500 in its favour; goal: **met**" in text  # vs TRL
    assert "xtoken forward gsm8k_bpb +0.050" in text  # worse than the student beyond its SE
    assert "| CE only | 0.0001 | 1.5000 |" in text  # the LR check row
