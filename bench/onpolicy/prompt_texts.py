"""Prompts for the on-policy benchmarks: student-tokenized KJV verses, or the starts of any lines."""

from __future__ import annotations

import json

from tokenbridge import paths


def prompts_from_kjv(tok, n: int, length: int) -> list[list[int]]:
    """`n` prompts of `length` student tokens (BOS first) from KJV verses."""
    lines = (paths.corpus_dir() / "kjv.jsonl").read_text().splitlines()
    return prompts_from_lines(tok, [json.loads(x)["text"] for x in lines[::97]], n, length)


def prompts_from_lines(tok, lines: list[str], n: int, length: int) -> list[list[int]]:
    """`n` prompts of `length` tokens of `tok` (BOS first), each the start of one of `lines`
    (in order) that is long enough."""
    out = []
    for line in lines:
        ids = tok.encode(line).ids.tolist()
        if len(ids) >= length - 1:
            out.append([tok.bos_id, *ids[: length - 1]])
        if len(out) == n:
            return out
    raise ValueError(f"not enough lines of {length - 1} tokens for {n} prompts")
