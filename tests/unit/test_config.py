"""Config composition and validation, the LR schedule, and the checks that run before any model.

`load_config` composes the real conf/ tree with Hydra; every bad value must fail with a
ConfigError naming its field. `preflight` reads only tokenizers, shard metadata, projection
tables and config.json files: the tests call it directly and check that it refuses mismatched
inputs (no model is built anywhere in this file).
"""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest
from safetensors.numpy import save_file
from torch.distributed.checkpoint.metadata import Metadata

from tests.unit.test_data import synthetic_rows
from tokenbridge.cli import UsageError
from tokenbridge.formats import shard_schema
from tokenbridge.formats.shards import FingerprintMismatchError, IncompleteShardsError
from tokenbridge.losses.modes import MODES
from tokenbridge.projection import TENSORS, ProjectionMismatchError
from tokenbridge.tokenizers import load_tokenizer
from trainer.checkpoint import dcp_io
from trainer.config.precision import Precision
from trainer.config.schema import ConfigError, from_dictconfig
from trainer.main import hydra_overrides, load_config, main
from trainer.optim import lr_lambda
from trainer.preflight import preflight


def test_experiments_compose_into_validated_configs(student_dir, teacher_dir):
    debug = load_config(["conf=debug"])
    assert debug.name == "debug" and debug.loss.mode == "xtoken"
    assert debug.model.init == "random" and debug.model.path == str(student_dir)
    assert debug.model.overrides["hidden_size"] == 64
    (t,) = debug.teachers
    assert (
        t.init == "random"
        and t.path == str(teacher_dir)
        and t.projection.endswith("k8.safetensors")
    )
    assert debug.run_dir.endswith("runs/debug")
    demo = load_config(["experiment=demo", "optim.lr=1e-4", "teachers.0.weight=0.25"])
    assert demo.model.init == "pretrained" and demo.teachers[0].init == "pretrained"
    assert demo.optim.lr == 1e-4 and demo.teachers[0].weight == 0.25
    plain = load_config([])
    assert plain.loss.mode == "ce" and plain.teachers == []
    # conversations pack (docs/training.md, "Packed rows"); the text-window configs do not
    chat = load_config(["conf=chat"])
    assert chat.data.packing and chat.data.row_tokens == chat.data.max_student_tokens == 512
    assert chat.loss.mode == "xtoken" and chat.data.shards.endswith("outputs/align/chat")
    assert not any(c.data.packing for c in (debug, demo, plain))


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["optim.lr=-1"], "optim.lr"),
        (["data.micro_batch_size=0"], "data.micro_batch_size"),
        (["loss.mode=kl"], "loss.mode"),
        (["parallel.tp=0"], "parallel.tp"),
        (["parallel.teacher_placement=gpu"], "parallel.teacher_placement"),
        (["parallel.activation_checkpointing=all"], "parallel.activation_checkpointing"),
        (["parallel.ac_every=0"], "parallel.ac_every"),
        (["parallel.compile=maybe"], "parallel.compile"),
        (["nosuch=1"], "nosuch"),
        (["steps=abc"], "steps"),
        (["steps=10", "stop_after=11"], "stop_after"),
        (["conf=debug", "teachers.0.tp=0"], r"teachers\[0\].tp"),
        (["conf=debug", "teachers.0.dtype=int8"], r"teachers\[0\].dtype"),
        (["loss=xtoken"], "needs at least one teacher"),
        (["conf=nosuch"], "experiment"),
        (["optim.betas=[0.9]"], "optim.betas"),
        (["data.eval_fraction=1.5"], "data.eval_fraction"),
    ],
)
def test_bad_values_name_their_field(overrides, field):
    with pytest.raises(ConfigError, match=field):
        load_config(overrides)


