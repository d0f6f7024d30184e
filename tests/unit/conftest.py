"""Fixtures shared by the unit tests: the eval data check, the real SmolLM2 tokenizer (HF), and
the four real tokenizers the window tests cut every text with (`toks`; a module that wants
other tokenizers defines its own `toks`)."""

from __future__ import annotations

import pytest

from tokenbridge import paths
from tokenbridge.tokenizers import load_tokenizer
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


@pytest.fixture(scope="module")
def toks(teacher_dir, student_dir, vocab_fixture):
    return {
        "gemma": load_tokenizer(teacher_dir),
        "smollm2": load_tokenizer(student_dir),
        "qwen2": load_tokenizer(vocab_fixture("qwen2")),
        "phi-3": load_tokenizer(vocab_fixture("phi-3")),
    }
