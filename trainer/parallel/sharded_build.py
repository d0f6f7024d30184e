"""The student and the teachers as each rank holds them: built on meta, parallelized, filled.

One function per kind of model, composing the verbs in torchtitan's order: the model is built on
the meta device (`tokenbridge.models.build_meta`), the plans are applied there (the student: TP,
CP, activation checkpointing, compile, FSDP2; a teacher: TP over its own group, frozen), and only
then does each rank allocate and fill its own shards (`trainer.parallel.materialize`). Nothing the
size of the whole model is ever held by one rank, on the host or on the device.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from tokenbridge import models
from trainer.config.precision import Precision
from trainer.config.sections import ModelConfig, ParallelConfig, TeacherConfig
from trainer.parallel import parallelize
from trainer.parallel.materialize import materialize
from trainer.parallel.mesh import ParallelGroups


def build_student(
    cfg: ModelConfig,
    *,
    mesh: ParallelGroups,
    parallel: ParallelConfig,
    precision: Precision,
    device: torch.device,
    fill: bool = True,
) -> tuple[nn.Module, list[str]]:
    """The student on this rank, in training mode, and the names of its parameters whose
    gradients `parallelize.sync_replicated_grads` sums over TP. ``fill=False`` leaves the
    shards uninitialised: a resumed run loads its checkpoint into them."""
    model, weights = models.build_meta(cfg, device=device)
    model.train()
    plan = parallelize.tp_plan(model.config.model_type) if mesh.tp_size > 1 else {}
    replicated_grads = parallelize.apply_tp(model, mesh.tp_mesh, plan)
    parallelize.apply_cp(model, mesh.cp_size)
    parallelize.apply_ac(model, parallel.activation_checkpointing, every=parallel.ac_every)
    if parallel.compile:
        parallelize.apply_compile(model)
    mp = MixedPrecisionPolicy(
        param_dtype=models.torch_dtype(precision.param_dtype),
        reduce_dtype=models.torch_dtype(precision.reduce_dtype),
    )
    parallelize.apply_fsdp(
        model,
        mesh.fsdp_mesh,
        mp_policy=mp,
        reshard_after_forward=parallel.reshard_after_forward,
    )
    materialize(model, weights if fill else None, device=device)
    return model, replicated_grads


def build_teacher(
    cfg: TeacherConfig, *, dtype: str, device: torch.device, tp_mesh=None
) -> nn.Module:
    """A frozen teacher on this rank: whole, or tensor-parallel over `tp_mesh` (its own group,
    `cfg.tp` ranks), each rank then reading only its shards of the weights."""
    model, weights = models.build_meta(cfg, dtype=models.torch_dtype(dtype), device=device)
    models.freeze(model)
    if tp_mesh is not None and tp_mesh.size() > 1:
        parallelize.apply_tp(model, tp_mesh, parallelize.tp_plan(model.config.model_type))
    materialize(model, weights, device=device)
    return model
