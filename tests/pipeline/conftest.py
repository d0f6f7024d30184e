"""Fixtures for the Beam job tests: the real pair, loaded once through the job's own cache."""

from __future__ import annotations

import pytest

from pipelines.align import align_dofns as F


@pytest.fixture(scope="session")
def pair_paths(teacher_dir, student_dir) -> tuple[str, str]:
    """(teacher, student) path strings exactly as the job receives them, so DoFn.setup() in the
    in-process runner finds the tokenizers already in its per-process cache."""
    return str(teacher_dir), str(student_dir)


@pytest.fixture(scope="session")
def pair_tokenizers(pair_paths):
    t, s = pair_paths
    return F.cached_tokenizer(t), F.cached_tokenizer(s)
