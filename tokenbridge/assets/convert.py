"""Convert a GGUF model once into a plain HF directory, and prove the result is right.

transformers loads a GGUF by dequantizing it to an ordinary fp32 model, but (5.23) keeps the
GGUF quantizer attached and refuses `save_pretrained`. We drop the quantizer and the
quantization_config it left, save, and verify the saved directory before it replaces anything:
the same vocabulary fingerprint as the GGUF's, an lm_head of exactly config.vocab_size rows (at
least the tokenizer's ids), finite logits, identical after reloading.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenbridge.assets.store import log, staged

PROBE = "The quick brown fox jumps over the lazy dog. To be, or not to be: 1234567."


def detach_gguf_quantizer(model) -> None:
    """Make a GGUF-loaded (already fp32) model saveable: forget the quantizer and its config."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _logits(model, ids: list[int]):
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def verify_model_dir(directory: Path, *, reference, gguf: Path) -> dict:
    """Check a saved HF directory against the in-memory model it was saved from."""
    import torch
    from transformers import AutoModelForCausalLM

    from tokenbridge.tokenizers import load_tokenizer

    tok = load_tokenizer(directory)
    tok_gguf = load_tokenizer(gguf)
    if tok.fingerprint != tok_gguf.fingerprint:
        raise RuntimeError(f"{directory}: saved tokenizer differs from the vocabulary of {gguf}")
    config = json.loads((directory / "config.json").read_text())
    if "quantization_config" in config:
        raise RuntimeError(f"{directory}/config.json still carries a quantization_config")
    vocab = int(config["vocab_size"])
    reloaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    rows = reloaded.get_output_embeddings().weight.shape[0]
    if not rows == vocab >= tok.vocab_size:
        raise RuntimeError(
            f"{directory}: lm_head rows {rows}, config vocab_size {vocab}, tokenizer ids "
            f"{tok.vocab_size}: need rows == vocab_size >= tokenizer ids"
        )
    ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(PROBE).ids.tolist()
    before, after = _logits(reference, ids), _logits(reloaded, ids)
    if not torch.isfinite(after).all():
        raise RuntimeError(f"{directory}: forward pass gives non-finite logits")
    diff = float((before - after).abs().max())
    if diff > 1e-5:
        raise RuntimeError(f"{directory}: logits change by {diff:.3g} after reload")
    log(
        f"verified {directory.name}: lm_head {rows} rows, tokenizer {tok.vocab_size} ids, "
        f"{len(ids)} probe tokens, reload max |dlogit| {diff:.2g}"
    )
    return {
        "vocab_size": vocab,
        "lm_head_rows": rows,
        "tokenizer_vocab_size": tok.vocab_size,
        "fingerprint": tok.fingerprint,
        "reload_max_abs_logit_diff": diff,
    }


def convert_gguf(gguf: Path, out: Path) -> dict:
    """GGUF -> verified HF directory at `out` (atomic); returns what was verified."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"converting {gguf.name} -> {out} (dequantize to fp32)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    model.eval()
    detach_gguf_quantizer(model)
    # saved and verified in a staging directory: a conversion that fails verification never
    # replaces anything
    with staged(out, directory=True) as stage:
        model.save_pretrained(stage.path)
        tokenizer.save_pretrained(stage.path)
        info = verify_model_dir(stage.path, reference=model, gguf=gguf)
    info["kept_identical_existing"] = not stage.replaced
    return info
