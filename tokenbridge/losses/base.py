"""What every loss mode shares: the (sum, count) output, its one normalisation, the divergences.

Modes return a SUM over their terms and the COUNT of terms; `normalize` divides once by the
global count (its docstring says why). The divergences give a zero-probability category
exactly 0 in value and gradient (docs/losses.md, "Divergences").

Legend: N rows (positions or chunks), K categories.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

DIVERGENCES = ("forward", "reverse", "jsd")
NEG_INF = float("-inf")


@dataclass
class LossOutput:
    """A loss as a differentiable SUM over its terms and the COUNT of terms.

    ``metrics`` are detached 0-dim tensors that are themselves sums or counts (additive across
    microbatches and ranks), so the caller can all-reduce them exactly like ``sum`` and ``count``.
    """

    sum: Tensor  # 0-dim, differentiable
    count: Tensor  # 0-dim int64
    metrics: dict[str, Tensor] = field(default_factory=dict)

    def mean(self, global_count: Tensor | int | None = None) -> Tensor:
        """`normalize` by ``global_count`` when given, else by this output's own count."""
        return normalize(self, self.count if global_count is None else global_count)


def normalize(out: LossOutput, global_count: Tensor | int) -> Tensor:
    """The one loss normalisation: ``out.sum / global_count``, a term's share of the step loss.

    The invariant: every term of a training step (CE, each teacher's KD term, each on-policy
    term) is its LOCAL SUM divided once by its GLOBAL count, the count of its terms summed over
    the step's microbatches and all-reduced over the data- and context-parallel ranks, never
    over the tensor-parallel ranks (`tokenbridge.dist_ops.collectives.global_count`; the
    trainer's `ParallelGroups.sum_over_tokens_`). Why:

    - backward on each microbatch's shares, with the gradients SUMMED (not averaged) over dp x cp
      (FSDP's reduce-scatter does that), gives exactly the loss and gradients of the mean over
      the whole global batch, for any microbatch split and any dp or cp size; a per-microbatch
      or per-rank mean would weigh a microbatch with few terms as much as a full one;
    - TP ranks hold the same tokens and compute the same, replicated terms: summing their counts
      would divide by tp times too many (NeMo RL's KD path all-reduces over the whole world);
    - a count depends on the batch only (`LossMode.count`), so the global count is known, and
      all-reduced, before the first backward of the step.

    Each term keeps its own count (KD counts chunks or positions, CE target tokens), so a teacher
    with finer chunks does not weigh more. A count of 0 (no term anywhere) divides by 1.
    """
    count = torch.as_tensor(global_count)
    return out.sum / count.to(out.sum.dtype).clamp(min=1)


