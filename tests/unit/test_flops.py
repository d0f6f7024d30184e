"""Model FLOPs per token (`tokenbridge.flops`), device peaks, MFU, the per-device record
(`trainer.throughput`) and the dtype rule ``auto`` (`tokenbridge.model_spec.resolve_dtype`).

The counts are checked three ways: by hand for a tiny config and for SmolLM2-135M's shipped
config.json, and against the matmul weights of the real transformers model built from each
shipped config (SmolLM2 and Gemma 3, on the meta device: no weights allocated).
"""

from __future__ import annotations

import json

import pytest
import torch

from tokenbridge import flops
from tokenbridge.model_spec import resolve_dtype
from trainer.throughput import Throughput

# hidden 64, 4 heads of 16 (kv: 2 of 16), MLP 128, 2 layers, 100 tokens
TINY = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
        "num_hidden_layers": 2, "vocab_size": 100}  # fmt: skip
# per layer: q 64x64 + k, v 64x32 each + o 64x64 = 12,288; MLP 3 x 64x128 = 24,576;
# 2 layers = 73,728; lm_head 100x64 = 6,400
TINY_N = 2 * (4096 + 2 * 2048 + 4096 + 3 * 8192) + 6400


def _config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def _linear_weights(config: dict) -> int:
    """Every nn.Linear weight of the transformers model of `config` (the lm_head counted even
    when tied to the embedding), built on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_flops_per_token_of_a_tiny_config_by_hand():
    assert TINY_N == 80_128 and flops.matmul_params(TINY) == TINY_N
    # training: 6 N + 12 L (H Q) seq = 480,768 + 12 x 2 x 64 x 32
    assert flops.flops_per_token(TINY, seq=32) == 480_768 + 49_152
    # a teacher's forward: 2 N + 4 L (H Q) seq
    assert flops.flops_per_token(TINY, seq=32, training=False) == 160_256 + 16_384
    # the attention width is heads x head_dim, not the hidden size, when they differ
    wide = {**TINY, "head_dim": 32}
    assert flops.attention_width(wide) == 128
    assert flops.flops_per_token({**TINY, "model_type": "gpt2"}, seq=32) is None  # no formula


def test_flops_per_token_of_smollm2_135m(student_dir):
    cfg = _config(student_dir)
    # 30 x (576x576 q + 2 x 576x192 k, v + 576x576 o + 3 x 576x1536 MLP) + 49,152 x 576 lm_head
    n = 30 * (331_776 + 2 * 110_592 + 331_776 + 2_654_208) + 28_311_552
    assert n == 134_479_872 == flops.matmul_params(cfg) == _linear_weights(cfg)
    # at 2048 positions: 6 N + 12 x 30 x 576 x 2048
    assert flops.flops_per_token(cfg, seq=2048) == 806_879_232 + 424_673_280


def test_gemma3_counts_its_sliding_window_layers_at_their_window(teacher_dir):
    cfg = _config(teacher_dir)
    assert flops.matmul_params(cfg) == _linear_weights(cfg)
    # 15 of 18 layers slide over 512 positions, 3 read the whole sequence
    assert flops.attention_context(cfg, 2048) == 15 * 512 + 3 * 2048
    assert flops.attention_context(cfg, 256) == 18 * 256
    # a window without layer types (Mistral) is every layer's; none is none
    mistral = {**TINY, "model_type": "mistral", "sliding_window": 16}
    assert (
        flops.attention_context(mistral, 64) == 2 * 16 and flops.attention_context(TINY, 64) == 128
    )
    n, width = flops.matmul_params(cfg), 4 * 256
    assert flops.flops_per_token(cfg, seq=2048, training=False) == 2 * n + 4 * width * 13_824


@pytest.mark.parametrize(
    ("name", "dtype", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bfloat16", 989.0),
        ("NVIDIA H100 PCIe", "bfloat16", 756.0),
        ("NVIDIA H200", "float16", 989.0),
        ("NVIDIA GH200 480GB", "bfloat16", 989.0),
        ("NVIDIA A100-SXM4-80GB", "bfloat16", 312.0),
        ("NVIDIA A100 80GB PCIe", "bfloat16", 312.0),
        ("NVIDIA GeForce RTX 4090", "bfloat16", None),  # not in the table: no guess
        ("NVIDIA H100 80GB HBM3", "float32", None),  # the table's peaks are bf16 / fp16
    ],
)
def test_peak_flops_by_device_name(name, dtype, tflops):
    got = flops.peak_flops(name, dtype=dtype)
    assert got == (None if tflops is None else tflops * 1e12)


def test_mfu_and_the_per_device_record():
    assert flops.mfu(494.5e12, 989e12) == 0.5
    assert flops.mfu(1e12, None) is None
    # two devices, 1000 student tokens in 0.5 s; a live teacher read 600 tokens
    tp = Throughput(world=2, student=TINY, teachers={"t": TINY}, peak=1e9)
    m = tp.record(tokens=1000, step_s=0.5, seq=32, teacher_tokens={"t": 600}, teacher_seq={"t": 16})
    assert m["tokens_per_s_per_device"] == 1000.0
    assert m["tflops_per_device"] == pytest.approx(1000 * 529_920 / 1e12)
    assert m["mfu"] == pytest.approx(1000 * 529_920 / 1e9)
    teacher_per_s = 600 * flops.flops_per_token(TINY, seq=16, training=False) / 2 / 0.5
    assert m["teacher_mfu"] == pytest.approx(teacher_per_s / 1e9)
    # no peak: FLOPs but no MFU; no sequence length (a step that also sampled): neither
    bare = Throughput(world=2, student=TINY)
    assert set(bare.record(tokens=1000, step_s=0.5, seq=32)) == {
        "tokens_per_s_per_device", "tflops_per_device"}  # fmt: skip
    assert set(bare.record(tokens=10, step_s=1.0, seq=None)) == {"tokens_per_s_per_device"}
    assert bare.summary()["tokens_per_s_per_device"] == pytest.approx((1000 + 5) / 2)
    assert bare.summary()["peak_tflops"] is None and tp.summary()["peak_tflops"] == 1e-3


def test_auto_dtype_is_bfloat16_on_cuda_and_float32_elsewhere():
    assert resolve_dtype("auto", "cuda") == resolve_dtype("auto", "cuda:1") == "bfloat16"
    assert resolve_dtype("auto", torch.device("cpu")) == "float32"
    assert resolve_dtype("float32", "cuda") == "float32"  # a named dtype is kept
    with pytest.raises(ValueError, match="dtype: expected one of"):
        resolve_dtype("fp8", "cuda")
