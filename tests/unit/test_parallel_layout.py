"""Parallel layouts in one process: the config and preflight refusals, the CP mask and the
student's CP share of a microbatch (the multi-rank runs are tests/dist/test_parallel_trainer.py).

Every refusal happens before any weight is read: ConfigError from the config itself (cp that
does not split the padded length) or from the preflight, which reads config.json files only (cp
or tp that the world or the model cannot take).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.unit.test_config import cfg_for, smol, write_synthetic  # noqa: F401 (fixture)
from tokenbridge.dist_ops import cp_positions, to_cp_layout
from trainer.config.schema import ConfigError
from trainer.data.microbatches import IGNORE, collate
from trainer.main import load_config
from trainer.parallel.cp_attention import CPAttention, model_inputs
from trainer.preflight import preflight


def test_cp_must_split_every_padded_sequence_into_2cp_pieces():
    with pytest.raises(ConfigError, match=r"data.pad_to_multiple: parallel.cp=4 cuts each"):
        load_config(["parallel.cp=4", "data.pad_to_multiple=4"])
    with pytest.raises(ConfigError, match=r"parallel.cp: expected >= 1"):
        load_config(["parallel.cp=0"])
    assert load_config(["parallel.cp=2", "data.pad_to_multiple=8"]).parallel.cp == 2


def test_preflight_refuses_a_cp_or_tp_the_world_cannot_take(tmp_path, student_dir, smol):  # noqa: F811
    shards = write_synthetic(tmp_path / "ok", smol, [smol])
    with pytest.raises(ConfigError, match=r"cp=2 x tp=1 must equal the world size 3"):
        preflight(cfg_for(student_dir, shards, parallel={"cp": 2}), world_size=3)
    with pytest.raises(ConfigError, match=r"cp=2 x tp=2 must equal the world size 2"):
        preflight(cfg_for(student_dir, shards, parallel={"cp": 2, "tp": 2}), world_size=2)


def _model_dir(tmp_path, student_dir, config: dict):
    """The student's tokenizer next to another config.json (no weights: random init)."""
    out = tmp_path / config["model_type"]
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (student_dir / name).is_file():
            shutil.copy(student_dir / name, out / name)
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_preflight_refuses_a_model_whose_attention_or_vocab_cannot_be_sharded(
    tmp_path,
    student_dir,
    smol,  # noqa: F811
):
    shards = write_synthetic(tmp_path / "ok", smol, [smol])
    gpt2 = {"model_type": "gpt2", "vocab_size": 49152, "n_embd": 32, "n_layer": 1, "n_head": 2}
    gpt2.update(bos_token_id=0, eos_token_id=0)
    cfg = cfg_for(student_dir, shards, parallel={"cp": 2})
    cfg.model.path = str(_model_dir(tmp_path, student_dir, gpt2))
    cfg.model.overrides = {}
    with pytest.raises(ConfigError, match=r"parallel.cp: model: cp=2 needs attention through"):
        preflight(cfg, world_size=2)
    cfg.parallel.cp, cfg.parallel.tp = 1, 2
    with pytest.raises(ConfigError, match=r"parallel.tp: no tensor-parallel plan for .*gpt2"):
        preflight(cfg, world_size=2)
    # a Llama whose lm_head width the tp size does not split: the logits shards must be equal
    llama = json.loads((student_dir / "config.json").read_text())
    llama.update(vocab_size=49153, num_attention_heads=4, num_key_value_heads=2)
    cfg.model.path = str(_model_dir(tmp_path, student_dir, llama))
    with pytest.raises(ConfigError, match=r"tp=2 does not divide vocab_size .*=49153"):
        preflight(cfg, world_size=2)


def test_cp_mask_is_causal_by_global_positions():
    for rank in (0, 1):
        cp = CPAttention.build(None, seq_len=8, cp_size=2, cp_rank=rank, device="cpu")
        pos = cp_positions(8, 2, rank)
        assert pos.tolist() == ([0, 1, 6, 7] if rank == 0 else [2, 3, 4, 5])
        want = torch.arange(8)[None, :] <= pos[:, None]
        assert torch.equal(cp.allowed_11LT[0, 0], want)
        # (local rows [lo, hi), keys seen up to): piece j of 2 positions sees keys < 2 (j + 1)
        assert cp.pieces == (((0, 2, 2), (2, 4, 8)) if rank == 0 else ((0, 2, 4), (2, 4, 6)))
        assert cp.mask(None) is cp.allowed_11LT
        # the additive masks SDPA gets, one per piece: 0 where seen, -inf elsewhere
        for (lo, hi, k_end), m in zip(cp.pieces, cp.piece_masks(torch.float32, None)):
            assert torch.equal(m[0, 0] == 0, want[lo:hi, :k_end])
        near = cp.mask(3)[0, 0]
        assert torch.equal(near, want & (pos[:, None] - torch.arange(8)[None, :] < 3))


def test_students_cp_share_is_its_positions_of_whole_row_targets():
    rows = [
        {"student_ids": torch.arange(1, 12).numpy(), "text": "a", "teachers": []},
        {"student_ids": torch.arange(20, 25).numpy(), "text": "b", "teachers": []},
    ]
    mb = collate(rows, student_pad=0, teacher_pads=[], pad_to_multiple=8)
    whole = mb.student_rows()
    assert whole.input_ids_BL is mb.input_ids_BT and whole.position_ids_BL is None
    kw = model_inputs(whole, group=None)
    assert set(kw) == {"input_ids", "attention_mask"}  # cp = 1: the unsharded forward exactly
    for rank in (0, 1):
        part = mb.student_rows(cp_size=2, cp_rank=rank)
        pos = cp_positions(16, 2, rank)
        assert part.input_ids_BL.shape == (2, 8) and part.seq_len == 16
        assert torch.equal(part.position_ids_BL, pos.expand(2, -1))
        # the last token of each piece predicts the first token of the next, held elsewhere
        assert torch.equal(part.targets_BL, to_cp_layout(mb.targets_BT, cp_size=2, cp_rank=rank))
        assert torch.equal(part.input_ids_BL, mb.input_ids_BT[:, pos])
    assert int((mb.targets_BT != IGNORE).sum()) == sum(
        int((mb.student_rows(cp_size=2, cp_rank=r).targets_BL != IGNORE).sum()) for r in (0, 1)
    )


def test_shared_batch_teacher_shares_cover_every_row_once_in_order():
    """`SharedBatchTeacher.share`: the rows each rank's teacher computes; gathered in rank order
    and cut to B they are the microbatch's rows (a short share repeats the last row)."""
    from trainer.teacher.dispatch import SharedBatchTeacher

    for rows, n in ((2, 2), (4, 2), (5, 2), (1, 2), (7, 4), (2, 4), (3, 1)):
        shares = [SharedBatchTeacher(None, None, size=n, rank=r).share(rows) for r in range(n)]
        assert len({len(s) for s in shares}) == 1  # equal sizes: the all-gather pairs them
        assert torch.equal(torch.cat(shares)[:rows], torch.arange(rows)), (rows, n)
        assert len(shares[0]) == -(-rows // n)
