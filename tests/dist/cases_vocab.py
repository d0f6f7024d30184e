"""Multi-process cases: vocab-parallel ops (TP = 2 and 4) against their dense references.

Every TP rank computes the replicated objective sum(out * w) (w identical on all ranks), so the
gradient of its shard must equal the TP slice of the dense reference's gradient. The TP = 2
cases run on layout (tp=2, dp=2): two TP groups, each checked on its own.
"""

from __future__ import annotations

import torch

from tests.dist.harness import Ctx, case
from tests.dist.references import (
    ref_entropy,
    ref_soft_ce,
    ref_target_logprobs,
    ref_topk,
    value_and_grad,
)
from tokenbridge.dist_ops import (
    reduce_from_tp,
    seq_to_vocab_parallel,
    vocab_to_seq_parallel,
    vp_entropy,
    vp_gather,
    vp_log_softmax,
    vp_logsumexp,
    vp_soft_ce,
    vp_softmax,
    vp_target_logprobs,
    vp_topk,
)

V = 24
TP_LAYOUTS = {2: (2, 1, 2), 4: (4, 1, 1)}


def _logits(ctx: Ctx, *shape: int, salt: str = "x", scale: float = 3.0) -> torch.Tensor:
    return torch.randn(*shape, generator=ctx.generator(salt)) * scale


def _compare(ctx: Ctx, what: str, op, ref, full: torch.Tensor, *, sharded_out: bool) -> None:
    """op(local shard) vs ref(full): values (sliced if per-column) and the shard's gradient."""
    weight_shape = ref(full).shape
    weight = torch.randn(weight_shape, generator=ctx.generator(what), dtype=torch.float64)
    ref_out, ref_grad = value_and_grad(ref, full, weight)
    local_w = ctx.tp_slice(weight) if sharded_out else weight
    out, grad = value_and_grad(op, ctx.tp_slice(full), local_w)
    ctx.close(f"{what} value", out, ctx.tp_slice(ref_out) if sharded_out else ref_out)
    ctx.close(f"{what} grad", grad, ctx.tp_slice(ref_grad))


def _softmax_family(ctx: Ctx) -> None:
    g = ctx.groups.tp
    x = _logits(ctx, 3, 5, V)
    for chunk in (None, 2):
        kw = {"temperature": 0.8, "chunk_size": chunk}
        _compare(
            ctx,
            f"lse/{chunk}",
            lambda z, kw=kw: vp_logsumexp(z, g, **kw),
            lambda z: torch.logsumexp(z.double() / 0.8, -1),
            x,
            sharded_out=False,
        )
        for name, op, ref in (
            ("log_softmax", vp_log_softmax, torch.log_softmax),
            ("softmax", vp_softmax, torch.softmax),
        ):
            _compare(
                ctx,
                f"{name}/{chunk}",
                lambda z, op=op, kw=kw: op(z, g, **kw),
                lambda z, ref=ref: ref(z.double() / 0.8, -1),
                x,
                sharded_out=True,
            )


def _target_logprobs(ctx: Ctx) -> None:
    g = ctx.groups.tp
    x = _logits(ctx, 2, 6, V)
    ids1 = torch.randint(0, V, (2, 6), generator=ctx.generator("ids1"))
    ids1[0, 0] = -100  # owned by no shard: -lse, no one-hot gradient
    idsk = torch.randint(0, V, (2, 6, 4), generator=ctx.generator("idsk"))
    for ids in (ids1, idsk):
        for chunk, temp in ((None, 1.0), (5, 1.3)):
            _compare(
                ctx,
                f"target_logprobs/{ids.dim()}/{chunk}",
                lambda z, ids=ids, c=chunk, t=temp: vp_target_logprobs(
                    z, ids, g, temperature=t, chunk_size=c
                ),
                lambda z, ids=ids, t=temp: _ref_with_unowned(z, ids, t),
                x,
                sharded_out=False,
            )


