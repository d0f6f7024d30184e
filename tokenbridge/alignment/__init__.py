"""Alignment of two tokenizations of one text into chunks, and windows cut at chunk ends.

A chunk is a minimal pair of token runs (student, teacher) covering the same bytes of the text;
windows end at the same character on every side (docs/alignment.md). The modules inside import
each other directly, never through this file.
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
