"""Distillation losses: pure functions returning (sum, count, metrics); formulas in docs/losses.md.

Modes: `ce`, `kd_topk` (same tokenizer), `xtoken`, `gold`, `alm` (different tokenizers), their
combination (`combine`) and several teachers (`combine_teachers`); each reads the small
`TeacherOutputs` its `<mode>_teacher_spec` asks for, never the teacher's logits.
"""

from tokenbridge.losses.alm import AlmConfig, alm, alm_teacher_spec, binary_divergence
from tokenbridge.losses.base import DIVERGENCES, LossOutput, divergence, normalize
from tokenbridge.losses.ce import ce, target_logprobs
from tokenbridge.losses.combine import CombineConfig, combine, dynamic_scale
from tokenbridge.losses.gold import GoldConfig, GoldTables, gold, gold_teacher_spec
from tokenbridge.losses.kd_topk import KDTopKConfig, kd_topk, kd_topk_teacher_spec, student_topk_ids
from tokenbridge.losses.multi_teacher import (
    MultiTeacherConfig,
    adaptive_weights,
    combine_teachers,
    static_weights,
    teacher_nll,
    teacher_weights,
)
from tokenbridge.losses.ops.segments import (
    AlignedBatch,
    ChunkIndex,
    ChunkSide,
    collate_aligned,
    index_chunks,
    segment_sum,
    shift_targets,
)
from tokenbridge.losses.xtoken import XTokenConfig, XTokenTables, xtoken, xtoken_teacher_spec
from tokenbridge.teacher.outputs import (
    TeacherOutputs,
    TeacherOutputSpec,
    allocate_teacher_outputs,
    teacher_output_fields,
    teacher_outputs_from_logits,
)

__all__ = [
    "DIVERGENCES",
    "AlignedBatch",
    "AlmConfig",
    "ChunkIndex",
    "ChunkSide",
    "CombineConfig",
    "GoldConfig",
    "GoldTables",
    "KDTopKConfig",
    "LossOutput",
    "MultiTeacherConfig",
    "TeacherOutputSpec",
    "TeacherOutputs",
    "XTokenConfig",
    "XTokenTables",
    "adaptive_weights",
    "allocate_teacher_outputs",
    "alm",
    "alm_teacher_spec",
    "binary_divergence",
    "ce",
    "collate_aligned",
    "combine",
    "combine_teachers",
    "divergence",
    "dynamic_scale",
    "gold",
    "gold_teacher_spec",
    "index_chunks",
    "kd_topk",
    "kd_topk_teacher_spec",
    "normalize",
    "segment_sum",
    "shift_targets",
    "static_weights",
    "student_topk_ids",
    "target_logprobs",
    "teacher_nll",
    "teacher_output_fields",
    "teacher_outputs_from_logits",
    "teacher_weights",
    "xtoken",
    "xtoken_teacher_spec",
]
