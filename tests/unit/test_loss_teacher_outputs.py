"""teacher_outputs_from_logits against full dense log-softmax, preallocation and spec checks."""

from __future__ import annotations

import pytest
import torch

from tokenbridge.losses import (
    TeacherOutputSpec,
    allocate_teacher_outputs,
    teacher_output_fields,
    teacher_outputs_from_logits,
)

NEG = float("-inf")
B, T, V, VOCAB = 2, 9, 30, 26


def _logits(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, V, generator=g) * 3
    x[..., VOCAB:] = 60.0  # padded lm_head columns: must be masked
    x[0, 1, : VOCAB - 2] = NEG  # a row with only 2 finite logits (< k)
    return x


def _targets(seed=1):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, VOCAB, (B, T), generator=g)
    t[:, -1] = -1
    t[1, 5:] = -1
    return t


def _dense(x, tau=1.0):
    y = x.double().clone()
    y[..., VOCAB:] = NEG
    return torch.log_softmax(y / tau, -1)


@pytest.mark.parametrize("tau", [1.0, 2.0])
def test_every_field_matches_dense(tau):
    x, tgt = _logits(), _targets()
    cols = torch.tensor([0, 3, 7, 25, 11, -1])  # -1: an empty slot
    spec = TeacherOutputSpec(
        VOCAB, topk=4, columns=6, rest_sorted=6, target=True, temperature=tau, chunk_size=5
    )
    out = teacher_outputs_from_logits(x, spec=spec, target_ids_BT=tgt, columns=cols)
    lp = _dense(x, tau)
    for b in range(B):
        for t in range(T):
            row = lp[b, t]
            order = torch.argsort(row, descending=True)[:4]
            finite = row[order] > NEG
            ids = torch.where(finite, order, -1)
            assert out.topk_ids[b, t].tolist() == ids.tolist()
            torch.testing.assert_close(
                out.topk_logprobs[b, t].double(), row[order], rtol=1e-5, atol=1e-5
            )
            keep = [v for v in range(V) if v not in ids.tolist()]
            torch.testing.assert_close(
                out.tail_logprob[b, t].double(), torch.logsumexp(row[keep], 0), rtol=1e-5, atol=1e-5
            )
            torch.testing.assert_close(
                out.col_logprobs[b, t, :5].double(), row[cols[:5]], rtol=1e-5, atol=1e-5
            )
            assert out.col_logprobs[b, t, 5] == NEG
            rest = [v for v in range(V) if v not in cols.tolist()]
            torch.testing.assert_close(
                out.col_rest_logprob[b, t].double(),
                torch.logsumexp(row[rest], 0),
                rtol=1e-5,
                atol=1e-5,
            )
            srt = torch.sort(row[rest].exp(), descending=True).values[:6]
            torch.testing.assert_close(
                out.rest_sorted_probs[b, t].double(), srt, rtol=1e-5, atol=1e-6
            )
            want = (
                _dense(x)[b, t, tgt[b, t]]
                if tgt[b, t] >= 0
                else torch.tensor(0.0, dtype=torch.float64)
            )
            torch.testing.assert_close(
                out.target_logprob[b, t].double(), want, rtol=1e-5, atol=1e-5
            )
    assert out.topk_ids[0, 1, 2:].eq(-1).all()  # fewer finite logits than k: empty slots


def test_per_position_columns_are_shipped_with_their_ids():
    x = _logits(2)
    cols = torch.randint(0, VOCAB, (B, T, 3))
    cols[:, :, 1] = (cols[:, :, 0] + 1) % VOCAB  # distinct within a row
    cols[:, :, 2] = -1
    spec = TeacherOutputSpec(VOCAB, columns=3, per_position_columns=True)
    out = teacher_outputs_from_logits(x, spec=spec, columns=cols)
    lp = _dense(x)
    assert torch.equal(out.col_ids, cols.int())
    torch.testing.assert_close(
        out.col_logprobs[..., :2].double(), lp.gather(-1, cols[..., :2]), rtol=1e-5, atol=1e-5
    )
    assert torch.isinf(out.col_logprobs[..., 2]).all()
    rest = lp.scatter(-1, cols[..., :2], NEG)
    torch.testing.assert_close(
        out.col_rest_logprob.double(), torch.logsumexp(rest, -1), rtol=1e-5, atol=1e-5
    )


