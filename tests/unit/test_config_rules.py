"""One place per config rule: every refusal of a config comes from `trainer/config/`, each
cross-field rule is written once (`trainer.config.rules`) and runs before any weights load.

- an AST scan of the product (tokenbridge/, pipelines/, trainer/): ``ConfigError`` is raised
  under trainer/config/ only, and the registry's refusal flags (``same_tokenizer``,
  ``onpolicy_only``, ``no_cache``) are read by the rules module only;
- each rule of `rules.CONFIG_RULES` has a config here that breaks it, refused by that rule in
  `from_dictconfig` (a new rule without a case fails the coverage test);
- the rules that need the world size or the tokenizers run in the preflight before any
  config.json, shard or projection is read;
- the rules' knowledge comes from the library: the combination's options from
  `CombineConfig`, the tokenizer pairing from the registry's flags, for off- and on-policy modes.
"""

from __future__ import annotations

import ast
import importlib
import re
import time
import traceback
from pathlib import Path

import pytest

from tokenbridge import paths
from tokenbridge.losses.base import OptionError
from tokenbridge.losses.modes import MODES
from tokenbridge.tokenizers import load_tokenizer
from trainer.config import rules
from trainer.config.schema import ConfigError, LossConfig, from_dictconfig
from trainer.main import main
from trainer.preflight import preflight

PRODUCT = ("tokenbridge", "pipelines", "trainer")
CONFIG_DIR = Path("trainer") / "config"
RULE_FLAGS = {"same_tokenizer", "onpolicy_only", "no_cache"}
# the module (`tokenbridge.losses` re-exports its function `combine` under the same name)
combine_lib = importlib.import_module("tokenbridge.losses.combine")


def _sources():
    for root in PRODUCT:
        for path in sorted((paths.REPO_ROOT / root).rglob("*.py")):
            rel = path.relative_to(paths.REPO_ROOT)
            yield rel, ast.parse(path.read_text(), filename=str(rel))


def _name(node: ast.AST) -> str | None:
    return getattr(node, "id", getattr(node, "attr", None))


def test_config_errors_are_raised_under_trainer_config_only():
    # the config (trainer/config/) and its checks against the files (trainer/preflight.py)
    outside = []
    for rel, tree in _sources():
        if rel.parts[:2] == CONFIG_DIR.parts or rel.as_posix() == "trainer/preflight.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _name(node.func) == "ConfigError":
                outside.append(f"{rel}:{node.lineno}")
            if isinstance(node, ast.ClassDef) and node.name == "ConfigError":
                outside.append(f"{rel}:{node.lineno} (a second ConfigError)")
    assert not outside, f"ConfigError raised outside trainer/config/ and preflight: {outside}"


def test_the_registry_flags_that_refuse_a_config_are_read_by_the_rules_only():
    readers = set()
    for rel, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in RULE_FLAGS:
                readers.add(str(rel))
    # modes.py defines them (and `distills`'s neighbours); the rules read them
    assert readers <= {"tokenbridge/losses/modes.py", "trainer/config/rules.py"}, readers


# --- each config-alone rule, broken once ---------------------------------------------------


def _teacher(student_dir, **kw) -> dict:
    return {"path": str(student_dir), "init": "random", **kw}


