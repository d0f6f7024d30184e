"""Model FLOPs per token from a HF config, device peaks, and model FLOPs utilisation (MFU).

MFU (PaLM, Chowdhery et al. 2022, appendix B) counts the FLOPs the model requires, not what an
implementation runs (recomputation, padding, repeated rows), so it compares layouts and code
paths fairly. Only the gated-MLP decoders of `GATED_MLP` have a formula, and only the devices of
`PEAK_TFLOPS` a peak; anything else gets None (no MFU), never a guess.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# decoder-only model types whose layers are attention (q, k, v, o) + a gated MLP (gate, up, down)
GATED_MLP = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo", "olmo2"}
)

# dense bf16 / fp16 tensor-core peak, TFLOP/s, from NVIDIA's datasheets (the halved "with
# sparsity" figure; a float32 run gets no peak), by the words of torch.cuda.get_device_name():
# the first entry whose words all occur in the name wins (the PCIe / NVL parts before the SXM)
PEAK_TFLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("H100", "PCIe"), 756.0),
    (("H100", "NVL"), 835.0),
    (("H100",), 989.0),  # SXM5 ("NVIDIA H100 80GB HBM3")
    (("H200", "NVL"), 835.0),
    (("H200",), 989.0),  # SXM ("NVIDIA H200")
    (("GH200",), 989.0),
    (("A100",), 312.0),  # SXM4 and PCIe, 40 and 80 GB alike
)
PEAK_DTYPES = ("bfloat16", "float16")  # the compute dtypes the table's peaks are for


def _get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def matmul_params(config: Any) -> int | None:
    """N: the weights of every matmul a token goes through, from a HF config (a
    `PretrainedConfig` or its dict); None for an unsupported model type.

    The attention projections (q, k, v at grouped-query widths, o), the MLP (gate, up, down) and
    the lm_head (V x hidden, tied to the input embedding or not: the matmul runs either way).
    The input embedding (a lookup), norms and biases (elementwise) are left out."""
    if _get(config, "model_type") not in GATED_MLP:
        return None
    hidden = int(_get(config, "hidden_size"))
    heads = int(_get(config, "num_attention_heads"))
    kv_heads = int(_get(config, "num_key_value_heads") or heads)
    head_dim = int(_get(config, "head_dim") or hidden // heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = hidden * q + 2 * hidden * kv + q * hidden  # q, k, v, o
    mlp = 3 * hidden * int(_get(config, "intermediate_size"))  # gate, up, down
    layers = int(_get(config, "num_hidden_layers"))
    return layers * (attention + mlp) + int(_get(config, "vocab_size")) * hidden


def attention_context(config: Any, seq: int) -> int:
    """The positions each token's attention reads, summed over the layers: ``seq`` per layer,
    ``min(seq, sliding_window)`` for a layer its ``layer_types`` marks as sliding (every layer
    when a config sets a window and no layer types, as Mistral's does)."""
    layers = int(_get(config, "num_hidden_layers"))
    window = _get(config, "sliding_window")
    types = list(_get(config, "layer_types") or [])[:layers]
    # no layer types (Mistral): a set window is every layer's
    types += ["sliding_attention" if window and not types else "full_attention"] * (
        layers - len(types)
    )
    return sum(min(seq, int(window)) if t == "sliding_attention" and window else seq for t in types)


def attention_width(config: Any) -> int:
    """H·Q: the heads times their dimension (the hidden size when head_dim is not set)."""
    heads = int(_get(config, "num_attention_heads"))
    return heads * int(_get(config, "head_dim") or int(_get(config, "hidden_size")) // heads)


def flops_per_token(config: Any, *, seq: int, training: bool = True) -> float | None:
    """Model FLOPs per token at sequence length `seq`: ``6 N + 12 L H Q seq`` for a training
    step (forward and backward), ``2 N + 4 L H Q seq`` for a forward (a teacher's); None for a
    model type without a formula here.

    Two FLOPs per weight per token for the forward's matmuls (three times that with the
    backward), plus the attention's scores and weighted sum (QK^T and AV: 2 x 2 H Q seq per layer
    forward), counted over the whole sequence as PaLM and Megatron do, not halved for the causal
    mask; a sliding-window layer reads ``min(seq, window)`` (`attention_context`)."""
    n = matmul_params(config)
    if n is None:
        return None
    per_weight, per_score = (6, 12) if training else (2, 4)
    return float(
        per_weight * n + per_score * attention_width(config) * attention_context(config, seq)
    )


def peak_flops(device_name: str, *, dtype: str) -> float | None:
    """Peak dense FLOP/s of one device of `device_name` (``torch.cuda.get_device_name()``) when
    computing in `dtype`; None when the table does not know the device or the dtype."""
    if dtype not in PEAK_DTYPES:
        return None
    words = device_name.replace("-", " ").split()
    for needed, tflops in PEAK_TFLOPS:
        if all(w in words for w in needed):
            return tflops * 1e12
    return None


def mfu(flops_per_s: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s of one device over its peak (None without
    a peak)."""
    if peak is None or peak <= 0:
        return None
    return flops_per_s / peak
