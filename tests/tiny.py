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