@pytest.mark.parametrize("prefix", ["", "+", "++"])
def test_unknown_keys_are_refused_with_or_without_plus(prefix):
    with pytest.raises(ConfigError, match=r"config optim.lrr: no such key \(closest: optim.lr\)"):
        load_config([f"{prefix}optim.lrr=1"])
    with pytest.raises(ConfigError, match=r"threads: no such key \(closest: parallel.threads\)"):
        load_config([f"{prefix}threads=1"])
    with pytest.raises(ConfigError, match=r"teachers.0.wieght: no such key .*teachers.0.weight"):
        load_config(["conf=debug", f"{prefix}teachers.0.wieght=1"])
    with pytest.raises(ConfigError, match=r"model.foo: no such key \(model has path, init"):
        load_config([f"{prefix}model.foo.bar=1"])


def test_open_sections_take_free_keys_and_dicts_are_checked_too(student_dir):
    cfg = load_config(["conf=debug", "+model.overrides.rope_theta=5.0", "+loss.options.beta=0.3"])
    assert cfg.model.overrides["rope_theta"] == 5.0 and cfg.loss.options["beta"] == 0.3
    d = {"model": {"path": str(student_dir)}, "data": {"shards": "x"}, "optim": {"lrr": 1}}
    with pytest.raises(ConfigError, match=r"optim.lrr: no such key \(closest: optim.lr\)"):
        from_dictconfig(d)


def test_main_refuses_an_unknown_key_with_exit_code_2_before_loading(capsys):
    t0 = time.perf_counter()
    assert main(["conf=debug", "+optim.lrr=1"]) == 2
    assert time.perf_counter() - t0 < 3.0  # nothing loaded: no tokenizer, no model
    assert "optim.lrr: no such key (closest: optim.lr)" in capsys.readouterr().err


def test_conf_is_experiment_and_options_are_refused():
    assert hydra_overrides(["conf=demo", "a.b=1"]) == ["experiment=demo", "a.b=1"]
    with pytest.raises(UsageError, match="unknown option"):
        hydra_overrides(["--lr", "1"])


def test_lr_warms_up_then_decays_to_the_floor():
    lr = [lr_lambda(s, warmup=4, total=20, min_ratio=0.1) for s in range(21)]
    assert lr[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert all(a >= b for a, b in zip(lr[4:], lr[5:]))
    assert lr[20] == pytest.approx(0.1) and lr[12] == pytest.approx(0.55)


def test_loss_options_are_checked_against_the_mode():
    ov = ["conf=debug", "loss.options.k=4", "loss.options.divergence=jsd", "+loss.options.beta=0.3"]
    xc = load_config(ov).loss.mode_options("xtoken")
    assert (xc.k, xc.divergence, xc.beta, xc.temperature) == (4, "jsd", 0.3, 1.0)
    with pytest.raises(ConfigError, match=r"loss.options.topk: xtoken takes only .* not 'topk'"):
        load_config(["conf=debug", "+loss.options.topk=4"])
    # loss.mode=ce reads no options; asked for another mode's, they are checked all the same
    with pytest.raises(ConfigError, match="loss.options.divergence: kd_topk: expected one of"):
        load_config(["+loss.options.divergence=nope"]).loss.mode_options("kd_topk")


def _refuse_preflight(cfg, **kw):
    raise AssertionError("the config should have failed before the preflight")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("+loss.options.kk=3", r"loss\.options\.kk: xtoken takes only \[.*'k'.*\], not 'kk'"),
        ("loss.options.k=-1", r"loss\.options\.k: xtoken: expected >= 1, got -1"),
        ("loss.options.k=abc", r"loss\.options\.k: xtoken: expected int, got 'abc'"),
        ("loss.options.divergence=kl", r"loss\.options\.divergence: xtoken: expected one of"),
        ("loss.options.chain_weight=-1", r"loss\.options\.chain_weight: xtoken: expected >= 0"),
        ("loss.mode=kd_topk", r"loss\.options\.chain_weight: kd_topk takes only"),
        # a teacher's own mode reads the same options
        ("teachers.0.loss=alm", r"loss\.options\.k: alm takes only"),
        ("teachers.0.loss=ce", r"teachers\[0\]\.loss: expected one of \['kd_topk'"),
    ],
)
def test_bad_loss_options_exit_2_in_the_config_before_anything_loads(
    override, message, monkeypatch, capsys
):
    """`main` as the command line runs it: refused by config validation, naming the field, in
    well under 3 s; the preflight (the first step that reads a file) is never reached."""
    monkeypatch.setattr("trainer.preflight.preflight", _refuse_preflight)
    t0 = time.perf_counter()
    assert main(["conf=debug", override]) == 2
    assert time.perf_counter() - t0 < 3
    err = capsys.readouterr().err
    assert "ConfigError" in err and re.search(message, err), err


