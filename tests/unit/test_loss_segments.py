"""ChunkIndex, collation and segment ops against Python loops over the shard-like rows."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_loss_refs import chunks_of, make_pair
from tokenbridge.losses import collate_aligned, index_chunks, segment_sum
from tokenbridge.losses.ops.segments import dedup_rows


@pytest.mark.parametrize("seed", range(4))
def test_chunk_index_matches_loops(seed):
    pair = make_pair(seed, B=4, bos=seed % 2 == 0, empty_side_prob=0.2)
    idx = index_chunks(pair.batch)
    S, T = pair.batch.student_ids.shape[1], pair.batch.teacher_ids.shape[1]
    ref = chunks_of(pair)
    assert idx.n_chunks == len(ref)
    for g, (b, sp, tp) in enumerate(ref):
        assert int(idx.chunk_row[g]) == b
        for side, pos, width in ((idx.student, sp, S), (idx.teacher, tp, T)):
            assert int(side.count[g]) == len(pos)
            if pos:
                assert int(side.first[g]) == b * width + pos[0]
                assert int(side.last[g]) == b * width + pos[-1]
                want = b * width + pos[0] - 1 if pos[0] > 0 else -1
            else:
                assert int(side.first[g]) == -1
                want = -1
            assert int(side.start_rows()[g]) == want
    # the chunk of the token predicted at each position
    for b, r in enumerate(pair.rows):
        ch = r["teacher0_student_chunk"]
        base = int(pair.batch.n_chunks[:b].sum())
        for i in range(S):
            got = int(idx.student.target_chunk[b * S + i])
            want = ch[i + 1] + base if i + 1 < len(ch) and ch[i + 1] >= 0 else -1
            assert got == want


def test_collate_rejects_bad_rows():
    pair = make_pair(0, B=2)
    bad = [dict(r) for r in pair.rows]
    bad[1]["teacher0_chunk"] = bad[1]["teacher0_chunk"][:-1]
    with pytest.raises(ValueError, match="shard row 1"):
        collate_aligned(bad, 0)
    with pytest.raises(KeyError, match="teacher1_ids"):
        collate_aligned(pair.rows, 1)


def test_index_rejects_chunk_ids_beyond_n_chunks_and_ragged_chunks():
    pair = make_pair(1, B=2, max_chunks=3)
    rows = [dict(r) for r in pair.rows]
    rows[0]["teacher0_n_chunks"] = 0
    rows[0]["teacher0_student_chunk"] = [-1] + [0] * (len(rows[0]["student_ids"]) - 2) + [-1]
    with pytest.raises(ValueError, match="row 0 holds chunk id"):
        index_chunks(collate_aligned(rows, 0))
    rows = [
        {
            "student_ids": [1, 2, 3, 4],
            "teacher0_ids": [5, 6],
            "teacher0_student_chunk": [0, 1, 0, 1],
            "teacher0_chunk": [0, 1],
            "teacher0_n_chunks": 2,
        }
    ]
    with pytest.raises(ValueError, match="not contiguous"):
        index_chunks(collate_aligned(rows, 0))


def test_segment_sum_and_dedup():
    v = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    seg = torch.tensor([2, -1, 2, 0])
    out = segment_sum(v, seg, 3)
    assert out.tolist() == [4.0, 0.0, 4.0]
    (g,) = torch.autograd.grad(out.sum(), v)
    assert g.tolist() == [1.0, 0.0, 1.0, 1.0]
    ids = torch.tensor([[5, -1, 3, 5, 3, 9], [-1, -1, -1, -1, -1, -1]])
    vals = torch.tensor([[0.1, 7.0, 0.2, 0.3, 0.4, 0.5], [1.0] * 6])
    u, w = dedup_rows(ids, vals)
    assert u[0].tolist() == [3, 5, 9, -1, -1, -1]
    torch.testing.assert_close(w[0], torch.tensor([0.6, 0.4, 0.5, 0.0, 0.0, 0.0]))
    assert (u[1] == -1).all() and (w[1] == 0).all()