def test_preallocated_slot_filled_in_pieces_equals_one_call():
    x, tgt = _logits(3), _targets(4)
    spec = TeacherOutputSpec(VOCAB, topk=3, target=True)
    fields = teacher_output_fields(spec, B, T)
    assert fields == {
        "topk_ids": ((B, T, 3), torch.int32),
        "topk_logprobs": ((B, T, 3), torch.float32),
        "tail_logprob": ((B, T), torch.float32),
        "target_logprob": ((B, T), torch.float32),
    }
    slot = allocate_teacher_outputs(spec, B, T, share_memory=True)
    assert all(t.is_shared() for t in slot.tensors().values())
    for t0 in range(0, T, 4):  # logits arriving along T, e.g. from a chunked lm_head
        n = min(4, T - t0)
        teacher_outputs_from_logits(
            x[:, t0 : t0 + n],
            spec=spec,
            target_ids_BT=tgt[:, t0 : t0 + n],
            out=slot.narrow_t(t0, n),
        )
    whole = teacher_outputs_from_logits(x, spec=spec, target_ids_BT=tgt)
    for name, val in whole.tensors().items():
        assert torch.equal(val, getattr(slot, name)), name


def test_bf16_logits_and_bf16_columns():
    x = _logits(5).bfloat16()
    spec = TeacherOutputSpec(VOCAB, columns=4, column_dtype=torch.bfloat16, topk=2)
    out = teacher_outputs_from_logits(x, spec=spec, columns=torch.arange(4))
    assert out.col_logprobs.dtype == torch.bfloat16
    torch.testing.assert_close(
        out.col_logprobs.float(), _dense(x.float())[..., :4].float(), atol=0.05, rtol=0.02
    )


def test_spec_validation_errors():
    x = _logits()
    with pytest.raises(ValueError, match="target_ids"):
        teacher_outputs_from_logits(x, spec=TeacherOutputSpec(VOCAB, target=True))
    with pytest.raises(ValueError, match="column ids of shape"):
        teacher_outputs_from_logits(
            x, spec=TeacherOutputSpec(VOCAB, columns=3), columns=torch.arange(4)
        )
    with pytest.raises(ValueError, match="< teacher vocab_size"):
        teacher_outputs_from_logits(
            x, spec=TeacherOutputSpec(VOCAB, columns=1), columns=torch.tensor([VOCAB])
        )
    with pytest.raises(ValueError, match="lm_head width"):
        teacher_outputs_from_logits(x, spec=TeacherOutputSpec(V + 1, topk=1))
    with pytest.raises(ValueError, match="asks for nothing"):
        TeacherOutputSpec(VOCAB)
    with pytest.raises(ValueError, match="column set"):
        TeacherOutputSpec(VOCAB, rest_sorted=3)


def test_spec_union_serves_two_losses():
    a = TeacherOutputSpec(VOCAB, topk=8)
    b = TeacherOutputSpec(VOCAB, target=True, topk=4)
    u = a.union(b)
    assert (u.topk, u.target) == (8, True)
    with pytest.raises(ValueError):
        a.union(TeacherOutputSpec(VOCAB, topk=1, temperature=2.0))


@pytest.mark.parametrize(("width", "k"), [(262_144, 32), (49_152, 8), (151_936, 32), (30, 4)])
def test_blocked_topk_equals_torch_topk(width, k):
    from tokenbridge.teacher.blocked import topk_blocked

    g = torch.Generator().manual_seed(width)
    x = torch.randn(5, width, generator=g)
    x[1, 1000 : 1000 + 2 * k] += 50.0  # every top value in one or two blocks
    x[2, : width - 3] = NEG  # fewer finite logits than k
    x[3, ::97] = 9.0  # ties at the top: the values still agree
    x[4] = x[4].round(decimals=1)  # many ties everywhere
    vals, ids = topk_blocked(x, k)
    want_vals, want_ids = torch.topk(x, k, dim=-1)
    assert torch.equal(vals, want_vals)
    assert torch.equal(x.gather(1, ids), vals)  # the ids name those values
    assert all(len(set(r)) == k for r in ids.tolist())  # k distinct columns
    assert torch.equal(ids[:2], want_ids[:2])  # no ties: the same ids as torch's


