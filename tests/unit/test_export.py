"""The student's export (`tokenbridge.models.export_hf`) and the loader of exports
(`load_pretrained`) are strict: a key too many or too few is an error naming it, never a
weight dropped or initialised at random; tied weights (SmolLM2 ties lm_head to the
embeddings) work with either name given, or both when equal. The export of a real run is
checked against the run's checkpoint and its own held-out bits per byte in
tests/e2e/test_debug_run.py."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenbridge import models
from trainer.eval.runner import load_model

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}  # fmt: skip
HEAD, EMBED = "lm_head.weight", "model.embed_tokens.weight"


def spec(student_dir, **more) -> models.ModelSpec:
    return models.ModelSpec(str(student_dir), init="random", seed=3, overrides={**TINY, **more})


def trained_state(cfg) -> dict[str, torch.Tensor]:
    """A random model's full state dict, every tensor moved off its init (a "trained" one)."""
    model = models.build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_export_round_trips_every_tensor_and_keeps_the_tie(student_dir, tmp_path):
    cfg = spec(student_dir)
    sd = trained_state(cfg)
    assert HEAD in sd and torch.equal(sd[HEAD], sd[EMBED])  # tied: one tensor, two names
    out = models.export_hf(sd, cfg=cfg, out_dir=tmp_path / "export")
    assert HEAD not in load_file(out / "model.safetensors")  # saved once, under one name
    model = models.load_pretrained(out)
    got = model.state_dict()
    assert set(got) == set(sd)
    assert all(torch.equal(got[k], sd[k]) for k in sd)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_export_of_a_tied_weight_under_one_name(student_dir, tmp_path):
    """What `save_pretrained` itself writes (no lm_head.weight) exports as well."""
    cfg = spec(student_dir)
    sd = trained_state(cfg)
    del sd[HEAD]
    model = models.load_pretrained(models.export_hf(sd, cfg=cfg, out_dir=tmp_path / "e"))
    assert torch.equal(model.lm_head.weight, sd[EMBED])


@pytest.mark.parametrize(
    "edit, named",
    [
        ("extra", r"unexpected keys \['model\.layers\.9\.mlp\.up_proj\.weight'\]"),
        ("missing", r"missing keys \['model\.norm\.weight'\]"),
        ("untied head differs", "lm_head.weight and model.embed_tokens.weight are tied"),
        ("prefixed", r"unexpected keys \['module\.lm_head\.weight', .*missing keys"),
    ],
)
def test_export_refuses_a_state_dict_that_does_not_match(student_dir, tmp_path, edit, named):
    cfg = spec(student_dir)
    sd = trained_state(cfg)
    if edit == "extra":  # e.g. a layer of a deeper model: silently dropped before
        sd["model.layers.9.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"]
    elif edit == "missing":
        del sd["model.norm.weight"]
    elif edit == "untied head differs":  # the export would keep only one of the two
        sd[HEAD] = sd[HEAD] + 1.0
    else:  # a wrapper's prefix on every key (FSDP1, DDP): nothing would have loaded
        sd = {f"module.{k}": v for k, v in sd.items()}
    out = tmp_path / "export"
    with pytest.raises(models.WeightKeysError, match=named) as e:
        models.export_hf(sd, cfg=cfg, out_dir=out)
    assert str(out) in str(e.value) and str(student_dir) in str(e.value)
    assert not out.exists() and list(tmp_path.iterdir()) == []  # nothing left behind


def test_an_untied_model_needs_its_own_head(student_dir, tmp_path):
    cfg = spec(student_dir, tie_word_embeddings=False)
    sd = trained_state(cfg)
    assert not torch.equal(sd[HEAD], sd[EMBED])
    model = models.load_pretrained(models.export_hf(sd, cfg=cfg, out_dir=tmp_path / "ok"))
    assert torch.equal(model.lm_head.weight, sd[HEAD])
    del sd[HEAD]
    with pytest.raises(models.WeightKeysError, match=r"missing keys \['lm_head\.weight'\]"):
        models.export_hf(sd, cfg=cfg, out_dir=tmp_path / "bad")


@pytest.mark.parametrize(
    "edit, named",
    [
        ("drop", r"missing keys \['model\.layers\.1\.self_attn\.q_proj\.weight'\]"),
        ("add", r"unexpected keys \['model\.layers\.2\.input_layernorm\.weight'\]"),
    ],
)
def test_loading_a_directory_whose_weights_miss_or_add_a_key_is_refused(
    student_dir, tmp_path, edit, named
):
    """transformers alone would initialise the missing weight at random (or drop the extra one)
    with a warning; the trainer's loader and the eval's (which scores exports) refuse it."""
    cfg = spec(student_dir)
    out = models.export_hf(trained_state(cfg), cfg=cfg, out_dir=tmp_path / "export")
    weights = load_file(out / "model.safetensors")
    if edit == "drop":
        del weights["model.layers.1.self_attn.q_proj.weight"]
    else:
        weights["model.layers.2.input_layernorm.weight"] = weights["model.norm.weight"].clone()
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(models.WeightKeysError, match=named):
        models.load_pretrained(out)
    with pytest.raises(models.WeightKeysError, match=named):
        load_model(out, device="cpu", dtype="float32")
    with pytest.raises(models.WeightKeysError, match=named):
        models.build_model(models.ModelSpec(str(out)))