def _ref_with_unowned(z: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    out = ref_target_logprobs(z, ids, temperature=temperature)
    lse = torch.logsumexp(z.double() / temperature, -1)
    lse = lse if ids.dim() == z.dim() - 1 else lse.unsqueeze(-1)
    return torch.where((ids >= 0) & (ids < z.shape[-1]), out, -lse)


def _sampling(ctx: Ctx) -> None:
    g = ctx.groups.tp
    x = _logits(ctx, 7, V, scale=2.0)
    ids = torch.cat(
        [x.topk(4, -1).indices, torch.randint(0, V, (7, 3), generator=ctx.generator("i"))], -1
    )
    for top_k, top_p in ((3, None), (None, 0.6), (9, 0.75), (None, 0.02)):
        kw = {"temperature": 0.7, "top_k": top_k, "top_p": top_p}
        _compare(
            ctx,
            f"sampling/{top_k}/{top_p}",
            lambda z, kw=kw: vp_target_logprobs(z, ids, g, chunk_size=3, **kw),
            lambda z, kw=kw: ref_target_logprobs(z, ids, **kw),
            x,
            sharded_out=False,
        )


def _gather_topk(ctx: Ctx) -> None:
    g = ctx.groups.tp
    x = _logits(ctx, 4, V)
    ids = torch.randint(-2, V + 2, (4, 5), generator=ctx.generator("ids"))
    owned = (ids >= 0) & (ids < V)
    _compare(
        ctx,
        "gather",
        lambda z: vp_gather(vp_log_softmax(z, g), ids, g),
        lambda z: torch.where(owned, torch.log_softmax(z.double(), -1).gather(-1, ids % V), 0.0),
        x,
        sharded_out=False,
    )
    for k in (1, 5, V):
        vals, top_ids = vp_topk(ctx.tp_slice(x), k, g)
        ref_vals, ref_ids = ref_topk(x, k)
        ctx.check(f"topk/{k} ids", torch.equal(top_ids, ref_ids))
        ctx.close(f"topk/{k} values", vals, ref_vals)
    _compare(
        ctx,
        "topk grad",
        lambda z: vp_topk(z, 6, g)[0],
        lambda z: ref_topk(z, 6)[0],
        x,
        sharded_out=False,
    )


def _entropy_soft_ce(ctx: Ctx) -> None:
    g = ctx.groups.tp
    x = _logits(ctx, 3, 4, V)
    x[..., -2:] = float("-inf")  # padded lm_head columns live on the last shard
    t = torch.softmax(_logits(ctx, 3, 4, V, salt="t"), -1)
    t[..., -2:] = 0.0
    t[0, 0] *= 0.5  # a sub-distribution
    for chunk in (None, 5):
        kw = {"temperature": 1.5, "chunk_size": chunk}
        _compare(
            ctx,
            f"entropy/{chunk}",
            lambda z, kw=kw: vp_entropy(z, g, **kw),
            lambda z: ref_entropy(z, 1.5),
            x,
            sharded_out=False,
        )
        _compare(
            ctx,
            f"soft_ce/{chunk}",
            lambda z, kw=kw: vp_soft_ce(z, ctx.tp_slice(t), g, **kw),
            lambda z: ref_soft_ce(z, t, 1.5),
            x,
            sharded_out=False,
        )


def _all_to_all(ctx: Ctx) -> None:
    g, tp, r = ctx.groups.tp, ctx.tp, ctx.groups.tp_rank
    n = 4 * tp
    x = _logits(ctx, n, V)
    w = torch.randn(n, V, generator=ctx.generator("w"))
    leaf = ctx.tp_slice(x).clone().requires_grad_(True)
    rows = slice(r * n // tp, (r + 1) * n // tp)
    y = vocab_to_seq_parallel(leaf, g)
    ctx.close("vocab_to_seq value", y, x[rows])
    ctx.close("round trip", seq_to_vocab_parallel(y, g), ctx.tp_slice(x))
    # the row-block objective is summed over TP ranks; reduce_from_tp makes it replicated again
    loss = reduce_from_tp((y * w[rows]).sum(), g)
    (grad,) = torch.autograd.grad(loss, leaf)
    ctx.close("vocab_to_seq grad", grad, ctx.tp_slice(w))
    ctx.close("replicated objective", loss, (x * w).sum())
    y_leaf = x[rows].clone().requires_grad_(True)
    back = seq_to_vocab_parallel(y_leaf, g)
    (grad_y,) = torch.autograd.grad((back * ctx.tp_slice(w)).sum(), y_leaf)
    ctx.close("seq_to_vocab grad", grad_y, w[rows])


for _tp, _layout in TP_LAYOUTS.items():
    case(f"tp{_tp}_softmax_family", _layout)(_softmax_family)
    case(f"tp{_tp}_target_logprobs", _layout)(_target_logprobs)
    case(f"tp{_tp}_sampling_topk_topp", _layout)(_sampling)
    case(f"tp{_tp}_gather_topk", _layout)(_gather_topk)
    case(f"tp{_tp}_entropy_soft_ce", _layout)(_entropy_soft_ce)
    case(f"tp{_tp}_all_to_all", _layout)(_all_to_all)


@case("dtensor_vocab_sharded_logits", (4, 1, 1))
def _dtensor(ctx: Ctx) -> None:
    """A DTensor sharded Shard(-1) over the 'tp' dim of a (dp, tp) mesh feeds the ops."""
    # imported here: torch.distributed.tensor costs seconds to import, in every rank
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from tokenbridge.dist_ops.dtensor import unwrap_vocab_sharded

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = _logits(ctx, 3, 8)
    ids = torch.randint(0, 8, (3,), generator=ctx.generator("ids"))
    tp_rank = mesh.get_local_rank("tp")
    leaf = x[:, tp_rank * 4 : (tp_rank + 1) * 4].clone().requires_grad_(True)
    dt = DTensor.from_local(leaf, mesh, [Replicate(), Shard(-1)])
    local, group = unwrap_vocab_sharded(dt)
    out = vp_target_logprobs(local, ids, group)
    ref_out, ref_grad = value_and_grad(lambda z: ref_target_logprobs(z, ids), x, torch.ones(3))
    (grad,) = torch.autograd.grad(out.sum(), leaf)
    ctx.close("dtensor value", out, ref_out)
    ctx.close("dtensor grad", grad, ref_grad[:, tp_rank * 4 : (tp_rank + 1) * 4])
    bad = DTensor.from_local(leaf.detach(), mesh, [Shard(0), Replicate()])
    try:
        unwrap_vocab_sharded(bad)
        ctx.check("dtensor sharded on rows must be refused", False)
    except ValueError as err:
        ctx.check("dtensor error names the placement", "Shard(-1)" in str(err))
