"""Likelihood-ratio weights for rollouts drawn from another distribution than the trained one.

With ``onpolicy.sampler_weights: int8`` the student samples from an int8 copy of itself (q),
not from the policy p the step trains; weighting each position's gradient by the ratio of the
completion before it, capped at ``onpolicy.ratio_clip``, makes the step's expectation the
on-policy one up to the cap (docs/onpolicy.md, "Importance weights"). The weights scale the
logits' gradient, so every loss mode is weighted unchanged; the logged loss is unweighted.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from tokenbridge.losses.ops.head_logits import HeadLogits, project
from trainer.onpolicy.sampling.draw import drawn_logprobs
from trainer.onpolicy.sampling.sampler import SamplingConfig

# the step record's means over target positions (`prefix_weights`)
RATIO_STATS = ("ratio/weight_mean", "ratio/clipped_frac", "ratio/abs_log_ratio_mean")


@torch.no_grad()
def policy_logprobs(
    logits_BTV: torch.Tensor, targets_BT: torch.Tensor, *, config: SamplingConfig, vocab: int
) -> torch.Tensor:
    """[B, T] float32: log p of each target token (0 where there is none) under the sampling
    transform of ``config``, over the first ``vocab`` columns (the ones the sampler draws).

    Tempered and restricted to p's top-p nucleus as the sampler restricts q's: a token outside
    p's nucleus has p = 0, and the positions after it weigh 0."""
    out = torch.zeros(targets_BT.shape, dtype=torch.float32, device=targets_BT.device)
    live = (targets_BT >= 0).nonzero(as_tuple=True)
    if not live[0].numel():
        return out
    ids_R = targets_BT[live]
    if not isinstance(logits_BTV, HeadLogits):
        out[live] = drawn_logprobs(logits_BTV.detach()[live][:, :vocab], ids_R, config=config)
        return out
    # logits never whole: the live rows projected a block at a time
    h_RH, lp = logits_BTV.hidden.detach()[live], []
    for a in range(0, len(ids_R), logits_BTV.chunk):
        h = h_RH[a : a + logits_BTV.chunk]
        x = project(h, logits_BTV.weight.detach(), softcap=logits_BTV.softcap)[:, :vocab]
        lp.append(drawn_logprobs(x, ids_R[a : a + len(h)], config=config))
    out[live] = torch.cat(lp)
    return out


def prefix_weights(
    target_BT: torch.Tensor, behaviour_BT: torch.Tensor, targets_BT: torch.Tensor, *, clip: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """(w [B, T], stats): the ratio of each target position's state, w_t = prod_{s<t} p(y_s) /
    q(y_s) over the completion tokens *before* t (not t's own), capped at ``clip`` (inf: no
    cap); 1 where a position has no target. ``target_BT`` and ``behaviour_BT``: log p and log q
    of the token at each target position."""
    live_BT = targets_BT >= 0
    r_BT = torch.where(live_BT, target_BT.double() - behaviour_BT.double(), 0.0)
    # exclusive cumsum by shifting (not cumsum - r: a -inf ratio would make nan)
    before_BT = torch.cat([r_BT.new_zeros(len(r_BT), 1), r_BT.cumsum(-1)[:, :-1]], -1)
    cap = math.log(clip) if math.isfinite(clip) else math.inf
    w_BT = torch.where(live_BT, before_BT.clamp(max=cap).exp(), 1.0)
    n = max(1, int(live_BT.sum()))
    finite = torch.where(live_BT & torch.isfinite(r_BT), r_BT.abs(), 0.0)
    stats = {
        "ratio/weight_mean": float(torch.where(live_BT, w_BT, 0.0).sum()) / n,
        "ratio/clipped_frac": float((live_BT & (before_BT > cap)).sum()) / n,
        "ratio/abs_log_ratio_mean": float(finite.sum()) / n,
    }
    return w_BT.float(), stats


def scale_grad(logits_BTV, w_BT: torch.Tensor):
    """The logits with the gradient that reaches each position's multiplied by its weight: a
    hook on a tensor (returned as it is), ``row_scale`` on a `HeadLogits` (a copy)."""
    if isinstance(logits_BTV, HeadLogits):
        return replace(logits_BTV, row_scale=w_BT.to(logits_BTV.hidden.dtype))
    if logits_BTV.requires_grad:
        w = w_BT.to(logits_BTV.dtype)[..., None]
        logits_BTV.register_hook(lambda g: g * w)
    return logits_BTV
