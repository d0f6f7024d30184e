"""Fixtures shared by the evaluation tests: the eval data check and the real SmolLM2 tokenizer."""

from __future__ import annotations

import pytest

from tokenbridge import paths
from trainer.eval import datasets as eval_data
from trainer.eval.tasks import FETCH_HINT


@pytest.fixture(scope="session")
def eval_data_ready():
    if not eval_data.is_complete():
        pytest.fail(f"eval data missing in {paths.eval_data_dir()}: {FETCH_HINT}")


@pytest.fixture(scope="session")
def smol_tok(student_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(student_dir)