def test_the_trainer_runs_only_kd_topk_with_the_teachers_support(student_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"loss.options.support: kd_topk: the trainer takes"):
        cfg_for(student_dir, tmp_path, loss={"mode": "kd_topk", "options": {"support": "columns"}})


def test_mesh_shape_must_match_the_world():
    cfg = load_config(["parallel.tp=2"])
    assert cfg.parallel.mesh_shape(4) == (2, 1, 2)
    # conf/parallel/default.yaml: no activation checkpointing, no compile unless asked
    assert (cfg.parallel.activation_checkpointing, cfg.parallel.compile) == ("none", False)
    with pytest.raises(ConfigError, match="must equal the world size 3"):
        cfg.parallel.mesh_shape(3)
    cfg = load_config(["parallel.tp=2", "parallel.cp=2"])
    assert cfg.parallel.mesh_shape(8) == (2, 2, 2)
    with pytest.raises(ConfigError, match="cp=2 x tp=2 must equal the world size 2"):
        cfg.parallel.mesh_shape(2)


def test_mesh_shape_with_replicated_shards():
    """HSDP: dp_replicate groups of dp_shard x cp x tp ranks; dp_shard=-1 takes the rest."""
    assert load_config([]).parallel.dp_replicate == 1  # today's configs: plain FSDP
    cfg = load_config(["parallel.dp_replicate=2"])
    assert cfg.parallel.mesh_shape(4) == (2, 1, 1)
    cfg = load_config(["parallel.dp_replicate=2", "parallel.tp=2"])
    assert cfg.parallel.mesh_shape(8) == (2, 1, 2)
    with pytest.raises(ConfigError, match="dp_replicate=2 x dp_shard=-1 x cp=1 x tp=2 must equal"):
        cfg.parallel.mesh_shape(6)
    with pytest.raises(ConfigError, match="parallel.dp_replicate"):
        load_config(["parallel.dp_replicate=0"])


# --- preflight: real tokenizers, synthetic shards ---------------------------------------------

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}  # fmt: skip


def write_synthetic(out, student, teachers, *, completed=True):
    from tokenbridge.formats.shards import ShardWriter, shard_name, write_completed

    out.mkdir(parents=True)
    schema = shard_schema.shard_schema(student, teachers)
    rows = synthetic_rows(6)
    with ShardWriter(out / shard_name(0, 1), schema) as w:
        w.write_rows(rows)
    if completed:
        stats = {"student": student.to_json(), "teachers": [t.to_json() for t in teachers]}
        write_completed(out, stats, files={shard_name(0, 1): len(rows)})
    return out


@pytest.fixture(scope="module")
def smol(student_dir):
    return load_tokenizer(student_dir).info()


def cfg_for(student_dir, shards, *, teacher=None, mode="kd_topk", **extra):
    teacher = teacher or student_dir
    d = {
        "model": {"path": str(student_dir), "init": "random", "overrides": TINY},
        "teachers": [{"path": str(teacher), "init": "random", "overrides": TINY}],
        "loss": {"mode": mode},
        "data": {"shards": str(shards)},
        **extra,
    }
    return from_dictconfig(d)


def test_preflight_accepts_matching_inputs(tmp_path, student_dir, smol):
    shards = write_synthetic(tmp_path / "ok", smol, [smol])
    p = preflight(cfg_for(student_dir, shards, device="cpu"), world_size=1)
    assert p.student_rows == 49152 and p.teacher_rows == [49152]
    assert p.student_tok.fingerprint == smol.fingerprint and p.projections == [None]
    assert p.teacher_max_len[0] >= 3
    # on a CPU every auto dtype is float32, the AdamW the plain one (trainer.config.precision)
    assert p.precision == Precision("cpu", "float32", "float32", ("float32",), True)


