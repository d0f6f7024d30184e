"""The loss-mode registry: every record is complete, and a mode runs from its record alone.

For each distillation mode, the record's options, tables, teacher spec and columns feed the
teacher-output computation, and its prepare / count / loss take a batch to a finite loss whose
count is the pre-count — the path `trainer.loss_terms.KDTerm` takes, without the trainer. The config
and preflight tests (test_config.py) check that both read the registry, not lists of their own.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from tests.unit.test_loss_refs import logits_for, make_pair, random_t2s
from tokenbridge.losses.base import OptionError
from tokenbridge.losses.kd_topk import student_topk_ids
from tokenbridge.losses.modes import KD_MODES, MODES, NoOptions
from tokenbridge.losses.ops.segments import collate_aligned, shift_targets
from tokenbridge.teacher.outputs import teacher_outputs_from_logits
from trainer.config.schema import ConfigError, from_dictconfig


def _projection(pair, seed: int) -> SimpleNamespace:
    """A small random projection between the pair's vocabularies (the fields the tables read)."""
    t2s_ids, t2s_w = random_t2s(seed, Vt=pair.Vt, vs=pair.vs)
    s2t_ids, s2t_w = random_t2s(seed + 1, Vt=pair.Vs, vs=pair.vt)
    exact = torch.full((pair.Vt,), -1, dtype=torch.int64)
    exact[: pair.vs // 2] = torch.arange(pair.vs // 2)
    arrays = {"t2s_ids": t2s_ids, "t2s_weights": t2s_w, "s2t_ids": s2t_ids, "s2t_weights": s2t_w}
    return SimpleNamespace(exact_t2s=exact.numpy(), **{k: v.numpy() for k, v in arrays.items()})


def _same_tokenizer(pair):
    """The pair's student rows, as the teacher's too (a same-tokenizer batch)."""
    rows = [
        {
            **r,
            "teacher0_ids": r["student_ids"],
            "teacher0_chunk": r["teacher0_student_chunk"],
        }
        for r in pair.rows
    ]
    batch = collate_aligned(rows, 0)
    return dataclasses.replace(pair, batch=batch, rows=rows, vt=pair.vs, Vt=pair.Vs)


def test_every_record_is_complete():
    assert MODES["ce"].options is NoOptions and not MODES["ce"].distills
    assert set(KD_MODES) == {"kd_topk", "xtoken", "gold", "alm", "opd_topk", "opd_pg"}
    for name in KD_MODES:
        r = MODES[name]
        assert r.name == name and dataclasses.is_dataclass(r.options)
        for hook in (r.teacher_spec, r.prepare, r.count, r.loss):
            assert callable(hook), (name, hook)
        assert (r.tables is not None) == r.projection, name
        assert not (r.same_tokenizer and r.projection), name
        r.options()  # every option has a default


def mode_inputs(name: str, pair, teacher, student, *, temperature: float):
    """(options, tables, teacher outputs, prep) of mode `name` on `pair` as its record builds
    them: the teacher's logits [B, T, Vt]; the student's [B, S, Vs] give the on-policy top-k
    columns."""
    r = MODES[name]
    given = {"k": 4} if "k" in {f.name for f in dataclasses.fields(r.options)} else {}
    options = r.parse_options(given, temperature=temperature)
    tables = None
    if r.tables is not None:
        tables = r.tables(
            _projection(pair, 13), teacher_vocab_size=pair.vt, student_vocab_size=pair.vs
        )
    spec = r.teacher_spec(options, tables, teacher_vocab_size=pair.vt)
    columns = r.columns(tables)
    if spec.per_position_columns:  # on-policy top-k: the student's own top-k ids
        columns = student_topk_ids(student.detach(), spec.columns, vocab_size=pair.vs)
    outs = teacher_outputs_from_logits(
        teacher,
        spec=spec,
        target_ids_BT=shift_targets(pair.batch.teacher_ids, pair.batch.teacher_len),
        columns=columns,
    )
    prep = r.prepare(pair.batch, shift_targets(pair.batch.student_ids, pair.batch.student_len))
    return options, tables, outs, prep


@pytest.mark.parametrize("name", KD_MODES)
def test_each_mode_runs_from_its_record_alone(name):
    r = MODES[name]
    pair = make_pair(11, B=3)
    if r.same_tokenizer:
        pair = _same_tokenizer(pair)
    student, teacher = logits_for(pair, 12)
    options, tables, outs, prep = mode_inputs(name, pair, teacher, student, temperature=1.0)
    out = r.loss(student, outs, prep, tables=tables, vocab_size=pair.vs, config=options)
    assert int(out.count) == r.count(prep) > 0
    assert torch.isfinite(out.sum) and out.sum > 0
    out.sum.backward()
    assert torch.isfinite(student.grad).all() and student.grad.abs().sum() > 0


def test_options_fail_field_by_field():
    kd = MODES["kd_topk"]
    assert kd.parse_options({"k": 8}, temperature=2.0).temperature == 2.0
    assert kd.parse_options({"temperature": 0.5}, temperature=2.0).temperature == 0.5
    # every support the loss computes; the trainer's own limit is its config's (test_config.py)
    assert kd.parse_options({"support": "columns"}, temperature=1.0).support == "columns"
    cases = {
        "kk": ({"kk": 3}, "kd_topk takes only"),
        "k": ({"k": -1}, "kd_topk: expected >= 1, got -1"),
        "beta": ({"divergence": "jsd", "beta": 1.0}, "0 < beta < 1"),
        "divergence": ({"divergence": True}, "expected str, got True"),
    }
    for field, (given, reason) in cases.items():
        with pytest.raises(OptionError, match=reason) as e:
            kd.parse_options(given, temperature=1.0)
        assert e.value.field == field
    assert MODES["gold"].parse_options({"beta": 1}, temperature=1.0).beta == 1  # int for float
    with pytest.raises(OptionError, match="set both weights") as e:
        MODES["gold"].parse_options({"matched_weight": 0.5}, temperature=1.0)
    assert e.value.field == "unmatched_weight"


def test_config_knows_exactly_the_registry_modes(tmp_path):
    def cfg(mode, teacher_loss=None):
        teacher = {"path": str(tmp_path), "init": "random", "loss": teacher_loss}
        return from_dictconfig(
            {
                "model": {"path": str(tmp_path), "init": "random"},
                "teachers": [teacher],
                "loss": {"mode": mode},
                "data": {"shards": str(tmp_path)},
            }
        )

    for name in MODES:
        if MODES[name].onpolicy_only:  # an on-policy mode is onpolicy.loss, never loss.mode
            with pytest.raises(ConfigError, match="reads the student's own samples"):
                cfg(name)
            continue
        assert cfg(name).loss.mode == name
    for name in KD_MODES:
        assert cfg("ce", teacher_loss=name).teacher_modes() == [name]
    with pytest.raises(ConfigError, match="loss.mode"):
        cfg("kl")
    with pytest.raises(ConfigError, match=r"teachers\[0\].loss"):
        cfg("xtoken", teacher_loss="ce")
