"""`bench.science.trl_gold` (TRL's GOLD hybrid ULD loss in our trainer) against TRL's own `ULDLoss`.

The reference is TRL's whole ``ULDLoss.__call__`` on dense logits, with labels and byte offsets
built so that TRL's own byte-offset walk finds exactly our chunks as its alignment groups; the
adapter runs through its registry record (prepare, count, teacher spec and rows, loss) with
teacher outputs from `teacher_outputs_from_logits`, zeroed outside the rows it asks for (as the
worker leaves them). The tokenizers are real HF tokenizers (WordLevel, small vocabularies, some
strings shared: TRL matches strings). trl is a bench dependency that `make test` installs: when
it does not import, these tests fail, they never skip.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_loss_refs import logits_for, make_pair
from tokenbridge.losses import (
    GoldConfig,
    GoldTables,
    gold,
    gold_teacher_spec,
    index_chunks,
    shift_targets,
    teacher_outputs_from_logits,
)
from tokenbridge.losses.modes import MODES
from trainer.config.schema import ConfigError, LossConfig

N_SHARED = 12


@pytest.fixture
def trl_gold():
    import bench.science.trl_gold as tg  # an ImportError here fails the test (trl is required)

    tg.register()
    yield tg
    MODES.pop(tg.NAME, None)  # other tests see the product's registry


def _hf_tokenizer(path, words):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(words)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, "<unk>")))
    tok.save_pretrained(path)
    return str(path)


def _vocabs(tmp_path, pair, seed):
    """Two tokenizers sharing N_SHARED strings; returns their dirs and the (t, s) id pairs."""
    g = torch.Generator().manual_seed(seed)
    t_shared = torch.randperm(pair.vt, generator=g)[:N_SHARED].tolist()
    s_shared = torch.randperm(pair.vs, generator=g)[:N_SHARED].tolist()
    t_words = [f"t{i}" for i in range(pair.vt)]
    s_words = [f"s{i}" for i in range(pair.vs)]
    for k, (t, s) in enumerate(zip(t_shared, s_shared)):
        t_words[t] = s_words[s] = f"w{k}"
    dirs = (_hf_tokenizer(tmp_path / "t", t_words), _hf_tokenizer(tmp_path / "s", s_words))
    return dirs, list(zip(t_shared, s_shared))


def _trl_reference(uld, pair, student, teacher):
    """TRL's ULDLoss.__call__: answers = every token after BOS (TRL skips the EOS), byte
    offsets that close a group exactly at each chunk's end on both sides."""
    b_rows, s_len = pair.batch.student_ids.shape
    t_len = pair.batch.teacher_ids.shape[1]
    labels = [torch.full((b_rows, n), -100) for n in (s_len, t_len)]
    offsets = [torch.zeros(b_rows, n, 2, dtype=torch.int64) for n in (s_len, t_len)]
    for b, row in enumerate(pair.rows):
        for side, key, inner in ((0, "student_ids", 1), (1, "teacher0_ids", 5)):
            ids = torch.tensor(row[key])
            labels[side][b, 1 : len(ids)] = ids[1:]
            chunk_col = "teacher0_student_chunk" if side == 0 else "teacher0_chunk"
            for c in range(row["teacher0_n_chunks"]):
                pos = [i for i, x in enumerate(row[chunk_col]) if x == c]
                for k, p in enumerate(pos):  # inner ends differ between sides: no early close
                    end = 10 * c + 10 if k == len(pos) - 1 else 10 * c + inner + k
                    offsets[side][b, p] = torch.tensor([end - 1, end])
    return uld(
        student[..., : pair.vs],
        teacher[..., : pair.vt],
        labels[0],
        labels[1],
        pair.batch.student_ids,
        pair.batch.teacher_ids,
        student_byte_offsets=offsets[0],
        teacher_byte_offsets=offsets[1],
    )


def _adapter(tg, opts, pair, student, teacher):
    """The registered mode, as the loop calls it; returns (sum / count, count)."""
    mode = MODES["trl_gold"]
    tables = mode.tables(None, teacher_vocab_size=pair.vt, student_vocab_size=pair.vs)
    spec = mode.teacher_spec(opts, tables, teacher_vocab_size=pair.vt)
    prep = mode.prepare(pair.batch, shift_targets(pair.batch.student_ids, pair.batch.student_len))
    outs = teacher_outputs_from_logits(teacher, spec=spec, columns=mode.columns(tables))
    used = mode.teacher_rows(prep, pair.batch.teacher_ids.shape[1])
    outs.col_logprobs[~used] = 0.0  # the worker computes the used rows only
    out = mode.loss(student, outs, prep, tables=tables, vocab_size=pair.vs, config=opts)
    count = mode.count(prep, None)
    assert int(out.count) == count
    return out.sum / out.count, count


@pytest.mark.parametrize("merge", ["observed", "bayesian"])
@pytest.mark.parametrize("seed", [0, 1])
def test_equals_trl_uld_loss_value_and_gradient(trl_gold, tmp_path, merge, seed):
    pair = make_pair(seed, B=3)
    student, teacher = logits_for(pair, seed + 100)
    (t_dir, s_dir), _ = _vocabs(tmp_path, pair, seed)
    opts = trl_gold.TrlGoldConfig(teacher_tokenizer=t_dir, student_tokenizer=s_dir, merge=merge)
    assert opts.beta == 0.5 and opts.matched_weight is None  # TRL's defaults
    got, count = _adapter(trl_gold, opts, pair, student, teacher)
    assert count == 3  # TRL averages its rows
    want = _trl_reference(trl_gold.uld_for(opts), pair, student, teacher)
    assert want.numel() == 1 and float(want.detach()) > 0
    torch.testing.assert_close(got, want.reshape(()), rtol=1e-5, atol=1e-7)
    (g_got,) = torch.autograd.grad(got, student)
    (g_want,) = torch.autograd.grad(want.sum(), student)
    torch.testing.assert_close(g_got, g_want, rtol=1e-4, atol=1e-8)