def test_preflight_refuses_shards_without_marker_or_other_tokenizers(tmp_path, student_dir, smol):
    partial = write_synthetic(tmp_path / "partial", smol, [smol], completed=False)
    with pytest.raises(IncompleteShardsError, match="COMPLETED"):
        preflight(cfg_for(student_dir, partial), world_size=1)
    other = shard_schema.TokenizerInfo("other", "0" * 64, 1000)
    foreign = write_synthetic(tmp_path / "foreign", smol, [other])
    with pytest.raises(FingerprintMismatchError, match="teacher 0 tokenizer fingerprint 0000"):
        preflight(cfg_for(student_dir, foreign), world_size=1)


def test_preflight_refuses_a_projection_made_for_other_tokenizers(tmp_path, student_dir, smol):
    shards = write_synthetic(tmp_path / "ok", smol, [smol])
    with pytest.raises(ConfigError, match=r"teachers\[0\].projection: loss xtoken needs"):
        preflight(cfg_for(student_dir, shards, mode="xtoken"), world_size=1)
    path = tmp_path / "p.safetensors"
    arrays = {
        n: np.zeros((4, 1) if "_ids" in n or "weights" in n else (4,), np.int32) for n in TENSORS
    }
    meta = {"format_version": "1", "teacher_fingerprint": "0" * 64, "student_fingerprint": "0" * 64}
    save_file(arrays, str(path), metadata=meta)
    cfg = cfg_for(student_dir, shards, mode="xtoken")
    cfg.teachers[0].projection = str(path)
    with pytest.raises(ProjectionMismatchError, match="rebuild with `make projection`"):
        preflight(cfg, world_size=1)


def test_preflight_refuses_layouts_the_models_cannot_take(tmp_path, student_dir, smol):
    shards = write_synthetic(tmp_path / "ok", smol, [smol])
    with pytest.raises(ConfigError, match="tp=3 does not divide num_attention_heads=4"):
        preflight(cfg_for(student_dir, shards, parallel={"tp": 3}), world_size=3)
    with pytest.raises(ValueError, match="18 student tokens > data.max_student_tokens=2"):
        preflight(cfg_for(student_dir, shards, data={"shards": str(shards), "max_student_tokens": 2}), world_size=1)  # fmt: skip


def test_same_tokenizer_loss_with_another_tokenizer_is_refused(tmp_path, student_dir, teacher_dir, smol):  # fmt: skip
    gemma = load_tokenizer(teacher_dir).info()
    shards = write_synthetic(tmp_path / "pair", smol, [gemma])
    with pytest.raises(ConfigError, match="kd_topk needs the student's tokenizer"):
        preflight(cfg_for(student_dir, shards, teacher=teacher_dir), world_size=1)


def test_preflight_takes_the_same_tokenizer_rule_from_the_registry(
    tmp_path, student_dir, teacher_dir, smol, monkeypatch
):
    gemma = load_tokenizer(teacher_dir).info()
    shards = write_synthetic(tmp_path / "pair", smol, [gemma])
    cfg = cfg_for(student_dir, shards, teacher=teacher_dir, mode="alm")
    monkeypatch.setattr(MODES["alm"], "same_tokenizer", True)
    with pytest.raises(ConfigError, match="alm needs the student's tokenizer"):
        preflight(cfg, world_size=1)


def test_a_fresh_start_over_an_earlier_run_is_refused(tmp_path, student_dir, smol):
    shards = write_synthetic(tmp_path / "ok", smol, [smol])
    old = tmp_path / "run" / "checkpoints" / "step-00000003"
    old.mkdir(parents=True)
    empty = dcp_io.encode_index(Metadata(state_dict_metadata={}, planner_data={}, storage_data={}))
    (old / ".metadata").write_text(json.dumps(empty))
    cfg = cfg_for(student_dir, shards, run_dir=str(tmp_path / "run"), checkpoint={"resume": "none"})
    with pytest.raises(ConfigError, match="up to step 3.*checkpoint.resume=auto"):
        preflight(cfg, world_size=1)
    cfg.checkpoint.resume = "auto"
    assert preflight(cfg, world_size=1).student_rows == 49152