def _cases(student_dir) -> dict[str, tuple[dict, str]]:
    """rule name -> (the config sections that break it, the message)."""
    t = _teacher(student_dir)
    onpolicy = {"enabled": True, "loss": "opd_pg"}
    return {
        "loss_needs_teachers": (
            {"loss": {"mode": "xtoken"}},
            r"config teachers: loss.mode=xtoken needs at least one teacher",
        ),
        "loss_options_fit_every_mode": (
            {"teachers": [t], "loss": {"mode": "xtoken", "options": {"kk": 1}}},
            r"config loss\.options\.kk: xtoken takes only",
        ),
        "cp_splits_the_padding": (
            {"parallel": {"cp": 4}, "data": {"shards": "/nowhere", "pad_to_multiple": 4}},
            r"config data\.pad_to_multiple: parallel\.cp=4 cuts each sequence",
        ),
        "offpolicy_modes_read_shards": (
            {"teachers": [t], "loss": {"mode": "opd_topk"}},
            r"config loss\.mode: opd_topk reads the student's own samples",
        ),
        "onpolicy_fits_the_teachers": (
            {"teachers": [_teacher(student_dir, tp=2)], "onpolicy": onpolicy},
            r"config teachers\[0\]\.tp: on-policy scoring runs tp=1 teachers",
        ),
        "kd_topk_reads_the_teachers_support": (
            {"teachers": [t], "loss": {"mode": "kd_topk", "options": {"support": "columns"}}},
            r"config loss\.options\.support: kd_topk: the trainer takes only 'teacher'",
        ),
        "caches_serve_their_modes": (
            {"teachers": [_teacher(student_dir, cache="/c")], "loss": {"mode": "gold"}},
            r"config teachers\[0\]\.cache: loss gold cannot read a teacher cache",
        ),
        "served_teachers_serve_their_modes": (
            {
                "teachers": [_teacher(student_dir, server="http://127.0.0.1:9")],
                "loss": {"mode": "gold"},
            },
            r"config teachers\[0\]\.server: loss gold reads more than a server returns",
        ),  # fmt: skip
        "stream_reads_a_store": (
            {"data": {"shards": "/nowhere", "stream": True}},
            r"config data\.stream: data\.shards=/nowhere is local",
        ),
        "packing_fits_the_run": (
            {
                "teachers": [_teacher(student_dir, cache="/c")],
                "data": {"shards": "/nowhere", "packing": True},
            },
            r"config teachers\[0\]\.cache: a teacher cache holds unpacked rows' outputs",
        ),
        "warmup_within_steps": (
            {"steps": 5, "optim": {"warmup_steps": 10}},
            r"config optim\.warmup_steps: 10 > steps=5",
        ),
    }


def _config(student_dir, sections: dict):
    base = {"model": {"path": str(student_dir), "init": "random"}, "data": {"shards": "/nowhere"}}
    return from_dictconfig({**base, **sections})


def test_every_config_rule_has_a_case_here(student_dir):
    assert set(_cases(student_dir)) == {r.__name__ for r in rules.CONFIG_RULES}


@pytest.mark.parametrize("rule", [r.__name__ for r in rules.CONFIG_RULES])
def test_each_config_rule_refuses_its_case_while_building_the_config(student_dir, rule):
    sections, message = _cases(student_dir)[rule]
    with pytest.raises(ConfigError, match=message) as e:
        _config(student_dir, sections)
    frames = [f.name for f in traceback.extract_tb(e.value.__traceback__)]
    assert rule in frames, frames  # refused by that rule, not by a copy of it elsewhere


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"onpolicy": {"enabled": True}}, r"onpolicy\.enabled: .* needs at least one teacher"),
        (
            {"teachers": [{"weight": 0.0}], "onpolicy": {"enabled": True, "loss": "opd_pg"}},
            r"config teachers: on-policy distillation needs a teacher with weight > 0",
        ),
    ],
)
def test_on_policy_teachers_are_checked_in_the_config(student_dir, sections, message):
    if "teachers" in sections:
        sections["teachers"] = [_teacher(student_dir, **t) for t in sections["teachers"]]
    with pytest.raises(ConfigError, match=message):
        _config(student_dir, sections)


SERVER = "http://127.0.0.1:9"  # never contacted: the config rules read no server


@pytest.mark.parametrize("mode", rules.SERVED_ONPOLICY_MODES)
def test_a_served_teacher_scores_rollouts_in_the_modes_a_server_can_answer(student_dir, mode):
    teachers = [_teacher(student_dir, server=SERVER), _teacher(student_dir)]
    onpolicy = {"enabled": True, "loss": "opd_topk", "teacher_losses": [mode]}
    cfg = _config(student_dir, {"teachers": teachers, "onpolicy": onpolicy})
    assert cfg.onpolicy.modes(2) == [mode, "opd_topk"]  # the live teacher keeps opd_topk


