"""Distributed loss ops: vocab-parallel (TP), context-parallel (CP) and the loss divisor.

Plain local tensors plus explicit process groups; a group of `None` is world size 1, so the
single-process path is the same code. The conventions and what each module is for:
docs/parallelism.md, "The distributed loss ops".
"""

from tokenbridge.dist_ops.all_to_all import seq_to_vocab_parallel, vocab_to_seq_parallel
from tokenbridge.dist_ops.collectives import all_reduce_sum, global_count, reduce_from_tp
from tokenbridge.dist_ops.context_parallel import (
    CPContext,
    cp_all_gather,
    cp_local_rows,
    cp_positions,
    cp_segment_owner,
    cp_segment_sum,
    cp_shift_next,
    from_cp_layout,
    next_token_targets,
    to_cp_layout,
)
from tokenbridge.dist_ops.packed import packed_cp_positions, packed_logprobs
from tokenbridge.dist_ops.vocab_parallel import (
    vp_gather,
    vp_log_softmax,
    vp_logsumexp,
    vp_softmax,
    vp_target_logprobs,
    vp_topk,
)
from tokenbridge.dist_ops.vocab_parallel_xent import vp_entropy, vp_soft_ce

__all__ = [
    "CPContext",
    "all_reduce_sum",
    "cp_all_gather",
    "cp_local_rows",
    "cp_positions",
    "cp_segment_owner",
    "cp_segment_sum",
    "cp_shift_next",
    "from_cp_layout",
    "global_count",
    "next_token_targets",
    "packed_cp_positions",
    "packed_logprobs",
    "reduce_from_tp",
    "seq_to_vocab_parallel",
    "to_cp_layout",
    "vocab_to_seq_parallel",
    "vp_entropy",
    "vp_gather",
    "vp_log_softmax",
    "vp_logsumexp",
    "vp_soft_ce",
    "vp_softmax",
    "vp_target_logprobs",
    "vp_topk",
]
