"""Tiny random-init causal LMs for fast tests (real tokenizers elsewhere, toy weights here).

One builder so that every test's "tiny Llama" is the same shape family; a test that needs other
sizes passes them as keywords (they go straight into `LlamaConfig`).
"""

from __future__ import annotations

from pathlib import Path

import torch


def tiny_llama(vocab_size: int, *, seed: int = 0, **overrides):
    """A 2-layer Llama of width 32 (GQA 2:1) with `vocab_size` outputs, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    shape = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 128,
    }
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, **{**shape, **overrides})).eval()


def save_tiny_llama(out: Path, vocab_size: int, **overrides) -> str:
    """`tiny_llama` saved as a HF directory (what teacher workers load); returns the path."""
    tiny_llama(vocab_size, **overrides).save_pretrained(out)
    return str(out)


SERVED_K = 64  # the test server's max_logprobs: kd_topk's default k (xtoken's is 32)


def save_served_teacher(out: Path, tokenizer_dir: Path) -> str:
    """A tiny teacher a vLLM server can load: `tiny_llama` over `tokenizer_dir`'s vocabulary
    with head_dim 32 (vLLM's CPU attention has no 16), peaked (init scale 0.5: KD of nats, not
    1e-5), saved with that directory's tokenizer files; returns the path."""
    import json
    import shutil

    vocab = json.loads((Path(tokenizer_dir) / "config.json").read_text())["vocab_size"]
    save_tiny_llama(out, vocab, hidden_size=64, initializer_range=0.5,
                    max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer_dir) / name, Path(out) / name)
    return str(out)
