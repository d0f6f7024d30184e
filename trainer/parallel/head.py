"""The student's logits for every loss: `student_logits`, the one forward for shard batches and
rollouts, and `head_logits`, an lm_head that hands its input and weight to the loss instead of
whole logits.

The lm_head's forward is replaced, not the model's: FSDP2's hooks around the whole model and the
TP plan's around the lm_head keep working as in the whole-logits path (docs/parallelism.md,
"Logits never whole").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from tokenbridge.dist_ops.collectives import copy_to_group
from tokenbridge.dist_ops.dtensor import unwrap_vocab_sharded
from tokenbridge.losses.ops.head_logits import HeadLogits
from trainer.parallel.parallelize import gathered_logits


def final_softcap(config) -> float | None:
    """The model's final-logit soft-capping (Gemma 2 has one), or None."""
    text = getattr(config, "text_config", None) or config
    cap = getattr(text, "final_logit_softcapping", None)
    return float(cap) if cap else None


@dataclass
class HeadCapture:
    """What the lm_head recorded in the forward (`head_logits`); ``logits`` is None until then."""

    logits: HeadLogits | None = None


@contextlib.contextmanager
def head_logits(
    model: nn.Module, *, chunk: int, tp_group=None, gather_vocab: bool = False
) -> Iterator[HeadCapture]:
    """Within the block the model's lm_head records a `HeadLogits` of its input hidden states
    and weight (rows of ``chunk``) in the yielded capture and returns an empty [B, T, 0] tensor,
    so nothing of size T x V is computed. The model's final-logit soft-capping (Gemma 2) is read
    from the config and applied per block (HF's own, applied to the empty tensor, does nothing).

    Under TP the lm_head is column-parallel (`parallelize.shard_vocab`): its input arrives as a
    replicated DTensor and its weight is this rank's vocabulary shard. The hidden states pass
    through `copy_to_group` (the TP ranks' partial gradients are summed in backward), the weight
    is its local shard (its gradient flows back into the DTensor parameter), and the empty output
    is a Shard(-1) DTensor, as the plan's output hook expects. ``gather_vocab`` records the whole
    weight instead (the on-policy losses are not vocab-parallel): every TP rank then computes
    the same loss, and the gather's backward keeps each rank's shard of the weight's gradient."""
    head = model.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        raise ValueError(
            f"{type(model).__name__}: chunked logits need an lm_head without a bias "
            "(set parallel.logits_chunk=0 for the whole-logits path)"
        )
    capture, softcap = HeadCapture(), final_softcap(model.config)

    def forward(hidden):
        weight = head.weight
        if isinstance(weight, DTensor):  # TP: a column-parallel lm_head
            local = hidden.to_local() if isinstance(hidden, DTensor) else hidden
            if gather_vocab:
                w, h = weight.full_tensor(), local
            else:
                w, h = weight.to_local(), copy_to_group(local, tp_group)
            capture.logits = HeadLogits(h, w, softcap, chunk)
            empty = local.new_zeros(*local.shape[:-1], 0)
            return DTensor.from_local(empty, weight.device_mesh, [Shard(-1)], run_check=False)
        capture.logits = HeadLogits(hidden, weight, softcap, chunk)
        return hidden.new_zeros(*hidden.shape[:-1], 0)

    head.forward = forward  # an instance attribute: the module's hooks still run around it
    try:
        yield capture
    finally:
        del head.forward


def student_logits(
    model: nn.Module, inputs: dict, *, chunk: int, tp_group=None, gather_vocab: bool = False
) -> torch.Tensor | HeadLogits:
    """The student's logits on ``inputs`` (its forward's keyword arguments). ``chunk``
    (``parallel.logits_chunk``): a `HeadLogits`, never whole at all, projected block by block
    by every loss; 0: the lm_head's whole output. Under TP (a DTensor lm_head), this rank's
    vocabulary shard [..., V / tp] (the unwrap checks the placement: full-vocabulary logits
    never exist on one rank), or with ``gather_vocab`` the whole vocabulary on every TP rank
    (the on-policy losses are not vocab-parallel; the gather's backward keeps each rank's shard
    of the gradient)."""
    if chunk:
        with head_logits(model, chunk=chunk, tp_group=tp_group, gather_vocab=gather_vocab) as head:
            model(**inputs, use_cache=False)
        return head.logits
    if gather_vocab:
        with gathered_logits(model):
            return model(**inputs, use_cache=False).logits
    logits, _ = unwrap_vocab_sharded(model(**inputs, use_cache=False).logits)
    return logits