def _gold_value(pair, student, teacher, pairs, cfg):
    e = torch.full((pair.Vt,), -1, dtype=torch.int64)
    for t, s in pairs:
        e[t] = s
    tables = GoldTables.from_exact_map(e, teacher_vocab_size=pair.vt, student_vocab_size=pair.vs)
    spec = gold_teacher_spec(cfg, tables, teacher_vocab_size=pair.vt)
    tgt = shift_targets(pair.batch.teacher_ids, pair.batch.teacher_len)
    outs = teacher_outputs_from_logits(teacher, spec=spec, target_ids_BT=tgt, columns=tables.t_ids)
    out = gold(student, outs, index_chunks(pair.batch), tables=tables, vocab_size=pair.vs,
               config=cfg)  # fmt: skip
    return out.sum / out.count


def test_differs_from_gold_by_its_quirks_only(trl_gold, tmp_path):
    """One row, TRL's bayesian merge, our gold with TRL's choices (JSD on the matched
    sub-simplex, no rest bucket) and the same matched pairs: equal. TRL's default merge
    (observed: unshifted logits), its per-row normalisation (three rows) and our gold's
    defaults each change the value."""
    one = make_pair(3, B=1)
    student, teacher = logits_for(one, 303)
    (t_dir, s_dir), pairs = _vocabs(tmp_path, one, 3)
    trl_opts = trl_gold.TrlGoldConfig(teacher_tokenizer=t_dir, student_tokenizer=s_dir)
    bayes = trl_gold.TrlGoldConfig(teacher_tokenizer=t_dir, student_tokenizer=s_dir,
                                   merge="bayesian")  # fmt: skip
    as_trl = GoldConfig(divergence="jsd", beta=0.5, rest_bucket=False)
    ours = _gold_value(one, student, teacher, pairs, as_trl)
    torch.testing.assert_close(_adapter(trl_gold, bayes, one, student, teacher)[0], ours,
                               rtol=1e-4, atol=1e-7)  # fmt: skip
    observed = _adapter(trl_gold, trl_opts, one, student, teacher)[0]
    assert abs(observed.item() - ours.item()) > 1e-3 * abs(ours.item())
    # the off-by-one: observed reads the logits AT the chunk tokens, so the last chunk token's
    # row (which predicts the EOS) gets a gradient; gold (and bayesian) never read it
    last = len(one.rows[0]["student_ids"]) - 2
    assert float(torch.autograd.grad(observed, student)[0][0, last].abs().sum()) > 0
    assert float(torch.autograd.grad(ours, student)[0][0, last].abs().sum()) == 0
    fixed = _gold_value(one, student, teacher, pairs, GoldConfig())  # gold's defaults
    assert abs(fixed.item() - observed.item()) > 0.05 * abs(observed.item())

    three = make_pair(5, B=3, max_chunks=8)  # rows with 0..8 chunks: per-row means differ
    student, teacher = logits_for(three, 505)
    (t_dir, s_dir), pairs = _vocabs(tmp_path / "b3", three, 5)
    bayes = trl_gold.TrlGoldConfig(teacher_tokenizer=t_dir, student_tokenizer=s_dir,
                                   merge="bayesian")  # fmt: skip
    per_row = _adapter(trl_gold, bayes, three, student, teacher)[0]
    per_chunk = _gold_value(three, student, teacher, pairs, as_trl)
    assert abs(per_row.item() - per_chunk.item()) > 1e-3 * abs(per_chunk.item())


def test_registered_only_when_imported_and_options_checked(trl_gold):
    MODES.pop("trl_gold")
    with pytest.raises(ConfigError, match="loss.mode"):
        LossConfig(mode="trl_gold")
    trl_gold.register()
    cfg = LossConfig(mode="trl_gold", options={"merge": "bayesian"})
    assert cfg.mode_options("trl_gold").shift == 1
    with pytest.raises(ConfigError, match=r"loss.options.merge: .*'observed', 'bayesian'"):
        LossConfig(mode="trl_gold", options={"merge": "first"}).mode_options("trl_gold")
    with pytest.raises(ConfigError, match="loss.options.unmatched_weight"):
        LossConfig(mode="trl_gold", options={"matched_weight": 0.5}).mode_options("trl_gold")
    with pytest.raises(ValueError, match="teacher_tokenizer / student_tokenizer are unset"):
        trl_gold.uld_for(trl_gold.TrlGoldConfig())


def test_launcher_fills_the_tokenizers_and_whole_logits_from_the_config(trl_gold):
    from bench.science.trl_gold_train import trl_argv
    from tokenbridge.cli import UsageError
    from trainer.main import load_config

    argv = ["conf=debug", "loss=ce", "loss.mode=trl_gold", "loss.kd_weight=1.0"]
    full = trl_argv(argv)
    cfg = load_config(full)
    assert cfg.loss.options == {
        "teacher_tokenizer": cfg.teachers[0].path,
        "student_tokenizer": cfg.model.path,
    }
    assert cfg.parallel.logits_chunk == 0  # TRL's loss indexes whole logits
    given = [*argv, "+loss.options.student_tokenizer=/x", "parallel.logits_chunk=0"]
    assert trl_argv(given) == [
        *given,
        f"+loss.options.teacher_tokenizer={cfg.teachers[0].path}",
    ]
    with pytest.raises(UsageError, match="parallel.logits_chunk=64 must be 0"):
        trl_argv([*argv, "parallel.logits_chunk=64"])
    assert trl_argv(["conf=debug"]) == ["conf=debug"]  # xtoken: untouched