@pytest.mark.parametrize(
    ("onpolicy", "message"),
    [
        ({"loss": "opd_topk"}, r"config onpolicy\.loss: teachers\[0\]\.server: opd_topk needs "
         r"the teacher's log-probs at the student's own top-k ids, which no inference engine"),
        ({"loss": "opd_pg", "teacher_losses": ["opd_topk"]},
         r"config onpolicy\.teacher_losses\[0\]: teachers\[0\]\.server: opd_topk needs"),
        ({"loss": "gold"}, r"config onpolicy\.loss: teachers\[0\]\.server: on-policy gold "
         r"reads more than a server returns"),
        ({"loss": "xtoken", "options": {"xtoken": {"temperature": 2.0}}},
         r"config onpolicy\.options\.xtoken\.temperature: teachers\[0\]\.server returns "
         r"log-probs at temperature 1, the loss asks for 2\.0"),
    ],
)  # fmt: skip
def test_a_served_teacher_refuses_the_on_policy_modes_it_cannot_answer(
    student_dir, onpolicy, message
):
    sections = {"teachers": [_teacher(student_dir, server=SERVER)],
                "onpolicy": {"enabled": True, **onpolicy}}  # fmt: skip
    with pytest.raises(ConfigError, match=message) as e:
        _config(student_dir, sections)
    assert "\n" not in str(e.value)
    # a teacher without weight is never asked: its mode is not refused
    sections["teachers"].append(_teacher(student_dir))
    sections["teachers"][0]["weight"] = 0.0
    _config(student_dir, sections)


def test_main_refuses_top_k_opd_through_a_server_with_exit_2(monkeypatch, capsys):
    monkeypatch.setattr("trainer.preflight.preflight", _read)
    args = ["conf=onpolicy_debug", f"teachers.1.server={SERVER}", "teachers.1.served_model=t"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(r"teachers\[1\]\.server: opd_topk needs", err[0]), err


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        # on-policy rollouts pack (`trainer.onpolicy.packed_rollouts`); CP stays refused
        (
            {"onpolicy": {"enabled": True, "loss": "opd_pg"}, "parallel": {"cp": 2}},
            r"parallel\.cp: on-policy steps run at cp=1",
        ),
        ({"parallel": {"cp": 2}}, r"data\.packing: packed rows under context parallelism"),
        ({"data": {"packed_tokens": 100}}, r"data\.packed_tokens: 100 < data\.max_student"),
    ],
)
def test_packing_refuses_what_it_does_not_serve_in_one_line(student_dir, sections, message):
    data = {"shards": "/nowhere", "packing": True, **sections.pop("data", {})}
    sections = {"teachers": [_teacher(student_dir)], "data": data, **sections}
    with pytest.raises(ConfigError, match=message) as e:
        _config(student_dir, sections)
    assert "\n" not in str(e.value)


def test_on_policy_rollouts_pack(student_dir):
    data = {"shards": "/nowhere", "packing": True}
    onpolicy = {"enabled": True, "loss": "opd_pg"}
    cfg = _config(student_dir, {"teachers": [_teacher(student_dir)], "data": data,
                                "onpolicy": onpolicy})  # fmt: skip
    assert cfg.data.packing and cfg.onpolicy.enabled


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optim.warmup_steps=30", r"optim\.warmup_steps: 30 > steps=20"),
        ("parallel.cp=3", r"data\.pad_to_multiple: parallel\.cp=3"),
        ("teachers.0.loss=opd_pg", r"teachers\[0\]\.loss: opd_pg reads the student's own"),
        ("loss.combine=sum", r"loss\.combine: expected one of \['fixed', 'dynamic'\], got 'sum'"),
    ],
)
def test_main_refuses_a_broken_rule_before_the_preflight(override, message, monkeypatch, capsys):
    def refuse(cfg, **kw):
        raise AssertionError("the config should have failed before the preflight")

    monkeypatch.setattr("trainer.preflight.preflight", refuse)
    t0 = time.perf_counter()
    assert main(["conf=debug", override]) == 2
    assert time.perf_counter() - t0 < 3
    err = capsys.readouterr().err
    assert "ConfigError" in err and re.search(message, err), err


