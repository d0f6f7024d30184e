"""A teacher's top-k (+ target) outputs in one pass over the head's raw output (one device).

The blocked passes (`teacher.blocked`) read fp32 logits that earlier whole-buffer passes
upcast and soft-capped. Here one function reads the head's output as it comes (bf16 on a GPU)
once: per block of columns it upcasts, caps, masks padding, divides by the temperature and keeps
the block's max and its sum of exp(x - that max), in fp32; only the k candidate blocks' columns
(and the target's) are read again. Compiled on CUDA, eager by row groups on the CPU where it
pays (`mode`; docs/losses.md, "Blocked passes over the vocabulary").

Legend: R rows, V columns, B blocks of a row, K top-k, C candidate columns.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from tokenbridge.teacher import blocked

NEG_INF = float("-inf")
MODE_ENV = "TOKENBRIDGE_TEACHER_FUSED"  # auto | compiled | eager | off (docs/losses.md)


@dataclass(frozen=True)
class Transform:
    """Raw head output -> the logits the outputs read: fp32, capped, padding masked, / T."""

    vocab_size: int  # columns >= this are padding: -inf
    softcap: float | None = None  # Gemma's tanh cap, when the head's output is not capped yet
    temperature: float = 1.0
    target: bool = False  # also logZ at temperature 1 (the target's log-prob)

    @property
    def both(self) -> bool:
        """Whether the pass also sums at temperature 1 (a target at another temperature)."""
        return self.target and self.temperature != 1.0


def _capped(x: Tensor, cols: Tensor | None, tf: Transform) -> Tensor:
    """fp32 logits at temperature 1 of raw ``x`` whose column ids are ``cols`` (None: no
    padding among them)."""
    x1 = x.float()
    if tf.softcap:
        x1 = torch.tanh(x1 / tf.softcap) * tf.softcap
    return x1 if cols is None else x1.masked_fill(cols >= tf.vocab_size, NEG_INF)


def _scaled(x1: Tensor, tf: Transform) -> Tensor:
    return x1 if tf.temperature == 1.0 else x1 / tf.temperature


def stats_whole(x_RV: Tensor, tf: Transform, block: int) -> tuple[Tensor, ...]:
    """(maxes [R, B], sums [R, B]) of every block, and at temperature 1 when ``tf.both``: the
    whole-row function `torch.compile` fuses into one read of ``x``. The transform is monotone,
    so a block's max is the transformed max of its raw columns: read from ``x`` itself, it
    leaves the transformed logits one reader (compiled for the CPU, they are not written out)."""
    R, V = x_RV.shape
    B = V // block
    x_RBb = x_RV.view(R, B, block)
    starts_B = torch.arange(B, device=x_RV.device) * block
    if tf.vocab_size < V:
        cols_Bb = starts_B[:, None] + torch.arange(block, device=x_RV.device)
        x_RBb = x_RBb.masked_fill(cols_Bb >= tf.vocab_size, NEG_INF)  # padding never the max
    # a block of padding only is -inf (capped, a raw -inf logit is -cap, as in the dense path)
    top1_RB = _capped(x_RBb.amax(-1), starts_B, tf)
    x1_RBb = _capped(x_RBb, cols_Bb if tf.vocab_size < V else None, tf)
    out = (_scaled(top1_RB, tf), _sums(_scaled(x1_RBb, tf), _scaled(top1_RB, tf)))
    return out + (top1_RB, _sums(x1_RBb, top1_RB)) if tf.both else out


def _sums(x_RBb: Tensor, maxes_RB: Tensor) -> Tensor:
    """Block sums of exp(x - block max); a block of -inf sums to 0 (-inf - -inf: NaN)."""
    sums_RB = (x_RBb - maxes_RB[..., None]).exp().sum(-1)
    return torch.where(maxes_RB > NEG_INF, sums_RB, 0.0)


def stats_groups(x_RV: Tensor, tf: Transform, block: int, work: Tensor) -> tuple[Tensor, ...]:
    """`stats_whole` by groups of `blocked.pass_rows` rows into ``work`` (a flat fp32 buffer of
    that many rows, twice when ``tf.both``), in place: eagerly, each group stays in cache."""
    R, V = x_RV.shape
    B = V // block
    n = blocked.pass_rows(R, V, x_RV.device)
    if work.numel() < n * V * (2 if tf.both else 1):
        raise ValueError(f"stats_groups: work holds {work.numel()} values, needs {n} x {V}")
    out = [x_RV.new_empty(R, B, dtype=torch.float32) for _ in range(4 if tf.both else 2)]
    # fp32 logits that need nothing are read where they lie, not copied
    as_is = x_RV.dtype == torch.float32 and not tf.softcap and not tf.both
    as_is = as_is and tf.temperature == 1.0 and tf.vocab_size >= V
    for r0 in range(0, R, n):
        r1 = min(R, r0 + n)
        first, second = (work[i * (r1 - r0) * V :][: (r1 - r0) * V] for i in (0, 1))
        x1 = x_RV[r0:r1] if as_is else first.view(r1 - r0, V).copy_(x_RV[r0:r1])
        if tf.softcap:
            x1.div_(tf.softcap).tanh_().mul_(tf.softcap)
        if tf.vocab_size < V:
            x1[:, tf.vocab_size :] = NEG_INF
        xs = x1
        if tf.temperature != 1.0:
            xs = torch.div(x1, tf.temperature, out=second.view(r1 - r0, V) if tf.both else x1)
        exp_to = second if tf.both else first  # x1 kept for the sums at temperature 1
        _sums_into(xs.view(r1 - r0, B, block), out[0][r0:r1], out[1][r0:r1], exp_to)
        if tf.both:
            _sums_into(x1.view(r1 - r0, B, block), out[2][r0:r1], out[3][r0:r1], first)
    for maxes, sums in zip(out[::2], out[1::2], strict=True):  # -inf - -inf: NaN
        sums.masked_fill_(maxes == NEG_INF, 0.0)
    return tuple(out)


def _sums_into(xs_nBb: Tensor, maxes_nB: Tensor, sums_nB: Tensor, work: Tensor) -> None:
    """`_sums` and the maxes written into ``maxes`` and ``sums`` (NaN for a block of -inf: zeroed
    later, in one op), exp(xs - max) into ``work`` (which may be ``xs``)."""
    torch.amax(xs_nBb, -1, out=maxes_nB)
    e = torch.sub(xs_nBb, maxes_nB[..., None], out=work[: xs_nBb.numel()].view(xs_nBb.shape))
    torch.sum(e.exp_(), -1, out=sums_nB)


def _rescaled(maxes_RB: Tensor, sums_RB: Tensor) -> tuple[Tensor, Tensor]:
    """(the row's max [R, 1] (0 where all -inf), each block's sum rescaled to it [R, B])."""
    m_R1 = maxes_RB.amax(-1, keepdim=True)
    m_R1 = torch.where(m_R1 > NEG_INF, m_R1, 0.0)
    return m_R1, sums_RB * (maxes_RB - m_R1).exp()


def _log(s_R: Tensor) -> Tensor:
    """log of a row's mass, 0 where it has none (an all -inf row: all-zero outputs)."""
    return torch.where(s_R > 0, s_R, 1.0).log()


