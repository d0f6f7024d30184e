"""How much a teacher agrees with what the student says: its bits per byte of the student's own
completions of held-out prompts.

Measured before and after training, it shows whether on-policy distillation moved the student
towards text the teacher would write (lower: the teacher finds it likelier). Both sides cover
the same bytes: the kept completion chunks (docs/onpolicy.md, "Evaluation").

Legend: B rollouts, U teacher positions, S student positions.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from tokenbridge.teacher.outputs import TeacherOutputs
from tokenbridge.tokenizers import Tokenizer


def completion_nats_bytes(
    aligned, outs: TeacherOutputs, *, student_lengths: np.ndarray
) -> tuple[float, int]:
    """(teacher nats, student bytes) over the kept completion chunks of one microbatch."""
    t_chunk_BU = aligned.teacher_chunk
    u = t_chunk_BU.shape[1]
    pos_U = torch.arange(u, device=t_chunk_BU.device)
    nxt_BU = torch.cat([t_chunk_BU[:, 1:], t_chunk_BU.new_full((t_chunk_BU.shape[0], 1), -1)], 1)
    scored_BU = (nxt_BU >= 0) & (pos_U[None, :] + 1 < aligned.teacher_len[:, None])
    lp_BU = outs.target_logprob[:, :u].to(torch.float64)
    # where, not a product: the teacher leaves NaN at the positions nobody reads (used_mask)
    nats = float(-torch.where(scored_BU, lp_BU, 0.0).sum())
    s_ids = aligned.student_ids[aligned.student_chunk >= 0].cpu().numpy()
    nbytes = int(np.maximum(student_lengths[s_ids], 0).sum())
    return nats, nbytes


def completion_bpb(
    batches, outs: list[list[TeacherOutputs]], names: list[str], *, student: Tokenizer
) -> dict[str, float]:
    """``{"<teacher>": bits per byte}`` of the student's completions.

    bpb_i = sum over teacher tokens of the kept completion chunks of -log p_i(token | prefix),
    over ln 2 times the UTF-8 bytes of the student tokens of those chunks; a special token (the
    paired stop) adds its nats and no bytes."""
    lengths = student.token_lengths
    result = {}
    for j, name in enumerate(names):
        nats, nbytes = 0.0, 0
        for m, (b, _) in enumerate(batches):
            n, k = completion_nats_bytes(b.aligned[j], outs[m][j], student_lengths=lengths)
            nats, nbytes = nats + n, nbytes + k
        result[name] = nats / (math.log(2) * nbytes) if nbytes else float("nan")
    return result
