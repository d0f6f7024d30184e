"""The tokenizer-pair report on the real Gemma x SmolLM2 pair."""

from __future__ import annotations

import pytest

from tokenbridge.commands import pair_report as pr
from tokenbridge.tokenizers import load_tokenizer


@pytest.fixture(scope="module")
def pair(teacher_dir, student_dir):
    return load_tokenizer(teacher_dir), load_tokenizer(student_dir)


@pytest.fixture(scope="module")
def report(pair, corpus_dir):
    _, text = pr.default_text(20_000)
    return pr.pair_report(*pair, text)


def test_overlap_by_bytes_not_spelling(report):
    """About 46,000 SmolLM2 tokens have a byte-identical Gemma token; by spelling only 14,837,
    138 of them wrongly (same spelling, other bytes: byte-level stand-ins vs real letters)."""
    assert report["teacher"]["vocab_size"] == 262_144
    assert report["student"]["vocab_size"] == 49_152
    s2t = report["byte_identical"]["student_in_teacher"]
    assert 40_000 < s2t < 49_152
    assert 40_000 < report["byte_identical"]["teacher_in_student"] < 60_000
    assert report["string_identical"] == {
        "student_in_teacher": 14_837,
        "student_in_teacher_false": 138,
    }


def test_overlap_is_symmetric_on_one_tokenizer(pair):
    teacher, _ = pair
    regular = sum(1 for b in teacher.token_bytes() if b)
    assert pr.byte_overlap(teacher, teacher) == regular
    same, false = pr.string_overlap(teacher, teacher)
    assert false == 0 and same == sum(1 for s in teacher.token_strings() if s is not None)


def test_digit_splits_reassemble(report):
    for sample, sides in report["digits"].items():
        assert "".join(sides["teacher"]) == sample == "".join(sides["student"])
    # both tokenizers of the pair write numbers digit by digit
    assert report["digits"]["1234567"]["student"] == list("1234567")
    assert report["digits"]["1234567"]["teacher"] == list("1234567")


def test_sample_figures(report):
    sm = report["sample"]
    assert sm["bytes"] >= 19_000
    assert 2.5 < sm["teacher_bytes_per_token"] < 6 and 2.5 < sm["student_bytes_per_token"] < 6
    assert sm["teacher_tokens"] * sm["teacher_bytes_per_token"] == pytest.approx(sm["bytes"])
    # English prose: most cuts are shared (word starts), not all (sub-word splits differ)
    assert (
        0.7 < sm["student_boundaries_shared"] < 1.0 and 0.7 < sm["teacher_boundaries_shared"] < 1.0
    )
    assert sm["common_boundaries"] <= min(sm["teacher_tokens"], sm["student_tokens"])


def test_boundaries_of_a_known_text(pair):
    """Hand-checkable: 'Hello world' cuts after 'Hello' (5) and at the end (11) on both."""
    teacher, student = pair
    ends, n_tokens, n_bytes = pr.boundaries(teacher, ["Hello world", "\n"])
    assert n_bytes == 12 and ends.tolist()[-1] == 12 and 5 in ends.tolist()
    assert n_tokens == len(teacher.encode("Hello world").ids) + len(teacher.encode("\n").ids)
    assert pr.split_pieces(student, "Hello world") == ["Hello", " world"]


def test_cli_prints_the_report(pair, tmp_path, capsys, teacher_dir, student_dir):
    sample = tmp_path / "sample.txt"
    sample.write_text("To be, or not to be, that is the question. 1234567\n" * 20)
    assert pr.main([str(teacher_dir), str(student_dir), str(sample)]) == 0
    out = capsys.readouterr().out
    assert "gemma-3-270m" in out and "smollm2-135m" in out and "byte-identical" in out
    assert "14,837" in out and "'1|2|3|4|5|6|7'" in out
