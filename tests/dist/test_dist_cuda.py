"""CUDA / NCCL runs of the distributed ops (skipped without a GPU; the gloo cases are the CPU
siblings that always run).

- one process, CUDA tensors (bf16 logits, fp32 upcast inside the chunk loop) vs the CPU dense
  reference;
- two NCCL ranks (needs 2 GPUs): TP = 2 vocab-parallel ops and CP = 2 layout ops on CUDA
  tensors vs the CPU dense reference.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.references import (
    ref_entropy,
    ref_soft_ce,
    ref_target_logprobs,
    value_and_grad,
)
from tokenbridge.dist_ops import (
    cp_all_gather,
    cp_shift_next,
    next_token_targets,
    to_cp_layout,
    vocab_to_seq_parallel,
    vp_entropy,
    vp_soft_ce,
    vp_target_logprobs,
    vp_topk,
)
from trainer.parallel.spawn import spawn

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _data(seed: int, rows: int, vocab: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen) * 3
    ids = torch.randint(0, vocab, (rows, 3), generator=gen)
    t = torch.softmax(torch.randn(rows, vocab, generator=gen), -1)
    return x, ids, t


def test_ops_on_cuda_single_process():
    x, ids, t = _data(0, 64, 1000)
    dev = torch.device("cuda")
    cases = [
        (
            lambda z: vp_target_logprobs(z, ids.to(dev), None, chunk_size=7, temperature=0.8),
            lambda z: ref_target_logprobs(z, ids, temperature=0.8),
        ),
        (lambda z: vp_entropy(z, None, chunk_size=7), ref_entropy),
        (lambda z: vp_soft_ce(z, t.to(dev), None, chunk_size=7), lambda z: ref_soft_ce(z, t)),
    ]
    for op, ref in cases:
        out, grad = value_and_grad(op, x.to(dev))
        ref_out, ref_grad = value_and_grad(ref, x)
        torch.testing.assert_close(out.cpu(), ref_out.float(), **TOL)
        torch.testing.assert_close(grad.cpu(), ref_grad, **TOL)
    xb = x.to(torch.bfloat16)
    out, _ = value_and_grad(lambda z: vp_target_logprobs(z, ids.to(dev), None), xb.to(dev))
    ref_out, _ = value_and_grad(lambda z: ref_target_logprobs(z.float(), ids), xb)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), ref_out.float(), **TOL)


def _nccl_worker(rank: int, world_size: int) -> list[str]:
    dev = torch.device("cuda", torch.cuda.current_device())
    group = torch.distributed.group.WORLD
    errors: list[str] = []

    def close(what, actual, expected):
        try:
            torch.testing.assert_close(actual.detach().cpu(), expected.detach().float(), **TOL)
        except AssertionError as err:
            errors.append(f"rank {rank} {what}: {err}")

    x, ids, t = _data(1, 16, 64)
    sl = slice(rank * 32, (rank + 1) * 32)
    for what, op, ref in (
        (
            "target_logprobs",
            lambda z: vp_target_logprobs(z, ids.to(dev), group, top_p=0.9),
            lambda z: ref_target_logprobs(z, ids, top_p=0.9),
        ),
        ("entropy", lambda z: vp_entropy(z, group, chunk_size=5), ref_entropy),
        ("soft_ce", lambda z: vp_soft_ce(z, t[:, sl].to(dev), group), lambda z: ref_soft_ce(z, t)),
        ("topk", lambda z: vp_topk(z, 5, group)[0], lambda z: z.double().topk(5, -1).values),
    ):
        w = torch.randn(
            ref(x).shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64
        )
        out, grad = value_and_grad(op, x[:, sl].to(dev), w.to(dev))
        ref_out, ref_grad = value_and_grad(ref, x, w)
        close(f"{what} value", out, ref_out)
        close(f"{what} grad", grad, ref_grad[:, sl])
    close(
        "vocab_to_seq", vocab_to_seq_parallel(x[:, sl].to(dev), group), x[rank * 8 : rank * 8 + 8]
    )
    seq = torch.randn(2, 8, 3, generator=torch.Generator().manual_seed(3))
    local = to_cp_layout(seq, cp_size=2, cp_rank=rank).to(dev)
    close("cp_all_gather", cp_all_gather(local, group), seq)
    close(
        "cp_shift_next",
        cp_shift_next(local, group),
        to_cp_layout(next_token_targets(seq, fill=0.0), cp_size=2, cp_rank=rank),
    )
    return errors


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL TP = 2 needs two GPUs")
def test_nccl_tp2_cp2_ops():
    per_rank = spawn(_nccl_worker, world_size=2, backend="nccl", timeout_s=120.0)
    errors = [e for r in per_rank for e in r]
    assert not errors, "\n".join(errors)


def test_cp_attention_function_on_cuda_single_rank():
    """The CP attention function's own path (global-position mask, per-piece SDPA, the K/V
    all-gather of a group of one) on CUDA against transformers' SDPA on the same model."""
    from tests.tiny import tiny_llama
    from trainer.parallel import cp_attention

    ref = tiny_llama(64).cuda()
    model = tiny_llama(64).cuda()
    cp_attention.register()
    model.set_attn_implementation(cp_attention.CP_ATTENTION)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0)).cuda()
    cp = cp_attention.CPAttention.build(None, seq_len=16, cp_size=1, cp_rank=0, device="cuda")
    kw = {"position_ids": cp.positions_L.expand(2, -1), "attention_mask": cp.allowed_11LT}
    got = model(input_ids=ids, cp_attention=cp, use_cache=False, **kw).logits
    want = ref(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, want, **TOL)
    # without the keyword the same model is plain SDPA (eval, sampling)
    torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits, want, **TOL)