def test_blocked_topk_through_the_outputs_matches_dense():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 16_384, generator=g) * 4
    spec = TeacherOutputSpec(16_384, topk=4, columns=2, rest_sorted=4, chunk_size=4)
    out = teacher_outputs_from_logits(x, spec=spec, columns=torch.tensor([5, 9]))
    lp = torch.log_softmax(x.double(), -1)
    order = torch.argsort(lp, -1, descending=True)
    assert torch.equal(out.topk_ids.long(), order[..., :4])
    torch.testing.assert_close(
        out.topk_logprobs.double(), lp.gather(-1, order[..., :4]), rtol=1e-5, atol=1e-5
    )
    rest = lp.clone()
    rest[..., [5, 9]] = NEG
    want = torch.sort(rest.exp(), -1, descending=True).values[..., :4]
    torch.testing.assert_close(out.rest_sorted_probs.double(), want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("tau", [1.0, 2.0])
@pytest.mark.parametrize("workspace", [False, True])
def test_blocked_passes_match_dense_fields(tau, workspace):
    """Top-k + target without columns take the blocked passes (`teacher.blocked`): every field
    equals the float64 dense log-softmax, the tail exact even below fp32's 1 - sum (~e-16)."""
    from tokenbridge.teacher.blocked import block_size
    from tokenbridge.teacher.outputs import Workspace

    width, vocab, k = 16_384, 16_000, 8
    assert block_size(width, k) == 256  # the blocked path, not torch.topk's
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 5, width, generator=g) * 3
    x[0, 0, 77] = 60.0  # one column holds all but ~e-46 of the mass (at tau 2: ~e-19)
    x[0, 1, : vocab - 3] = NEG  # fewer finite logits than k
    x[1, 2, 4000:4020] = 25.0  # ties at the top, all in one block
    tgt = torch.randint(0, vocab, (2, 5), generator=g)
    tgt[1, -1] = -1
    spec = TeacherOutputSpec(vocab, topk=k, target=True, temperature=tau, chunk_size=4)
    out = teacher_outputs_from_logits(
        x, spec=spec, target_ids_BT=tgt, workspace=Workspace() if workspace else None
    )
    y = x.double()
    y[..., vocab:] = NEG
    lp = torch.log_softmax(y / tau, -1)
    vals = torch.topk(lp, k, -1).values
    torch.testing.assert_close(out.topk_logprobs.double(), vals, rtol=1e-5, atol=1e-5)
    live = vals > NEG
    got = lp.gather(-1, out.topk_ids.long().clamp(min=0))
    assert torch.equal(out.topk_ids >= 0, live)
    torch.testing.assert_close(got[live], vals[live], rtol=1e-5, atol=1e-5)  # ids name them
    tail = lp.scatter(-1, out.topk_ids.long().clamp(min=0), NEG)
    tail = torch.where(live.all(-1, keepdim=True), tail, lp.masked_fill(live_mask(lp, k), NEG))
    torch.testing.assert_close(
        out.tail_logprob.double(), torch.logsumexp(tail, -1), rtol=1e-5, atol=1e-5
    )
    assert -60 < out.tail_logprob[0, 0] < -16  # exact, where log(1 - sum of the top k) is not
    want = torch.log_softmax(y, -1).gather(-1, tgt.clamp(min=0)[..., None])[..., 0]
    want = torch.where(tgt >= 0, want, 0.0)
    torch.testing.assert_close(out.target_logprob.double(), want, rtol=1e-5, atol=1e-5)


def live_mask(lp, k):
    """The top-k columns of each row of ``lp`` (float64) as a bool mask."""
    return torch.zeros_like(lp, dtype=torch.bool).scatter(-1, torch.topk(lp, k, -1).indices, True)
