"""Test inputs the benchmarks do not need (those both use: `bench.common`, and shards from
texts: `tokenbridge.alignment.text_shards`).

`identity_projection` maps a tokenizer onto itself; `example_rows` (the shipped example
conversations) and `write_chat_shards` (a conversation shard directory, by the align job's pure
steps, without Beam) live in `bench.common`, which the packing bench shares; re-exported here.
"""

from __future__ import annotations

import os
from pathlib import Path

from bench.common import example_rows, write_chat_shards  # noqa: F401 (re-exported)
from tokenbridge import paths, projection
from tokenbridge.tokenizers import load_tokenizer

REPO = paths.REPO_ROOT


def identity_projection(tokenizer_dir: str | os.PathLike, out: str | os.PathLike) -> Path:
    """A k=2 projection of a tokenizer onto itself (rows padded to 49152), saved at ``out``."""
    tok = load_tokenizer(tokenizer_dir)
    return projection.save_projection(
        projection.build_projection(tok, tok, k=2, teacher_rows=49152, student_rows=49152), out
    )
