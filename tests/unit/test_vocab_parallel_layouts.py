"""Single-process checks of the layout arithmetic behind the TP/CP ops (no process group).

The load-balanced CP layout, packed (cu_seqlens) positions and targets, segment sums and the
world-size-1 path of every collective helper. The multi-process behaviour is in tests/dist.
"""

from __future__ import annotations

import pytest
import torch

from tokenbridge.dist_ops import (
    CPContext,
    cp_all_gather,
    cp_local_rows,
    cp_positions,
    cp_segment_owner,
    cp_segment_sum,
    cp_shift_next,
    from_cp_layout,
    global_count,
    next_token_targets,
    packed_cp_positions,
    packed_logprobs,
    seq_to_vocab_parallel,
    to_cp_layout,
    vocab_to_seq_parallel,
)
from tokenbridge.dist_ops.context_parallel import cp_piece_bounds
from tokenbridge.dist_ops.packed import packed_next_token_targets, packed_sequence_ids
from trainer.parallel.mesh import SINGLE


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_cp_layout_is_a_balanced_permutation(cp_size):
    seq_len = 8 * cp_size
    per_rank = [cp_positions(seq_len, cp_size, r) for r in range(cp_size)]
    assert torch.equal(torch.cat(per_rank).sort().values, torch.arange(seq_len))
    # pieces r and 2CP-1-r: every rank gets the same causal-attention work (sum of positions)
    work = {int(p.sum()) for p in per_rank}
    assert len(work) == 1
    x = torch.arange(2 * seq_len).reshape(2, seq_len)
    local = [to_cp_layout(x, cp_size=cp_size, cp_rank=r) for r in range(cp_size)]
    assert torch.equal(from_cp_layout(torch.cat(local, 1), cp_size=cp_size), x)


def test_cp_local_rows_maps_full_rows_to_local_rows():
    seq_len, cp_size = 8, 2
    flat = torch.arange(2 * seq_len)
    for rank in range(cp_size):
        pos = cp_positions(seq_len, cp_size, rank)
        local = cp_local_rows(flat, seq_len=seq_len, cp_size=cp_size, cp_rank=rank)
        full = flat.reshape(2, seq_len)
        local_view = to_cp_layout(full, cp_size=cp_size, cp_rank=rank).reshape(-1)
        held = local >= 0
        assert int(held.sum()) == 2 * pos.numel()
        assert torch.equal(local_view[local[held]], flat[held])  # row r reads row r's token
    assert cp_local_rows(torch.tensor([-1]), seq_len=8, cp_size=2, cp_rank=0).item() == -1
    single = CPContext(None, seq_len)
    assert torch.equal(single.local_rows(flat), flat) and single.size == 1
    assert torch.equal(single.shard(flat.reshape(2, seq_len)), flat.reshape(2, seq_len))


def test_cp_piece_bounds_values_and_errors():
    assert cp_piece_bounds(16, 2, 0) == [(0, 4), (12, 16)]
    assert cp_piece_bounds(16, 2, 1) == [(4, 8), (8, 12)]
    with pytest.raises(ValueError, match="divisible by 2 \\* CP = 4"):
        cp_piece_bounds(10, 2, 0)
    with pytest.raises(ValueError, match="bad CP rank"):
        cp_piece_bounds(16, 2, 2)


def test_next_token_targets_and_single_process_shift():
    ids = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]])
    assert next_token_targets(ids).tolist() == [[6, 7, 8, -100], [2, 3, 4, -100]]
    x = torch.randn(2, 4, 3, requires_grad=True)
    y = cp_shift_next(x, None, fill=0.0)
    assert torch.equal(y[:, :3], x[:, 1:]) and (y[:, 3] == 0).all()
    assert cp_all_gather(x, None) is x


def test_packed_positions_targets_and_sequence_ids():
    cu = torch.tensor([0, 3, 8])
    cu_pad = torch.tensor([0, 4, 12])
    ids = torch.arange(100, 112)
    targets = packed_next_token_targets(ids, cu, cu_pad)
    # seq 0: real 100..102 (103 pad); seq 1: real 104..108 (109..111 pad)
    assert targets.tolist() == [101, 102, -100, -100, 105, 106, 107, 108, -100, -100, -100, -100]
    assert packed_sequence_ids(cu_pad).tolist() == [0] * 4 + [1] * 8
    r0, r1 = (packed_cp_positions(cu_pad, 2, r) for r in (0, 1))
    assert r0.tolist() == [0, 3, 4, 5, 10, 11]
    assert r1.tolist() == [1, 2, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="sequence 0 has padded length 3"):
        packed_cp_positions(torch.tensor([0, 3, 8]), 2, 0)
    with pytest.raises(ValueError, match="nondecreasing"):
        packed_sequence_ids(torch.tensor([0, 5, 3]))


def test_packed_logprobs_single_process_matches_dense():
    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 3, 8])
    ids = torch.randint(0, 20, (8,), generator=gen)
    logits = torch.randn(8, 20, generator=gen, requires_grad=True)
    out = packed_logprobs(logits, ids, cu, tp_group=None, cp_group=None)
    logp = torch.log_softmax(logits.detach(), -1)
    want = [logp[0, ids[1]] + logp[1, ids[2]], sum(logp[t, ids[t + 1]] for t in range(3, 7))]
    torch.testing.assert_close(out.seq_sums, torch.stack(want), rtol=1e-5, atol=1e-5)
    assert out.mask.tolist() == [1, 1, 0, 1, 1, 1, 1, 0] and out.seq_owner.all()
    out.seq_sums.sum().backward()
    assert logits.grad[2].abs().sum() == 0 and logits.grad[7].abs().sum() == 0


def test_segment_sum_owner_and_count_single_process():
    vals = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    seg = torch.tensor([[0, 0, -1], [2, 2, 2]])
    assert cp_segment_sum(vals, seg, 4, None).tolist() == [3.0, 0.0, 15.0, 0.0]
    assert cp_segment_owner(seg, 4, None).tolist() == [True, False, True, False]
    assert global_count(torch.tensor(7), dp_group=None, cp_group=None).item() == 7.0
    assert SINGLE.global_count(3).item() == 3.0 and SINGLE.tp_size == 1


def test_all_to_all_world_size_one_is_identity_and_checks_shape():
    x = torch.randn(6, 4)
    assert vocab_to_seq_parallel(x, None) is x and seq_to_vocab_parallel(x, None) is x
    with pytest.raises(ValueError, match="expected"):
        vocab_to_seq_parallel(torch.randn(2, 3, 4), None)
