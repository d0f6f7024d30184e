"""Models built on the meta device and filled shard by shard (`tokenbridge.models.build_meta`,
`tokenbridge.model_init`, `tokenbridge.weight_slices`, `trainer.parallel.materialize`) hold
exactly the weights `build_model` gives: the recorded random init replayed (SmolLM2- and
Gemma 3-shaped, float32 and bfloat16, whole and in blocks of rows, one box of rows alone), and
pretrained weights read by slices with the same key checks as `load_pretrained`. The sharded
layouts (FSDP, TP, both) are tested on several ranks in tests/dist/test_parallel_trainer.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenbridge import model_init, models
from tokenbridge.weight_slices import ShardTarget, whole
from trainer.parallel.materialize import materialize

SMOL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip
GEMMA = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip


@pytest.fixture(scope="module")
def specs(student_dir, teacher_dir) -> dict[str, models.ModelSpec]:
    return {
        "smollm2": models.ModelSpec(str(student_dir), init="random", seed=1, overrides=SMOL),
        "gemma3": models.ModelSpec(str(teacher_dir), init="random", seed=2, overrides=GEMMA),
    }


def built(spec, dtype=torch.float32) -> torch.nn.Module:
    """`build_meta`, then every weight materialized and filled whole (one process)."""
    model, weights = models.build_meta(spec, dtype=dtype)
    materialize(model, weights, device=torch.device("cpu"))
    return model


def assert_same(got: torch.nn.Module, want: torch.nn.Module) -> None:
    a, b = got.state_dict(), want.state_dict()
    assert a.keys() == b.keys()
    assert [k for k in b if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])] == []
    bufs = dict(want.named_buffers())
    assert [k for k, v in got.named_buffers() if not torch.equal(v, bufs[k])] == []
    assert got.lm_head.weight is got.model.embed_tokens.weight  # still one tied parameter


@pytest.mark.parametrize(
    "name, dtype",
    [("smollm2", torch.float32), ("gemma3", torch.float32), ("gemma3", torch.bfloat16)],
)
def test_random_init_replayed_equals_build_model_bit_for_bit(specs, name, dtype):
    assert_same(built(specs[name], dtype), models.build_model(specs[name], dtype=dtype))


def test_replay_in_small_blocks_and_one_box_of_rows(specs, monkeypatch):
    """Blocks of 64 elements (the embedding's padding row inside one of them), and a rank that
    holds rows 7..20 of each matrix (an uneven cut) alone: the same numbers."""
    monkeypatch.setattr(model_init, "BLOCK_ELEMS", 64)
    want = models.build_model(specs["smollm2"]).state_dict()
    assert_same(built(specs["smollm2"]), models.build_model(specs["smollm2"]))
    model, weights = models.build_meta(specs["smollm2"])
    targets = {}
    for name, p in model.named_parameters():
        box = tuple(
            slice(7, 21) if d == 0 and n > 21 else slice(0, n) for d, n in enumerate(p.shape)
        )
        shape = [s.stop - s.start for s in box]
        targets[name] = ShardTarget(torch.empty(shape), box, tuple(p.shape))
    weights.fill(targets)
    for name, t in targets.items():
        assert torch.equal(t.out, want[name][t.box]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("draw", ["normal_", "uniform_"])
def test_cpu_draws_in_blocks_of_16_elements_equal_one_draw(dtype, draw):
    """What the replay relies on: blocks of a multiple of 16 elements, the last at least 16,
    draw the very numbers of one whole draw, and leave the RNG where it would."""
    for n in (5, 17, 1003, 4096 * 7 + 5):
        torch.manual_seed(3)
        one = getattr(torch.empty(n, dtype=dtype), draw)()
        after = torch.rand(3)
        torch.manual_seed(3)
        blocks = torch.empty(n, dtype=dtype)
        bounds = [*range(0, n, 48), n]
        if len(bounds) > 2 and bounds[-1] - bounds[-2] < 16:
            bounds.pop(-2)
        for a, b in zip(bounds, bounds[1:]):
            getattr(blocks[a:b], draw)()
        assert torch.equal(one, blocks) and torch.equal(after, torch.rand(3)), n


@pytest.fixture(scope="module")
def pretrained(specs, tmp_path_factory) -> dict:
    """Both tiny models written as HF directories (what a pretrained load reads)."""
    out = tmp_path_factory.mktemp("pretrained")
    dirs = {}
    for name, spec in specs.items():
        sd = models.build_model(spec).state_dict()
        dirs[name] = models.export_hf(sd, cfg=spec, out_dir=out / name)
    return dirs


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_pretrained_read_by_slices_equals_load_pretrained(pretrained, name):
    spec = models.ModelSpec(str(pretrained[name]))
    assert_same(built(spec), models.load_pretrained(pretrained[name]))
    model, weights = models.build_meta(spec)
    box = (slice(3, 9), slice(0, model.config.hidden_size))
    t = ShardTarget(torch.empty(6, model.config.hidden_size), box, (0, 0))
    weights.fill({"lm_head.weight": t})  # the tied alias: read from the embedding's key
    embed = load_file(pretrained[name] / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(t.out, embed[3:9])


def test_pretrained_in_several_files_read_by_slices(pretrained, tmp_path):
    """A checkpoint split over two files by ``model.safetensors.index.json``, one of them in
    bfloat16 (read into float32 shards): the very weights `load_pretrained` gives."""
    src = pretrained["smollm2"]
    sd = load_file(src / "model.safetensors")
    split = tmp_path / "split"
    split.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (split / f.name).write_bytes(f.read_bytes())
    keys = sorted(sd)
    parts = {"a.safetensors": keys[::2], "b.safetensors": keys[1::2]}
    for name, part in parts.items():
        tensors = {k: sd[k].bfloat16() if name == "b.safetensors" else sd[k] for k in part}
        save_file(tensors, split / name, metadata={"format": "pt"})
    weight_map = {k: name for name, part in parts.items() for k in part}
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}  # as HF writes it
    (split / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_same(built(models.ModelSpec(str(split))), models.load_pretrained(split))
    index["weight_map"]["model.layers.0.mlp.up_proj.bias"] = "a.safetensors"  # not in a's header
    (split / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(models.WeightKeysError, match=r"a\.safetensors: no tensor model\.layers"):
        models.build_meta(models.ModelSpec(str(split)))


@pytest.mark.parametrize(
    "edit, named",
    [
        ("extra", r"unexpected keys \['model\.layers\.9\.mlp\.up_proj\.weight'\]"),
        ("missing", r"missing keys \['model\.norm\.weight'\]"),
        ("shape", r"mismatched keys \['model\.norm\.weight \[3\] vs \[64\] in the model'\]"),
    ],
)
def test_pretrained_keys_are_checked_before_any_read(pretrained, tmp_path, edit, named):
    src = pretrained["smollm2"]
    sd = load_file(src / "model.safetensors")
    if edit == "extra":
        sd["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2, 2)
    elif edit == "missing":
        del sd["model.norm.weight"]
    else:
        sd["model.norm.weight"] = torch.zeros(3)
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (bad / f.name).write_bytes(f.read_bytes())
    save_file(sd, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(models.WeightKeysError, match=named):
        models.build_meta(models.ModelSpec(str(bad)))


def test_whole_target_refuses_a_box_that_does_not_fit():
    with pytest.raises(ValueError, match="does not fit"):
        ShardTarget(torch.empty(2, 3), (slice(0, 3), slice(0, 3)), (4, 3))
    assert whole(torch.empty(2, 3)).box == (slice(0, 2), slice(0, 3))
