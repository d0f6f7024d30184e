"""Alignment of two tokenizations of one text into chunks, and windows cut at chunk ends.

A chunk is a minimal pair of token runs (student, teacher) covering the same bytes of the text.
`align` / `align_batch` / `align_batch_flat` compute them (an O(n + m) Numba walk over byte
offsets, a banded DP over canonical bytes where offsets cannot be trusted); `cut_windows` cuts a
long document into training windows that end at the same character on every side.

- `alignment`: the public API and its records (`Alignment`, `BatchAlignment`, `VocabBytes`);
- `kernel`: the Numba kernel that aligns a whole batch in one call;
- `dp`: the DP fallback the kernel hands untrusted regions to;
- `windows`: window cutting at cut points common to every (student, teacher) pair.
- `text_shards`: a complete shard directory from a few texts, aligned in process (no Beam).

Modules inside this package import each other directly, never through this file.
"""

from tokenbridge.alignment.chunks import (
    CHUNK_1_1,
    CHUNK_1_N,
    CHUNK_KIND_NAMES,
    CHUNK_N_1,
    CHUNK_N_M,
    Alignment,
    AlignmentError,
    BatchAlignment,
    VocabBytes,
    align,
    align_batch,
    align_batch_flat,
    align_flat,
    vocab_bytes,
)
from tokenbridge.alignment.windows import (
    CutPoints,
    Window,
    WindowConfig,
    WindowError,
    cut_points,
    cut_windows,
)

__all__ = [
    "CHUNK_1_1",
    "CHUNK_1_N",
    "CHUNK_KIND_NAMES",
    "CHUNK_N_1",
    "CHUNK_N_M",
    "Alignment",
    "AlignmentError",
    "BatchAlignment",
    "CutPoints",
    "VocabBytes",
    "Window",
    "WindowConfig",
    "WindowError",
    "align",
    "align_batch",
    "align_batch_flat",
    "align_flat",
    "cut_points",
    "cut_windows",
    "vocab_bytes",
]
