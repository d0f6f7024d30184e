"""`alm`: approximate likelihood matching (tokenkit) over aligned chunks.

Each chunk's text has a chain log-likelihood under either model; the two are compared as
Bernoulli variables ("this model produces this chunk here"), so no vocabulary projection is
needed. Formulas and options: docs/losses.md, "`alm`".

Legend: B batch, S student positions, V student width, G chunks, N = B * S.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from tokenbridge.losses.base import LossOutput, as_count, check_option, empty_loss, log1mexp
from tokenbridge.losses.ce import target_logprobs
from tokenbridge.losses.ops.cp_chunks import chunk_sum, open_chunk_loss, owned_rows
from tokenbridge.losses.ops.rowwise import DEFAULT_CHUNK
from tokenbridge.losses.ops.segments import ChunkIndex, ChunkSide, segment_sum
from tokenbridge.teacher.outputs import TeacherOutputs, TeacherOutputSpec

if TYPE_CHECKING:
    from tokenbridge.dist_ops import CPContext

BINARY_DIVERGENCES = ("kl", "reverse_kl", "ce")


@dataclass(frozen=True)
class AlmConfig:
    divergence: str = "kl"  # kl | reverse_kl | ce
    temperature: float = 1.0  # binarisation temperature
    eps: float = 1e-6

    def __post_init__(self) -> None:
        ok = self.divergence in BINARY_DIVERGENCES
        check_option(self, "divergence", ok, f"one of {list(BINARY_DIVERGENCES)}")
        check_option(self, "temperature", self.temperature > 0, "> 0")
        check_option(self, "eps", self.eps >= 0, ">= 0")


def alm_teacher_spec(config: AlmConfig, *, teacher_vocab_size: int) -> TeacherOutputSpec:
    return TeacherOutputSpec(teacher_vocab_size, target=True)


def _plog(a: Tensor, la: Tensor, lb: Tensor) -> Tensor:
    """a * (la - lb), exactly 0 (value and grad) where a == 0."""
    keep = a > 0
    return torch.where(keep, a * (torch.where(keep, la, 0.0) - torch.where(keep, lb, 0.0)), 0.0)


def _bern_kl(la: Tensor, lb: Tensor) -> Tensor:
    """KL(Bern(e^la) || Bern(e^lb)) for la, lb <= 0."""
    return _plog(la.exp(), la, lb) + _plog(-torch.expm1(la), log1mexp(la), log1mexp(lb))


def binary_divergence(
    logp_t: Tensor, logp_s: Tensor, *, kind: str, temperature: float = 1.0, eps: float = 1e-6
) -> Tensor:
    """Elementwise binarised divergence of chunk log-likelihoods (teacher, student): ``kind``
    kl, reverse_kl or ce (tokenkit's "binary_ce"), formulas in docs/losses.md, "`alm`"."""
    # the -eps shift keeps log(1 - b) finite when b rounds to 1 (as tokenkit)
    la = logp_t / temperature - eps
    lb = logp_s / temperature - eps
    if kind == "kl":
        return _bern_kl(la, lb)
    if kind == "reverse_kl":
        return _bern_kl(lb, la)
    if kind == "ce":
        zero = torch.zeros_like(la)
        return -(_plog(la.exp(), lb, zero) + _plog(-torch.expm1(la), log1mexp(lb), zero))
    raise ValueError(f"binary divergence must be one of {BINARY_DIVERGENCES}, got {kind!r}")


def chunk_chains(
    logits_NV: Tensor,
    teacher: TeacherOutputs,
    index: ChunkIndex,
    *,
    chunks_C: Tensor,
    vocab_size: int,
    chunk_size: int = DEFAULT_CHUNK,
    tp_group=None,
    cp: CPContext | None = None,
) -> tuple[Tensor, Tensor]:
    """(student chain log-prob [C] differentiable, teacher chain log-prob [C]) of chunks_C.

    Under CP each rank scores the chunk tokens it holds; the chain sums are finished over the
    CP group, so every rank gets all C chains (`cp_chunks.chunk_sum`).
    """
    g = index.n_chunks
    wanted = torch.zeros(g + 1, dtype=torch.bool, device=chunks_C.device)
    wanted[chunks_C] = True
    st, te = index.student, index.teacher
    s_rows = (wanted[st.target_chunk] & (st.target_chunk >= 0)).nonzero().squeeze(1)
    ls = student_chain_sums(
        logits_NV,
        st,
        s_rows,
        n_chunks=g,
        vocab_size=vocab_size,
        chunk_size=chunk_size,
        tp_group=tp_group,
        cp=cp,
    )[chunks_C]
    t_lp = teacher.target_logprob.reshape(-1).to(ls.dtype)
    lt = segment_sum(t_lp, te.target_chunk, g)[chunks_C]
    return ls, lt


def student_chain_sums(
    logits_NV: Tensor,
    side: ChunkSide,
    rows_R: Tensor,
    *,
    n_chunks: int,
    vocab_size: int,
    chunk_size: int = DEFAULT_CHUNK,
    tp_group=None,
    cp: CPContext | None = None,
) -> Tensor:
    """[n_chunks] per-chunk sums of the student's target log-probs at the full-sequence flat rows
    ``rows_R`` (differentiable). Under CP each rank scores the rows it holds and the sums are
    finished over the CP group, so every rank gets them all (`cp_chunks.chunk_sum`). Shared by the
    whole chains here and `gold`'s chain prefixes."""
    local, mine = owned_rows(rows_R, cp)
    rows_R = rows_R[mine]
    logq, _ = target_logprobs(
        logits_NV,
        local,
        side.targets[rows_R],
        vocab_size=vocab_size,
        chunk_size=chunk_size,
        tp_group=tp_group,
    )
    return chunk_sum(logq, side.target_chunk[rows_R], n_chunks, cp)


def owned_chain_terms(
    logits: Tensor,
    teacher: TeacherOutputs,
    index: ChunkIndex,
    chunks_C: Tensor,
    *,
    kind: str,
    temperature: float,
    eps: float,
    vocab_size: int,
    chunk_size: int,
    tp_group=None,
    cp: CPContext | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(terms [C], owned [C] bool, student chains [C], teacher chains [C]) of `chunks_C`: the
    binary divergence of each chunk's chain probabilities, and whether this CP rank counts it
    (the holder of its start row). Shared by `alm` and the end-of-turn term (`turns.eot`)."""
    ls, lt = chunk_chains(
        logits,
        teacher,
        index,
        chunks_C=chunks_C,
        vocab_size=vocab_size,
        chunk_size=chunk_size,
        tp_group=tp_group,
        cp=cp,
    )
    _, own = owned_rows(index.student.start_rows()[chunks_C], cp)
    terms = binary_divergence(lt, ls, kind=kind, temperature=temperature, eps=eps)
    return terms, own, ls, lt


def alm(
    student_logits_BSV: Tensor,
    teacher: TeacherOutputs,
    index: ChunkIndex,
    *,
    vocab_size: int,
    config: AlmConfig,
    chunk_size: int = DEFAULT_CHUNK,
    tp_group=None,
    cp: CPContext | None = None,
) -> LossOutput:
    """Binarised chain-likelihood matching over aligned chunks (docs/losses.md, "`alm`").

    Under CP (``cp``: logits in the CP layout, index over whole rows) a chunk's term is counted
    by the rank holding its start row; chains are finished over the CP group (`cp_chunks`).
    """
    logits, chunks, metrics = open_chunk_loss(
        "alm", student_logits_BSV, teacher, index, cp, fields=("target_logprob",)
    )
    if chunks.numel() == 0:
        return empty_loss(logits, metrics)
    terms, own, ls, lt = owned_chain_terms(
        logits,
        teacher,
        index,
        chunks,
        kind=config.divergence,
        temperature=config.temperature,
        eps=config.eps,
        vocab_size=vocab_size,
        chunk_size=chunk_size,
        tp_group=tp_group,
        cp=cp,
    )
    total = terms[own].sum()  # indexed, never skipped: keeps the CP all-reduce in the graph
    metrics.update(
        {
            "kd_sum": total.detach(),
            "teacher_chain_logprob_sum": lt.detach()[own].sum(),
            "student_chain_logprob_sum": ls.detach()[own].sum(),
        }
    )
    return LossOutput(total, as_count(int(own.sum()), logits.device), metrics)
