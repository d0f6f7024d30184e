"""Shared fixtures: paths to the real assets that `make models` prepares.

Tests use real tokenizers and models; when an asset is missing the test fails with the command
that makes it, rather than skipping (a skip would hide a broken setup).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tokenbridge import paths

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _need(path: Path) -> Path:
    if not path.exists():
        pytest.fail(f"missing asset {path}: run `make models` first", pytrace=False)
    return path


@pytest.fixture(scope="session")
def teacher_dir() -> Path:
    """Real Gemma-3-270M as a HF directory."""
    return _need(paths.teacher_dir())


@pytest.fixture(scope="session")
def student_dir() -> Path:
    """Real SmolLM2-135M-Instruct as a HF directory."""
    return _need(paths.student_dir())


@pytest.fixture(scope="session")
def vocab_fixture():
    """Callable: family name -> path of the llama.cpp vocab-only GGUF."""
    return lambda family: _need(paths.vocab_fixture(family))


@pytest.fixture(scope="session")
def corpus_dir() -> Path:
    return _need(paths.corpus_dir())
