"""The `onpolicy:` config section and the on-policy preflight refuse what cannot run, naming the
field; the loss-mode registry holds the on-policy modes."""

from __future__ import annotations

import pytest

from tokenbridge.losses.modes import KD_MODES, MODES
from tokenbridge.tokenizers import load_tokenizer
from trainer.config.rules import check_tokenizers
from trainer.config.schema import ConfigError, from_dictconfig


def _cfg(student_dir, teacher_dir, onpolicy: dict, **top):
    d = {
        "model": {"path": str(student_dir)},
        "teachers": [
            {"path": str(teacher_dir), "name": "g", "projection": "x.safetensors"},
            {"path": str(student_dir), "name": "s"},
        ],
        "data": {"shards": "/nowhere"},
        "onpolicy": {"enabled": True, "teacher_losses": ["opd_pg", "opd_topk"], **onpolicy},
        **top,
    }
    return from_dictconfig(d)


def test_registry_has_the_on_policy_modes():
    assert {"opd_topk", "opd_pg"} <= set(KD_MODES)
    assert MODES["opd_topk"].onpolicy_only and MODES["opd_topk"].same_tokenizer
    assert MODES["opd_pg"].onpolicy_only and not MODES["opd_pg"].same_tokenizer
    assert not MODES["xtoken"].onpolicy_only


@pytest.mark.parametrize(
    "onpolicy, field",
    [
        ({"lmbda": 1.5}, "onpolicy.lmbda"),
        ({"lag": 2}, "onpolicy.lag"),
        ({"top_p": 0.0}, "onpolicy.top_p"),
        ({"prompts_per_step": 3, "n_samples": 1, "micro_batch_size": 2}, "micro_batch_size"),
        ({"prompts": "chat"}, "onpolicy.chat_data"),
        ({"options": {"opd_topk": {"k": 0}}}, "onpolicy.options.opd_topk.k"),
        ({"options": {"opd_topk": {"kk": 3}}}, "onpolicy.options.opd_topk.kk"),
        ({"options": {"gold": {}}}, "onpolicy.options.gold"),
        ({"teacher_losses": ["ce", "opd_topk"]}, "onpolicy.teacher_losses[0]"),
        ({"mix": "mixture"}, "onpolicy.mix"),
    ],
)
def test_bad_onpolicy_values_name_their_field(student_dir, teacher_dir, onpolicy, field):
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        _cfg(student_dir, teacher_dir, onpolicy)


def test_an_on_policy_mode_is_not_an_off_policy_loss(student_dir, teacher_dir):
    with pytest.raises(ConfigError, match="loss.mode: opd_topk reads the student's own samples"):
        _cfg(student_dir, teacher_dir, {}, loss={"mode": "opd_topk"})


def test_preflight_refuses_a_same_tokenizer_mode_on_another_tokenizer(student_dir, teacher_dir):
    s, g = load_tokenizer(student_dir), load_tokenizer(teacher_dir)
    ok = _cfg(student_dir, teacher_dir, {"options": {"opd_topk": {"k": 4}}})
    check_tokenizers(ok, s, [g, s])
    bad = _cfg(student_dir, teacher_dir, {"teacher_losses": ["opd_topk", "opd_topk"]})
    with pytest.raises(ConfigError, match=r"onpolicy.teacher_losses\[0\]: opd_topk needs"):
        check_tokenizers(bad, s, [g, s])
    mixed = _cfg(student_dir, teacher_dir, {"teacher_losses": ["opd_pg", "opd_pg"],
                                            "mix": "mixture"})  # fmt: skip
    with pytest.raises(ConfigError, match="mixture needs teachers with the student's tokenizer"):
        check_tokenizers(mixed, s, [g, s])


def test_a_time_budget_must_be_positive(student_dir, teacher_dir):
    assert _cfg(student_dir, teacher_dir, {}, time_budget_s=90).time_budget_s == 90
    with pytest.raises(ConfigError, match="time_budget_s: expected > 0 seconds, got 0"):
        _cfg(student_dir, teacher_dir, {}, time_budget_s=0)
