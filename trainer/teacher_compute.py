"""Outputs recipes: teacher logits -> the few named tensors a loss needs (pure functions).

A worker never ships full-vocabulary fp32 logits: it reduces them on its side to O(T k) numbers
and writes those into the channel's slots. A recipe is a small picklable object with ``spec``
(the maximum shapes, which size the ring) and ``__call__`` (the reduction, chunked over T so the
fp32 log-softmax of a [B, T, V] block never exists at once).

``TopKRecipe`` is the generic one the channel is tested with: top-k ids and log-probs, the tail
log-mass log(1 - sum_k p_k), and the log-prob of the realised next token. The loss library's
own structure (trainer/losses/teacher_outputs.py) plugs in the same way through
``LossOutputsRecipe`` once it exists.

Legend: B = microbatch rows, T = tokens per row, V = teacher vocabulary, k = top-k width.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from trainer.channel import TensorSpec


def tail_logmass(topk_logprobs_BTk: torch.Tensor) -> torch.Tensor:
    """log(1 - sum_k p_k), stable when the top-k hold almost all the mass (then -> -inf)."""
    covered_BT = torch.logsumexp(topk_logprobs_BTk, dim=-1).clamp(max=0.0)
    # -expm1(x) = 1 - e^x without cancellation for x near 0; tiny floor keeps log finite.
    return torch.log((-torch.expm1(covered_BT)).clamp(min=torch.finfo(covered_BT.dtype).tiny))


def topk_outputs(
    logits_BTV: torch.Tensor,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    *,
    k: int,
    chunk: int = 128,
) -> dict[str, torch.Tensor]:
    """Top-k / tail / next-token log-probs of each position, in fp32, chunked over T.

    ``next_logprob[b, t]`` is log p(x[b, t+1] | x[b, <=t]); it is 0 where there is no next
    token (last position, or the next one is padding).
    """
    B, T, _ = logits_BTV.shape
    ids_BTk = torch.empty(B, T, k, dtype=torch.int32, device=logits_BTV.device)
    lp_BTk = torch.empty(B, T, k, dtype=torch.float32, device=logits_BTV.device)
    next_lp_BT = torch.zeros(B, T, dtype=torch.float32, device=logits_BTV.device)
    has_next_BT = torch.zeros(B, T, dtype=torch.bool, device=logits_BTV.device)
    has_next_BT[:, :-1] = attention_mask_BT[:, 1:].bool() & attention_mask_BT[:, :-1].bool()
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        logp_BtV = torch.log_softmax(logits_BTV[:, t0:t1].float(), dim=-1)
        top = torch.topk(logp_BtV, k, dim=-1)
        ids_BTk[:, t0:t1] = top.indices.to(torch.int32)
        lp_BTk[:, t0:t1] = top.values
        n1 = min(t1, T - 1)  # positions t0..n1-1 have a next token inside the row
        if n1 > t0:
            nxt_Bt = input_ids_BT[:, t0 + 1 : n1 + 1].long()
            got_Bt = logp_BtV[:, : n1 - t0].gather(-1, nxt_Bt.unsqueeze(-1)).squeeze(-1)
            next_lp_BT[:, t0:n1] = torch.where(has_next_BT[:, t0:n1], got_Bt, 0.0)
    return {
        "topk_ids": ids_BTk,
        "topk_logprobs": lp_BTk,
        "tail_logmass": tail_logmass(lp_BTk),
        "next_logprob": next_lp_BT,
    }


@dataclass(frozen=True)
class TopKRecipe:
    """Top-k + tail + next-token log-probs (what ``kd_topk`` and chain log-probs need)."""

    k: int = 8
    chunk: int = 128

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"TopKRecipe.k must be >= 1, got {self.k}")

    def spec(self, *, max_batch: int, max_len: int) -> dict[str, TensorSpec]:
        BT, BTk = (max_batch, max_len), (max_batch, max_len, self.k)
        return {
            "topk_ids": TensorSpec(BTk, torch.int32),
            "topk_logprobs": TensorSpec(BTk, torch.float32),
            "tail_logmass": TensorSpec(BT, torch.float32),
            "next_logprob": TensorSpec(BT, torch.float32),
        }

    def __call__(
        self, logits_BTV: torch.Tensor, inputs: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        return topk_outputs(
            logits_BTV, inputs["input_ids"], inputs["attention_mask"], k=self.k, chunk=self.chunk
        )