def finish(x_RV: Tensor, tgt_R, stats: tuple[Tensor, ...], tf: Transform, *, block: int, k: int):
    """The fields (top-k log-probs ``lp`` and ``ids``, ``tail`` log-prob, with ``tf.target`` the
    target's log-prob at temperature 1 ``target``) from the block stats and the k blocks with
    the largest maxes (exact: `blocked.topk_blocked`), whose columns only are read again. Every
    log-prob is (x - max) - log(mass / e^max), and the tail's log1p(-top mass / mass) while
    the top k hold under half: no fp32 logZ ~ 10 cancelled against a log-prob near 0."""
    R, V = x_RV.shape
    m_R1, rescaled_RB = _rescaled(*stats[:2])
    chosen_RK = torch.topk(stats[0], k, dim=-1).indices
    # the chosen blocks, whole: [R, K, block] copied by blocks, not gathered column by column
    rows_R1 = torch.arange(R, device=x_RV.device)[:, None]
    cand_RKb = x_RV.view(R, V // block, block)[rows_R1, chosen_RK]
    offsets = torch.arange(block, device=x_RV.device)
    cols_RKb = chosen_RK[..., None] * block + offsets if tf.vocab_size < V else None
    cand_RC = _scaled(_capped(cand_RKb, cols_RKb, tf), tf).view(R, -1)
    vals, at_RK = torch.topk(cand_RC, k, dim=-1)
    # the masses (over e^max), each a sum of non-negative terms: the top k; the tail = every
    # block not chosen + the chosen blocks' columns outside the top k
    top_R = (vals - m_R1).exp().sum(-1)
    inside = (cand_RC - m_R1).exp().scatter(1, at_RK, 0.0).sum(-1)
    tail_R = inside + rescaled_RB.scatter(1, chosen_RK, 0.0).sum(-1)
    mass_R = top_R + tail_R
    # log(mass) = log1p(the mass beside the max's e^0 = 1): exact even where that is ~1e-20
    log_mass = torch.log1p((vals[:, 1:] - m_R1).exp().sum(-1) + tail_R)
    q_R = top_R / torch.where(mass_R > 0, mass_R, 1.0)
    tail_lp = torch.where(q_R < 0.5, torch.log1p(-q_R), tail_R.log() - log_mass)
    out = {
        "lp": (vals - m_R1) - log_mass[:, None],
        "ids": chosen_RK.gather(1, at_RK // block) * block + at_RK % block,
        "tail": torch.where(mass_R > 0, tail_lp, NEG_INF),
    }
    if tf.target:
        t_R1 = tgt_R.clamp(min=0)[:, None]
        x1_R = _capped(x_RV.gather(1, t_R1), t_R1, tf)[:, 0]
        if tf.both:
            m1_R1, rescaled1_RB = _rescaled(*stats[2:])
            out["target"] = (x1_R - m1_R1[:, 0]) - _log(rescaled1_RB.sum(-1))
        else:
            out["target"] = (x1_R - m_R1[:, 0]) - log_mass
    return out


def fields_whole(x_RV: Tensor, tgt_R, tf: Transform, *, block: int, k: int):
    """The fields in whole-row ops: the function compiled (eagerly, it would materialise
    several fp32 [R, V] temporaries)."""
    return finish(x_RV, tgt_R, stats_whole(x_RV, tf, block), tf, block=block, k=k)


_FAILED: list[Exception] = []  # the compile's failure, once: later spans run eagerly


@functools.cache
def _compiled():
    return torch.compile(fields_whole, dynamic=None)


def spec_fields(f: dict[str, Tensor], tgt_R) -> dict[str, Tensor]:
    """A spec's fields (`TeacherOutputs` names) from `topk_fields`."""
    out = {
        "topk_ids": torch.where(f["lp"] > NEG_INF, f["ids"], -1),
        "topk_logprobs": f["lp"],
        "tail_logprob": f["tail"],
    }
    if "target" in f:
        out["target_logprob"] = torch.where(tgt_R >= 0, f["target"], 0.0)
    return out


def mode(device, *, dtype: torch.dtype = torch.float32, softcap: float | None = None) -> str:
    """How the fused pass runs on ``device`` for a head output of ``dtype`` with ``softcap``
    still to apply: ``compiled``, ``eager`` or ``off`` (the blocked passes). ``auto`` (the
    default of `MODE_ENV`): compiled on CUDA; elsewhere eager where it measured faster than
    the blocked passes (bf16 logits, a cap to apply), else off (fp32 uncapped: a tie; the
    blocked passes' numbers kept)."""
    want = os.environ.get(MODE_ENV, "auto")
    if want not in ("auto", "compiled", "eager", "off"):
        raise ValueError(f"{MODE_ENV}={want!r}: expected auto, compiled, eager or off")
    if want != "auto":
        return want
    if torch.device(device).type == "cuda":
        return "compiled"
    return "eager" if dtype != torch.float32 or softcap else "off"


def topk_fields(
    x_RV: Tensor, tgt_R, tf: Transform, k: int, *, how: str, work: Tensor | None = None
) -> dict[str, Tensor] | None:
    """The fused fields of raw rows ``x`` (any float dtype) ``how`` = compiled or eager (then in
    row groups through ``work``, fp32, allocated when None), or None where the blocks would not
    pay (`blocked.block_size`) or ``x`` is not contiguous."""
    R, V = x_RV.shape
    block = blocked.block_size(V, k)
    if not block or not x_RV.is_contiguous():
        return None
    if how == "compiled" and not _FAILED:
        torch._dynamo.maybe_mark_dynamic(x_RV, 0)  # one graph for every span's rows
        if tgt_R is not None:
            torch._dynamo.maybe_mark_dynamic(tgt_R, 0)
        try:
            return _compiled()(x_RV, tgt_R, tf, block=block, k=k)
        except torch.OutOfMemoryError:
            raise
        except Exception as err:  # no compiler here (no triton, no C++ compiler): eager, said once
            _FAILED.append(err)
            msg = f"teacher fused pass: torch.compile failed ({err!r}); running it eagerly"
            warnings.warn(msg, stacklevel=2)
    if work is None:
        n = blocked.pass_rows(R, V, x_RV.device) * (2 if tf.both else 1)
        work = x_RV.new_empty(n * V, dtype=torch.float32)
    return finish(x_RV, tgt_R, stats_groups(x_RV, tf, block, work), tf, block=block, k=k)