def compute_dtype(t: Tensor) -> torch.dtype:
    """float64 stays float64 (gradcheck); everything else (bf16, fp16, fp32) is computed in fp32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def zero_sum_like(logits: Tensor) -> Tensor:
    """A 0-dim zero that is connected to ``logits`` (so backward works) without touching its values.

    ``logits.sum() * 0`` would be NaN when a logit is -inf; summing an empty slice is not.
    A `HeadLogits` (logits never made whole) gives its own, from its hidden states and weight.
    """
    if not isinstance(logits, Tensor):
        return logits.zero_sum().to(compute_dtype(logits))
    return logits.reshape(-1)[:0].sum().to(compute_dtype(logits))


def empty_loss(logits: Tensor, metrics: dict[str, Tensor]) -> LossOutput:
    """No term in this microbatch: a zero sum still connected to ``logits``, and count 0."""
    return LossOutput(zero_sum_like(logits), as_count(0, logits.device), metrics)


class OptionError(ValueError):
    """An invalid option of a loss mode; ``field`` names it (the trainer's config reports it as
    ``loss.options.<field>``)."""

    def __init__(self, owner: str, field: str, reason: str) -> None:
        self.owner, self.field, self.reason = owner, field, reason
        super().__init__(f"{owner}.{field}: {reason}")


def check_option(options: object, name: str, ok: bool, expected: str) -> None:
    """Raise an `OptionError` naming ``options.<name>`` unless ``ok``."""
    if not ok:
        value = getattr(options, name)
        raise OptionError(type(options).__name__, name, f"expected {expected}, got {value!r}")


def check_divergence(options) -> None:
    """``options.divergence`` is one of `DIVERGENCES`, with 0 < ``options.beta`` < 1 for jsd."""
    kind = options.divergence
    check_option(options, "divergence", kind in DIVERGENCES, f"one of {list(DIVERGENCES)}")
    jsd_ok = kind != "jsd" or 0.0 < options.beta < 1.0
    check_option(options, "beta", jsd_ok, "0 < beta < 1 (generalized JSD)")


def _expected_log_ratio(loga: Tensor, logb: Tensor) -> Tensor:
    """sum_k a_k (log a_k - log b_k) over the last dim; a_k = 0 terms are exactly 0 (value + grad)."""
    if not loga.requires_grad and bool(torch.isfinite(loga).all()):
        return (loga.exp() * (loga - logb)).sum(-1)  # nothing to sanitise (the common case)
    # sanitise, then select: torch.where alone would still send the discarded branch a zero
    # gradient times inf (= NaN), so the -inf entries it drops are replaced by 0 first
    keep = loga > NEG_INF
    a = torch.where(keep, loga, 0.0)
    b = torch.where(keep, logb, 0.0)
    return torch.where(keep, a.exp() * (a - b), 0.0).sum(-1)


def divergence(logp_NK: Tensor, logq_NK: Tensor, *, kind: str, beta: float = 0.5) -> Tensor:
    """Per-row divergence between teacher p and student q, both given as log-probs over K categories.

    forward: KL(p || q);  reverse: KL(q || p);
    jsd:     beta * KL(p || m) + (1 - beta) * KL(q || m),  m = beta * p + (1 - beta) * q.
    Returns [N]. Both rows must be proper distributions (the callers add a rest bucket).
    """
    if kind == "forward":
        return _expected_log_ratio(logp_NK, logq_NK)
    if kind == "reverse":
        return _expected_log_ratio(logq_NK, logp_NK)
    if kind == "jsd":
        both_zero = (logp_NK == NEG_INF) & (logq_NK == NEG_INF)
        lp = torch.where(both_zero, 0.0, logp_NK)
        lq = torch.where(both_zero, 0.0, logq_NK)
        logm = torch.logaddexp(lp + math.log(beta), lq + math.log1p(-beta))
        logm = torch.where(both_zero, NEG_INF, logm)
        return beta * _expected_log_ratio(logp_NK, logm) + (1 - beta) * _expected_log_ratio(
            logq_NK, logm
        )
    raise ValueError(f"divergence must be one of {DIVERGENCES}, got {kind!r}")


def divergence_terms(logp_NK: Tensor, logq_NK: Tensor, options) -> tuple[Tensor, Tensor]:
    """tau^2 * D(p || q) per row over K categories whose last is the rest (tail) bucket, with
    D, beta and tau from ``options``; and the student's rest mass per row (detached, a metric).

    The tau^2 factor keeps the gradient's scale independent of the temperature (Hinton et al.).
    """
    terms = divergence(
        logp_NK.to(logq_NK.dtype), logq_NK, kind=options.divergence, beta=options.beta
    )
    return terms * options.temperature**2, logq_NK[:, -1].detach().exp()


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x <= 0, stable at both ends; x == 0 gives -inf with a zero (not NaN) grad."""
    inside = x < 0
    xs = torch.where(inside, x, -1.0)
    val = torch.where(xs < -math.log(2.0), torch.log1p(-xs.exp()), torch.log(-torch.expm1(xs)))
    return torch.where(inside, val, NEG_INF)


def safe_logaddexp(a: Tensor, b: Tensor) -> Tensor:
    """logaddexp whose gradient stays finite where both inputs are -inf (the result is -inf)."""
    both = (a == NEG_INF) & (b == NEG_INF)
    out = torch.logaddexp(torch.where(both, 0.0, a), torch.where(both, 0.0, b))
    return torch.where(both, NEG_INF, out)


def safe_log(x: Tensor) -> Tensor:
    """log(x) for x >= 0 with log(0) = -inf and a zero gradient there (the caller drops it)."""
    pos = x > 0
    return torch.where(pos, torch.log(torch.where(pos, x, 1.0)), NEG_INF)


def as_count(n: Tensor | int, device: torch.device) -> Tensor:
    return torch.as_tensor(n, dtype=torch.int64, device=device).reshape(())
