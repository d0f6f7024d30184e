"""Prompts for the on-policy benchmarks: student-tokenized KJV verses (`bench_onpolicy`,
`onpolicy_step`, `onpolicy_fsdp` share them)."""

from __future__ import annotations

import json

from tokenbridge import paths


def prompts_from_kjv(tok, n: int, length: int) -> list[list[int]]:
    """`n` prompts of `length` student tokens (BOS first) from KJV verses."""
    lines = (paths.corpus_dir() / "kjv.jsonl").read_text().splitlines()
    out = []
    for line in lines[::97]:
        ids = tok.encode(json.loads(line)["text"]).ids.tolist()
        if len(ids) >= length - 1:
            out.append([tok.bos_id, *ids[: length - 1]])
        if len(out) == n:
            return out
    raise ValueError("not enough long verses")