# --- the rules that need the world or the tokenizers: first in the preflight ----------------


def _read(*a, **kw):
    raise AssertionError("read a file before the rules that need none")


def _no_files(monkeypatch, *, tokenizers: bool = True):
    """Reading a config.json, a shard or a projection (and a tokenizer, unless `tokenizers`)
    fails the test."""
    targets = ["models.model_config", "open_shards", "load_projection"]
    for target in targets + ([] if tokenizers else ["load_tokenizer"]):
        monkeypatch.setattr(f"trainer.preflight.{target}", _read)


def test_world_rules_run_before_anything_is_read(student_dir, tmp_path, monkeypatch):
    _no_files(monkeypatch, tokenizers=False)
    teachers = [_teacher(student_dir, tp=2)]
    cfg = _config(student_dir, {"teachers": teachers, "run_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"teachers\[0\]\.tp: 2 does not divide the world size 3"):
        preflight(cfg, world_size=3)
    cfg.teachers[0].tp, cfg.parallel.tp = 1, 2
    with pytest.raises(ConfigError, match="must equal the world size 3"):
        preflight(cfg, world_size=3)


def test_tokenizer_rules_run_as_soon_as_the_tokenizers_load(
    student_dir, teacher_dir, tmp_path, monkeypatch
):
    _no_files(monkeypatch)
    kd = {"teachers": [_teacher(teacher_dir)], "loss": {"mode": "kd_topk"}}
    cfg = _config(student_dir, {**kd, "run_dir": str(tmp_path)})
    with pytest.raises(
        ConfigError, match=r"config teachers\[0\]: loss kd_topk needs the student's"
    ):
        preflight(cfg, world_size=1)
    cfg = _config(student_dir, {**kd, "loss": {"mode": "xtoken"}, "run_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"teachers\[0\]\.projection: loss xtoken needs a proj"):
        preflight(cfg, world_size=1)


def test_one_pairing_rule_for_off_and_on_policy_modes_from_the_registry(
    student_dir, teacher_dir, monkeypatch
):
    s, g = load_tokenizer(student_dir), load_tokenizer(teacher_dir)
    on = {"enabled": True, "loss": "opd_pg"}
    cfg = _config(student_dir, {"teachers": [_teacher(teacher_dir)], "onpolicy": on})
    rules.check_tokenizers(cfg, s, [g])  # opd_pg takes any tokenizer
    monkeypatch.setattr(MODES["opd_pg"], "same_tokenizer", True)
    with pytest.raises(ConfigError, match=r"onpolicy\.teacher_losses\[0\]: opd_pg needs the stu"):
        rules.check_tokenizers(cfg, s, [g])
    monkeypatch.setattr(MODES["opd_pg"], "projection", True)
    with pytest.raises(ConfigError, match=r"teachers\[0\]\.projection: on-policy opd_pg needs"):
        rules.check_tokenizers(cfg, s, [s])


# --- the combination of KD and CE: the library's CombineConfig ------------------------------


def test_the_loss_section_builds_the_library_combine_config():
    cfg = LossConfig(mode="alm", combine="dynamic", kd_weight=2.0, ce_weight=0.5)
    assert cfg.combine_config() == combine_lib.CombineConfig("dynamic", 2.0, 0.5)
    for kw, message in [
        ({"combine": "sum"}, r"config loss\.combine: expected one of \['fixed', 'dynamic'\]"),
        ({"kd_weight": -1.0}, r"config loss\.kd_weight: expected a non-negative number, got -1"),
        ({"ce_weight": float("nan")}, r"config loss\.ce_weight: expected a non-negative number"),
    ]:
        with pytest.raises(ConfigError, match=message):
            LossConfig(mode="alm", **kw)
    with pytest.raises(OptionError, match="expected one of") as e:
        combine_lib.CombineConfig(mode="sum")
    assert e.value.field == "mode"


def test_the_combine_modes_are_the_librarys(monkeypatch):
    monkeypatch.setattr(combine_lib, "COMBINE_MODES", (*combine_lib.COMBINE_MODES, "sum"))
    assert LossConfig(mode="alm", combine="sum").combine == "sum"
